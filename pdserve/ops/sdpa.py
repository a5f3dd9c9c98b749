"""Prompt attention through torch's SDPA on the GPU path: one prompt, or one chunk of a prompt,
over K/V laid out contiguously (not the paged cache).

Used where SDPA beats our paged kernel: fresh prompts of the GQA path (their own K/V, nothing
cached before them) and every prefill row of Multi-head Latent Attention (its context's latents
up-projected to K/V per step, pdserve.ops.mla_attention).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

# SDPA's cuDNN backend (torch's pick for fresh prompts on Hopper) builds an execution plan the first
# time it meets a sequence length, a cost paid by the first prompt of every new length
# (docs/benchmarks-history.md, 2026-11-24), where flash attention instead costs more on every long
# prompt. So each prompt's rows are padded at the end to a multiple of FRESH_BUCKET:
# causal attention keeps every real row exact (a row attends to keys at or before it, and the
# padding comes after it), the plans are few (chunk_size / FRESH_BUCKET), and the warm-up builds
# each before the replica is ready (TritonAttention.warm_up). The cost: at most FRESH_BUCKET - 1
# more rows of attention per prompt.
FRESH_BUCKET = 128


def padded_len(n: int) -> int:
    """n rounded up to a multiple of FRESH_BUCKET."""
    return -(-n // FRESH_BUCKET) * FRESH_BUCKET


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A prompt with nothing cached before it: q [n, heads, D], k/v [n, kv_heads, D] -> [n, heads, Dv],
    causal, its rows padded to padded_len(n)."""
    n = q.shape[0]
    rows = [q, k, v]
    if padded_len(n) != n:
        rows = [F.pad(t, (0, 0, 0, 0, 0, padded_len(n) - n)) for t in rows]  # zero rows after the prompt
    qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in rows)  # [1, heads, padded, D]
    o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
    return o[0, :, :n].transpose(0, 1)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The last n tokens of a context of ctx (a chunk after a cached prefix): q [n, heads, D], k/v
    [ctx, kv_heads, D] -> [n, heads, Dv]. Query j sits at position ctx - n + j and sees keys up to
    and including it: causality aligned to the lower right, which flash and memory-efficient
    attention take without a mask tensor."""
    n, ctx = q.shape[0], k.shape[0]
    if n == ctx:
        return prompt_attention(q, k, v, scale)
    qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=causal_lower_right(n, ctx), scale=scale,
                                       enable_gqa=ki.shape[1] != qi.shape[1])
    return o[0].transpose(0, 1)
