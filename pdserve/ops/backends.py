"""Picks the attention, MoE and norms backends for an engine: 'auto' is Triton on CUDA, torch elsewhere."""

from typing import NamedTuple

import torch


class Backends(NamedTuple):
    attention: object  # TorchAttention | TritonAttention
    moe: object  # TorchMoE | TritonMoE
    norms: object  # TorchNorms | TritonNorms: RMSNorm and RoPE


def make_backends(attention: str, moe: str, device: torch.device) -> Backends:
    """The backends for EngineConfig's `attention_backend` / `moe_backend`. The norms follow the
    attention choice: 'torch' attention is the reference path, and keeps its norms and RoPE whole."""
    gpu = device.type == "cuda"
    for name, choice in (("attention_backend", attention), ("moe_backend", moe)):
        if choice == "triton" and not gpu:
            raise ValueError(f"{name}={choice!r} needs a CUDA device, got device={str(device)!r} "
                             f"(allowed there: 'auto' or 'torch')")
    if attention == "triton" or (attention == "auto" and gpu):
        from pdserve.ops.triton_attention import TritonAttention  # imports Triton: only when used
        from pdserve.ops.triton_norms import TritonNorms
        attn, norms = TritonAttention(), TritonNorms()
    else:
        from pdserve.ops.attention import TorchAttention
        from pdserve.ops.norms import TorchNorms
        attn, norms = TorchAttention(), TorchNorms()
    if moe == "triton" or (moe == "auto" and gpu):
        from pdserve.ops.triton_moe import TritonMoE
        experts = TritonMoE()
    else:
        from pdserve.ops.moe import TorchMoE
        experts = TorchMoE()
    return Backends(attn, experts, norms)
