"""Picks the attention and MoE backends for an engine: 'auto' is Triton on CUDA, torch elsewhere."""

import torch


def make_backends(attention: str, moe: str, device: torch.device) -> tuple[object, object]:
    """(attention backend, MoE backend) for EngineConfig's `attention_backend` / `moe_backend`."""
    gpu = device.type == "cuda"
    for name, choice in (("attention_backend", attention), ("moe_backend", moe)):
        if choice == "triton" and not gpu:
            raise ValueError(f"{name}='triton' needs a CUDA device, got device={str(device)!r} "
                             f"(allowed there: 'auto' or 'torch')")
    if attention == "triton" or (attention == "auto" and gpu):
        from pdserve.ops.triton_attention import TritonAttention  # imports Triton: only when used
        attn = TritonAttention()
    else:
        from pdserve.ops.attention import TorchAttention
        attn = TorchAttention()
    if moe == "triton" or (moe == "auto" and gpu):
        from pdserve.ops.triton_moe import TritonMoE
        experts = TritonMoE()
    else:
        from pdserve.ops.moe import TorchMoE
        experts = TorchMoE()
    return attn, experts
