"""Qwen2 / Qwen2.5 (dense): Llama with a bias on q/k/v (set by ModelArgs.from_hf_config)."""

from pdserve.models.decoder import DecoderLM


class Qwen2ForCausalLM(DecoderLM):
    """Dense SwiGLU layers, q/k/v bias; small sizes tie the embeddings."""
