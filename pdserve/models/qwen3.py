"""Qwen3 (dense): Llama with a per-head RMSNorm on q and k before RoPE (ModelArgs.qk_norm)."""

from pdserve.models.decoder import DecoderLM


class Qwen3ForCausalLM(DecoderLM):
    """Dense SwiGLU layers, q/k norm, explicit head_dim."""
