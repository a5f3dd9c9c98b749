"""Fused MoE in Triton for small (decode) batches: no host sync, fixed grids, CUDA-graph safe.

1. `moe_align`: one program sorts the T*k (token, expert) pairs by expert and pads each expert's
   run to a multiple of BLOCK_M ("moe_align_block_size"), so every BLOCK_M tile of the sorted list
   belongs to one expert. Padding entries hold the sentinel T*k.
2. `_moe_gemm_kernel` over those tiles, twice: x @ w13[e]^T with SiLU(gate) * up fused in the
   epilogue (gate and up columns of one tile are computed together), then @ w2[e]^T with the
   routing weight multiplied in the epilogue. Rows are written per pair, in pair order.
3. `moe_sum`: each token's k rows summed in float32.

A pair whose expert id is E (the number of experts: an expert-parallel rank's "served elsewhere")
is skipped: `moe_align` places it in no tile, so no GEMM computes it, and `moe_sum` leaves its
(never written) row out.

The grids are sized from an upper bound on the padded length (T*k + min(E, T*k) * (BLOCK_M - 1));
tiles past the real end (read on the device) return at once.
"""

import torch
import triton
import triton.language as tl

from pdserve.ops import pdl


# Sizes that change with the batch are not specialised on: one compile serves every batch size.
@triton.jit(do_not_specialize=["num_pairs", "padded_len", "num_tiles"])
def _moe_align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, cursor_ptr,
                      num_pairs, num_experts, padded_len, num_tiles,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    e = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=(i < num_pairs) & (ids < num_experts))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + e, ends - padded)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for p0 in range(0, padded_len, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + p, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=p < padded_len)
    # A tile's expert: the number of experts whose padded run ends at or before the tile's start.
    for b0 in range(0, num_tiles, 64):
        tile = b0 + tl.arange(0, 64)
        done = (ends[None, :] <= (tile * BLOCK_M)[:, None]) & (e < num_experts)[None, :]
        tl.store(expert_ids_ptr + tile, tl.sum(done.to(tl.int32), 1), mask=tile < num_tiles)
    tl.debug_barrier()  # cursors and padding are written before any pair claims its slot
    for c0 in range(0, num_pairs, CHUNK):
        i = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + i, mask=i < num_pairs, other=0).to(tl.int32)
        placed = (i < num_pairs) & (ids < num_experts)  # a skipped pair gets no slot
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=placed)
        tl.store(sorted_ptr + slot, i, mask=placed)


# One program does the whole sort; with 16 warps its histogram, scatter and padding passes run
# faster than with 4, at a prompt's MoE layer and at a decode batch alike
# (docs/benchmarks-history.md, light load and first requests, 2026-11-27).
ALIGN_WARPS, ALIGN_CHUNK = 16, 2048


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] -> sorted pair ids [P] int32 (T*k = padding), expert of each BLOCK_M tile
    [P / block_m] int32, real padded length [1] int32 (device). P is a host-side upper bound."""
    num_pairs = topk_ids.numel()
    padded_len = _padded_len(num_pairs, num_experts, block_m)
    num_tiles = padded_len // block_m
    dev = topk_ids.device
    sorted_ids = torch.empty(padded_len, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    cursor = torch.empty(block_e, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](topk_ids, sorted_ids, expert_ids, num_padded, cursor,
                            num_pairs, num_experts, padded_len, num_tiles,
                            BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=ALIGN_CHUNK,
                            num_warps=ALIGN_WARPS, **pdl.launch_kwargs(dev))
    return sorted_ids, expert_ids, num_padded


def _padded_len(num_pairs: int, num_experts: int, block_m: int) -> int:
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                     num_pairs, N, K,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
                     A_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr, PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    pdl.wait(USE_PDL)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_mask = pair < num_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_bn = offs_n % N  # columns past N read a valid column; the store masks them
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_DIV).to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:  # the up projection's rows sit N rows below the gate's
            if EVEN_K:
                b_up = tl.load(b_ptrs + N * stride_bn)
            else:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None], other=0.0)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair, mask=row_mask, other=0.0)[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & (offs_n < N)[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, rows_ptr, w_ptr, ids_ptr, num_experts, H, stride_y, stride_o,
                    TOP_K: tl.constexpr, HAS_ROWS: tl.constexpr, HAS_WEIGHTS: tl.constexpr,
                    HAS_IDS: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0)
    pdl.wait(USE_PDL)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        row = t * TOP_K + j
        if HAS_ROWS:
            row = tl.load(rows_ptr + row)
        y = tl.load(y_ptr + row.to(tl.int64) * stride_y + h, mask=h_mask, other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            y = y * tl.load(w_ptr + t * TOP_K + j)
        if HAS_IDS:  # a skipped pair's row was never written: whatever it holds (NaN too) stays out
            y = tl.where(tl.load(ids_ptr + t * TOP_K + j) < num_experts, y, 0.0)
        acc += y
    tl.store(out_ptr + t * stride_o + h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def moe_sum(y: torch.Tensor, num_tokens: int, top_k: int, rows: torch.Tensor | None = None,
            weights: torch.Tensor | None = None, out: torch.Tensor | None = None,
            ids: torch.Tensor | None = None, num_experts: int = 0) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[rows[t*k + j]] (rows, weights optional) -> [T, H] in y's dtype;
    with `ids` [T, k] (contiguous), only over the pairs whose id is below `num_experts`."""
    h = y.shape[1]
    if out is None:
        out = torch.empty(num_tokens, h, dtype=y.dtype, device=y.device)
    if num_tokens == 0:
        return out
    block_h = min(1024, triton.next_power_of_2(h))
    _moe_sum_kernel[(num_tokens, triton.cdiv(h, block_h))](
        y, out, rows if rows is not None else y, weights if weights is not None else y,
        ids if ids is not None else y, num_experts, h, y.stride(0), out.stride(0),
        TOP_K=top_k, HAS_ROWS=rows is not None, HAS_WEIGHTS=weights is not None, HAS_IDS=ids is not None,
        BLOCK_H=block_h, num_warps=4, **pdl.launch_kwargs(y.device))
    return out


def _gemm_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> dict:
    """Tile sizes by the number of (token, expert) pairs and rows per expert; fixed table, no autotuning.

    Decode reads each expert's weights once per BLOCK_M tile of its rows (L2 catches only part of
    the second read), so the tile grows with the rows an expert gets: BLOCK_M 32 from 16 rows an
    expert (it won for DeepSeek-V2-Lite's experts and Qwen3-30B-A3B's alike), 16 below (at 12 rows
    16 stayed best). Past 2,048 pairs 64, and from 128 rows an expert 128-row tiles with 8 warps; at
    64 rows no config beat 64 by more than noise. Each the best of a sweep of each GEMM alone
    (docs/benchmarks-history.md: DeepSeek-V2-Lite, and light load and first requests, 2026-11-27)."""
    if dtype == torch.float32:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
    if num_pairs <= 2048:  # decode: a handful of rows per expert, weight reads dominate
        block_m = 32 if num_pairs >= 16 * num_experts else 16
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
    if num_pairs >= 128 * num_experts:
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)


def _launch_gemm(a, w, c, topk_weights, sorted_ids, expert_ids, num_padded, num_pairs, n, k,
                 a_div, gated, cfg) -> None:
    """c[pair] = a[pair // a_div] @ w[expert]^T for each pair of each tile; w [E, N (x2 if gated), K]."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (expert_ids.shape[0] * triton.cdiv(n, bn),)
    _moe_gemm_kernel[grid](
        a, w, c, topk_weights, sorted_ids, expert_ids, num_padded, num_pairs, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), c.stride(0), c.stride(1),
        A_DIV=a_div, GATED=gated, MUL_WEIGHT=not gated, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        EVEN_K=k % bk == 0, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.launch_kwargs(a.device))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights [T, k] float32,
    topk_ids [T, k] -> [T, H]."""
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_tokens == 0:
        return torch.empty_like(x) if out is None else out
    cfg = config or _gemm_config(num_pairs, num_experts, x.dtype)
    topk_weights = topk_weights.contiguous()
    topk_ids = topk_ids.contiguous()
    sorted_ids, expert_ids, num_padded = moe_align(topk_ids, num_experts, cfg["BLOCK_M"])
    inter = torch.empty(num_pairs, inter_size, dtype=x.dtype, device=x.device)
    _launch_gemm(x, w13, inter, topk_weights, sorted_ids, expert_ids, num_padded,
                 num_pairs, inter_size, hidden, top_k, True, cfg)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch_gemm(inter, w2, y, topk_weights, sorted_ids, expert_ids, num_padded,
                 num_pairs, hidden, inter_size, 1, False, cfg)
    return moe_sum(y, num_tokens, top_k, out=out, ids=topk_ids, num_experts=num_experts)
