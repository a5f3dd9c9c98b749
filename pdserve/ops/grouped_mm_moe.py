"""MoE for large batches through `torch._grouped_mm` (bf16 on CUDA): one grouped GEMM per projection.

The (token, expert) pairs are sorted by expert; the sorted rows of x go through one grouped GEMM
with w13, SiLU-and-mul, one grouped GEMM with w2, and a weighted sum back into token order. No
host sync: the group offsets stay on the device. Pairs with expert id E (skipped: expert parallel,
served elsewhere) sort after the last group; `_grouped_mm` computes rows up to the last offset
only, and `moe_sum` leaves the rest out.
"""

import torch

from pdserve.ops.activation import silu_and_mul
from pdserve.ops.fused_moe import moe_sum


def grouped_mm_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k] float32, topk_ids [T, k] -> [T, H]."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat = topk_ids.flatten()
    # Radix sort makes a pass per key byte: int64 ids took 8, a visible part of a long prompt's step;
    # ids up to E fit one byte for E < 255.
    keys = flat.to(torch.uint8 if num_experts < 255 else torch.int16 if num_experts < 32767 else flat.dtype)
    order = torch.argsort(keys, stable=True)  # sorted position -> pair
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=x.device)  # + the skipped pairs
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts[:num_experts], 0, dtype=torch.int32)  # end row of each expert's group
    rows = x[order // top_k]  # [T*k, H]
    # B operands are views [E, K, N] of the stored [E, N, K] weights (column-major per expert).
    h = torch._grouped_mm(rows, w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    y = torch._grouped_mm(silu_and_mul(h), w2.transpose(1, 2), offs=offs)  # [T*k, H]
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=x.device)  # pair -> sorted position
    return moe_sum(y, num_tokens, top_k, rows=position, weights=topk_weights.contiguous(), out=out,
                   ids=flat, num_experts=num_experts)
