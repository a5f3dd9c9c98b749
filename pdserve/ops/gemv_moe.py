"""MoE for a handful of tokens (decode at batch 1..8): two GEMV kernels, no sort/align pass.

At T ≤ ~8 the fused path's `moe_align` (one program) and its padded BLOCK_M tiles are pure latency:
almost every expert row is used by one token. Here every (token, expert) pair reads its expert's
rows directly:

1. `_gemv_w13_kernel`, grid (pairs, I / BLOCK_N): one program computes BLOCK_N gate rows and the
   matching BLOCK_N up rows of one pair over the whole hidden dim (16-byte loads along H), applies
   SiLU(gate) * up and stores the pair's intermediate row (in x's dtype, as the fused path does).
   Pairs vary fastest in the grid, so pairs that share an expert read the same rows at about the
   same time (L2 hits).
2. `_gemv_w2_kernel`, grid (T * k / EPP, H / BLOCK_N): one program takes EPP consecutive pairs of
   one token, multiplies each intermediate row by its routing weight and accumulates
   w2[e] @ (w * inter) over them in float32. EPP == k writes the token's output row directly (no
   reduce); EPP < k writes float32 partial rows (more programs at T=1), which the last of a token's
   programs on a tile adds (pdserve/ops/arrival.py; `moe_sum`, a third launch, without counters:
   the decode step at batch 1 0.98x that of the three launches, 2.671 / 2.675 against 2.724-2.728 ms
   on an H200, 2026-11-30). Reading the first pair's expert id before the PDL wait (it was written
   two launches back) was tried beside it: batch 1 0.995x, batch 8 1.002x; not kept.

Each program's loop over the reduced dimension is unrolled (its length a compile-time constant: one
build per model shape), so a program has several tiles' loads in flight, not one at a time: at T=1
a program reads only 8-24 KB, and its loads' latency, not the bytes, set its time.

One kernel for both GEMVs (a program computing a slice of one pair's intermediate, then that slice's
part of the pair's output through w2's matching columns, the partials summed by a second kernel) was
tried and measured slower: decode step 3.50 / 4.96 / 11.04 ms at batch 1 / 2 / 8 against 3.01 / 3.92
/ 8.21 with these two (one H200, 2026-11-30): a program then reads its gate/up rows and its w2 columns
one after the other, 192 programs at T=1, and w2's columns come 64 bytes a row.

Grids depend only on T, k, H, I and the config: no host sync, CUDA-graph safe.
"""

import torch
import triton
import triton.language as tl

from pdserve.ops import arrival, pdl
from pdserve.ops.arrival import last_to_arrive
from pdserve.ops.fused_moe import moe_sum


@triton.jit
def _gemv_w13_kernel(x_ptr, w_ptr, ids_ptr, inter_ptr, I, num_experts,
                     stride_xt, stride_we, stride_wn, stride_it,
                     K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_PDL: tl.constexpr):
    p = tl.program_id(0)
    nt = tl.program_id(1)
    t = p // TOP_K
    pdl.wait(USE_PDL)
    # A skipped pair (id E) computes with the last expert, in bounds; _gemv_w2_kernel weighs it 0.
    e = tl.minimum(tl.load(ids_ptr + p), num_experts - 1).to(tl.int64)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    w_gate = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    w_up = w_gate + I * stride_wn
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: the next tiles' loads go out before this one's sum
        if EVEN_K and EVEN_N:
            xk = tl.load(x_row + k0 + offs_k).to(tl.float32)
            g = tl.load(w_gate + k0).to(tl.float32)
            u = tl.load(w_up + k0).to(tl.float32)
        else:
            k_mask = offs_k < K - k0
            m = n_mask[:, None] & k_mask[None, :]
            xk = tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            g = tl.load(w_gate + k0, mask=m, other=0.0).to(tl.float32)
            u = tl.load(w_up + k0, mask=m, other=0.0).to(tl.float32)
        acc_g += g * xk[None, :]
        acc_u += u * xk[None, :]
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    h = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + p.to(tl.int64) * stride_it + offs_n, h.to(inter_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemv_w2_kernel(inter_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, sum_ptr, counter_ptr, N, num_experts,
                    stride_it, stride_we, stride_wn, stride_ot, stride_st,
                    K: tl.constexpr, EPP: tl.constexpr, GROUPS: tl.constexpr, FUSED_SUM: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_PDL: tl.constexpr):
    """GROUPS (= k / EPP) programs per token and tile of H; with more than one they write float32
    partial rows, which FUSED_SUM has the last of them to finish add (as `moe_sum`: in group order)."""
    grp = tl.program_id(0)
    nt = tl.program_id(1)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    pdl.wait(USE_PDL)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for j in tl.static_range(EPP):
        p = grp * EPP + j
        e = tl.load(ids_ptr + p)
        wt = tl.where(e < num_experts, tl.load(tw_ptr + p).to(tl.float32), 0.0)
        e = tl.minimum(e, num_experts - 1).to(tl.int64)
        a_row = inter_ptr + p.to(tl.int64) * stride_it
        w_rows = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled, as in _gemv_w13_kernel
            if EVEN_K and EVEN_N:
                a = tl.load(a_row + k0 + offs_k).to(tl.float32)
                w = tl.load(w_rows + k0).to(tl.float32)
            else:
                k_mask = offs_k < K - k0
                a = tl.load(a_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
                w = tl.load(w_rows + k0, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            acc += w * (a * wt)[None, :]
    y = tl.sum(acc, 1)
    tl.store(out_ptr + grp.to(tl.int64) * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)
    if FUSED_SUM:
        t = grp // GROUPS
        if last_to_arrive(counter_ptr + t * tl.num_programs(1) + nt, GROUPS):
            total = tl.zeros([BLOCK_N], tl.float32)
            for g in tl.static_range(GROUPS):
                total += tl.load(out_ptr + (t * GROUPS + g).to(tl.int64) * stride_ot + offs_n, mask=n_mask,
                                 other=0.0, cache_modifier=".cg")
            tl.store(sum_ptr + t.to(tl.int64) * stride_st + offs_n, total.to(sum_ptr.dtype.element_ty), mask=n_mask)


def _num_sms(device: torch.device) -> int:
    from pdserve.ops.decode_attention import _num_sms as sms

    return sms(device)


def gemv_config(num_tokens: int, top_k: int, hidden: int, inter: int, device: torch.device) -> dict:
    """Fixed table (no autotuning; `check_kernels --sweep` times alternatives). 32-row tiles since the
    loops are unrolled: at T=1 / 8, 31.8 / 127.6 us against 33.3 / 137.7 for 16-row ones (one H200,
    2026-11-29, `check_kernels --only small --sweep`)."""
    bn13, bk13, bn2, bk2 = 32, 256, 32, 256
    # w2: as many pairs per program as keeps >= 4 programs per SM (EPP == k needs no reduce).
    want = 4 * _num_sms(device)
    n_tiles = triton.cdiv(hidden, bn2)
    epp = top_k
    while epp % 2 == 0 and num_tokens * (top_k // epp) * n_tiles < want:
        epp //= 2
    return dict(BLOCK_N13=bn13, BLOCK_K13=bk13, BLOCK_N2=bn2, BLOCK_K2=bk2, EPP=epp, num_warps=4)


def gemv_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as `fused_moe`: x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights [T, k]
    float32, topk_ids [T, k] -> [T, H]. Meant for small T (every pair reads its expert's rows)."""
    num_tokens, hidden = x.shape
    inter_size = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    assert x.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1 and out.stride(1) == 1
    cfg = config or gemv_config(num_tokens, top_k, hidden, inter_size, x.device)
    ids = topk_ids.contiguous()
    tw = topk_weights.contiguous()
    num_pairs = num_tokens * top_k
    bn13, bk13 = cfg["BLOCK_N13"], min(cfg["BLOCK_K13"], triton.next_power_of_2(hidden))
    bn2, bk2 = cfg["BLOCK_N2"], min(cfg["BLOCK_K2"], triton.next_power_of_2(inter_size))
    epp = cfg["EPP"]
    assert top_k % epp == 0
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    _gemv_w13_kernel[(num_pairs, triton.cdiv(inter_size, bn13))](
        x, w13, ids, inter, inter_size, w13.shape[0],
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        K=hidden, TOP_K=top_k, BLOCK_N=bn13, BLOCK_K=bk13, EVEN_K=hidden % bk13 == 0, EVEN_N=inter_size % bn13 == 0,
        num_warps=cfg["num_warps"], **pdl.launch_kwargs(x.device))
    groups = num_tokens * (top_k // epp)
    y = out if epp == top_k else torch.empty(groups, hidden, dtype=torch.float32, device=x.device)
    n_tiles = triton.cdiv(hidden, bn2)
    counters = None if epp == top_k else arrival.counters(x.device, num_tokens * n_tiles)
    _gemv_w2_kernel[(groups, n_tiles)](
        inter, w2, ids, tw, y, out, counters if counters is not None else ids, hidden, w2.shape[0],
        inter.stride(0), w2.stride(0), w2.stride(1), y.stride(0), out.stride(0),
        K=inter_size, EPP=epp, GROUPS=top_k // epp, FUSED_SUM=counters is not None,
        BLOCK_N=bn2, BLOCK_K=bk2, EVEN_K=inter_size % bk2 == 0, EVEN_N=hidden % bn2 == 0,
        num_warps=cfg["num_warps"], **pdl.launch_kwargs(x.device))
    if epp != top_k and counters is None:
        moe_sum(y, num_tokens, top_k // epp, out=out)
    return out
