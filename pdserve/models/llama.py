"""Llama (2, 3, 3.1+): the plain decoder. Optional `attention_bias` (q/k/v/o), RoPE scaling incl. llama3."""

from pdserve.models.decoder import DecoderLM


class LlamaForCausalLM(DecoderLM):
    """Dense SwiGLU layers; everything Llama-specific is already DecoderLM's default."""
