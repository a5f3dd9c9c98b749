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
   reduce); EPP < k writes float32 partial rows that `moe_sum` adds (more programs at T=1).

Each program's loop over the reduced dimension is unrolled (its length a compile-time constant: one
build per model shape), so a program has several tiles' loads in flight, not one at a time: at T=1
a program reads only 8-24 KB, and its loads' latency, not the bytes, set its time.

`FUSED` (a config key; `PDSERVE_GEMV_FUSED=1` makes it the default until it is measured): one
kernel for both GEMVs, `_gemv_fused_kernel`, grid (pairs, I / BLOCK_I): a program computes BLOCK_I
intermediate values of one pair (its gate and up rows over the whole hidden dim) and at once their
part of the pair's output, w2[e][:, slice] @ (w * inter[slice]), written as a float32 partial row;
`_gemv_reduce_kernel` adds a token's k * I / BLOCK_I partials in a fixed order (deterministic: no
atomics). Every weight byte is still read once, the intermediate never goes through memory, and one
launch and its tail go (the down GEMV read 25 MB in 11.9 µs against a 5.9 µs floor at T=1, one
H200: latency, not bytes). The partials cost 2 x pairs x I / BLOCK_I x H x 4 bytes of traffic (1.5 MB
at T=1 for Qwen3-30B-A3B's shape against 75 MB of weights).

Grids depend only on T, k, H, I and the config: no host sync, CUDA-graph safe.
"""

import os

import torch
import triton
import triton.language as tl

from pdserve.ops import pdl
from pdserve.ops.fused_moe import moe_sum

FUSED = os.environ.get("PDSERVE_GEMV_FUSED", "0") == "1"  # the default config's; off until timed on a GPU


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
def _gemv_w2_kernel(inter_ptr, w_ptr, ids_ptr, tw_ptr, out_ptr, N, num_experts,
                    stride_it, stride_we, stride_wn, stride_ot,
                    K: tl.constexpr, EPP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_PDL: tl.constexpr):
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


@triton.jit
def _gemv_fused_kernel(x_ptr, w13_ptr, w2_ptr, ids_ptr, tw_ptr, part_ptr, I, num_experts,
                       stride_xt, stride_w13e, stride_w13n, stride_w2e, stride_w2n,
                       H: tl.constexpr, TOP_K: tl.constexpr, SLICES: tl.constexpr, BLOCK_I: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, EVEN_K: tl.constexpr,
                       EVEN_I: tl.constexpr, EVEN_H: tl.constexpr, USE_PDL: tl.constexpr):
    p = tl.program_id(0)
    s = tl.program_id(1)
    t = p // TOP_K
    pdl.wait(USE_PDL)
    e = tl.load(ids_ptr + p)
    # A skipped pair (id E) computes with the last expert, in bounds, and weighs 0.
    wt = tl.where(e < num_experts, tl.load(tw_ptr + p).to(tl.float32), 0.0)
    e = tl.minimum(e, num_experts - 1).to(tl.int64)
    offs_i = s * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < I
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    w_gate = w13_ptr + e * stride_w13e + offs_i[:, None].to(tl.int64) * stride_w13n + offs_k[None, :]
    w_up = w_gate + I * stride_w13n
    acc_g = tl.zeros([BLOCK_I, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_I, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, H, BLOCK_K):  # unrolled, as in _gemv_w13_kernel
        if EVEN_K and EVEN_I:
            xk = tl.load(x_row + k0 + offs_k).to(tl.float32)
            g = tl.load(w_gate + k0).to(tl.float32)
            u = tl.load(w_up + k0).to(tl.float32)
        else:
            k_mask = offs_k < H - k0
            m = i_mask[:, None] & k_mask[None, :]
            xk = tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            g = tl.load(w_gate + k0, mask=m, other=0.0).to(tl.float32)
            u = tl.load(w_up + k0, mask=m, other=0.0).to(tl.float32)
        acc_g += g * xk[None, :]
        acc_u += u * xk[None, :]
    gate = tl.sum(acc_g, 1)
    up = tl.sum(acc_u, 1)
    # Rounded to x's dtype as the two-kernel path stores it, then weighted as it weighs it.
    h = (gate / (1.0 + tl.exp(-gate)) * up).to(x_ptr.dtype.element_ty).to(tl.float32) * wt
    h = tl.where(i_mask, h, 0.0)
    offs_h = tl.arange(0, BLOCK_H)
    w_down = w2_ptr + e * stride_w2e + offs_h[:, None].to(tl.int64) * stride_w2n + offs_i[None, :]
    part_row = part_ptr + (p * SLICES + s).to(tl.int64) * H + offs_h
    for h0 in tl.static_range(0, H, BLOCK_H):  # unrolled: this slice's columns of w2, all its rows
        if EVEN_I and EVEN_H:
            w = tl.load(w_down + h0 * stride_w2n).to(tl.float32)
            tl.store(part_row + h0, tl.sum(w * h[None, :], 1))
        else:
            h_mask = offs_h < H - h0
            w = tl.load(w_down + h0 * stride_w2n, mask=h_mask[:, None] & i_mask[None, :], other=0.0).to(tl.float32)
            tl.store(part_row + h0, tl.sum(w * h[None, :], 1), mask=h_mask)


@triton.jit
def _gemv_reduce_kernel(part_ptr, out_ptr, H, stride_ot, ROWS: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] = the sum of token t's ROWS partial rows (its pairs' slices), in a fixed order."""
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    offs_r = tl.arange(0, BLOCK_R)
    pdl.wait(USE_PDL)
    rows = part_ptr + t.to(tl.int64) * ROWS * H + offs_r[:, None].to(tl.int64) * H + offs_h[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_H], tl.float32)
    for r0 in tl.static_range(0, ROWS, BLOCK_R):
        acc += tl.load(rows + r0 * H, mask=(offs_r < ROWS - r0)[:, None] & h_mask[None, :], other=0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_h, tl.sum(acc, 0).to(out_ptr.dtype.element_ty),
             mask=h_mask)


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
    return dict(BLOCK_N13=bn13, BLOCK_K13=bk13, BLOCK_N2=bn2, BLOCK_K2=bk2, EPP=epp, num_warps=4,
                FUSED=FUSED, BLOCK_I=32, BLOCK_HD=256)


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
    if cfg.get("FUSED"):
        _fused(x, w13, w2, tw, ids, cfg, out)
        return out
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
    _gemv_w2_kernel[(groups, triton.cdiv(hidden, bn2))](
        inter, w2, ids, tw, y, hidden, w2.shape[0],
        inter.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        K=inter_size, EPP=epp, BLOCK_N=bn2, BLOCK_K=bk2, EVEN_K=inter_size % bk2 == 0, EVEN_N=hidden % bn2 == 0,
        num_warps=cfg["num_warps"], **pdl.launch_kwargs(x.device))
    if epp != top_k:
        moe_sum(y, num_tokens, top_k // epp, out=out)
    return out


def _fused(x, w13, w2, tw, ids, cfg: dict, out: torch.Tensor) -> None:
    """Both GEMVs in `_gemv_fused_kernel`, then the partials' sum into `out`."""
    num_tokens, hidden = x.shape
    inter_size, top_k = w13.shape[1] // 2, ids.shape[1]
    bi = min(cfg["BLOCK_I"], triton.next_power_of_2(inter_size))
    bk = min(cfg["BLOCK_K13"], triton.next_power_of_2(hidden))
    bh = min(cfg["BLOCK_HD"], triton.next_power_of_2(hidden))
    slices = triton.cdiv(inter_size, bi)
    part = torch.empty(num_tokens * top_k * slices, hidden, dtype=torch.float32, device=x.device)
    _gemv_fused_kernel[(num_tokens * top_k, slices)](
        x, w13, w2, ids, tw, part, inter_size, w13.shape[0],
        x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
        H=hidden, TOP_K=top_k, SLICES=slices, BLOCK_I=bi, BLOCK_K=bk, BLOCK_H=bh, EVEN_K=hidden % bk == 0,
        EVEN_I=inter_size % bi == 0, EVEN_H=hidden % bh == 0, num_warps=cfg["num_warps"],
        **pdl.launch_kwargs(x.device))
    rows = top_k * slices
    block_h = min(32, triton.next_power_of_2(hidden))
    _gemv_reduce_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        part, out, hidden, out.stride(0), ROWS=rows, BLOCK_R=min(64, triton.next_power_of_2(rows)),
        BLOCK_H=block_h, num_warps=4, **pdl.launch_kwargs(x.device))
