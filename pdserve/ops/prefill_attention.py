"""Paged variable-length causal attention in Triton (flash-attention style), for prefill chunks.

Sequence b's queries are rows ``query_start[b]:query_start[b+1]`` of q; its keys are its first
``context_lens[b]`` cached tokens, read through its block table, so a chunk that continues a
cached prefix attends to the prefix without copying it. Query j of an n-token chunk sits at
absolute position ctx - n + j and sees keys up to and including it.

Two grids (`flat`): a program per tile slot of every sequence (the longest one's count of tiles for
each), or the sequences' tiles end to end, each program finding its sequence from a prefix sum of
the tile counts on the device (a CUDA graph of many sequence slots, most of them empty, launches
then no program for an empty one).

GQA-aware: a program's tile of BLOCK_M rows is (query, head) pairs of one KV head's group,
query-major, so each K/V tile it loads serves every head of the group; a one-token row (decode
inside a mixed batch) still fills GROUP rows of the tile.

FP8 cache (`kv_scales` given): K/V tiles are read as float8 and widened to q's dtype; k_scale is
folded into the softmax scale and v_scale into the output, as in the decode kernel.
"""

import torch
import triton
import triton.language as tl

from pdserve.forward.kv_cache import FP8

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, tables_ptr, ctx_ptr, qstart_ptr, out_ptr, qk_scale, v_scale,
                    stride_qt, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_tb,
                    stride_ot, stride_oh,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    PRECISION: tl.constexpr, IS_FP8: tl.constexpr):
    """Grid (tiles of the longest sequence, sequences, KV heads): a program per tile slot of every
    sequence, those past a shorter sequence's rows returning at once. The last tiles (the most keys)
    run first: the GPU then ends on short tiles, not one long one."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    q_first = tl.load(qstart_ptr + b)
    n = tl.load(qstart_ptr + b + 1) - q_first
    if pid_m * BLOCK_M >= n * GROUP:
        return
    _attend(pid_m, b, tl.program_id(2), q_first, n, q_ptr, cache_ptr, tables_ptr, ctx_ptr, out_ptr, qk_scale,
            v_scale, stride_qt, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_tb, stride_ot,
            stride_oh, GROUP, HEAD_DIM, PAGE, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, IS_FP8)


@triton.jit
def _prefill_kernel_flat(q_ptr, cache_ptr, tables_ptr, ctx_ptr, qstart_ptr, out_ptr, qk_scale, v_scale,
                         num_seqs,
                         stride_qt, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_tb,
                         stride_ot, stride_oh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr, IS_FP8: tl.constexpr, SEQS_P2: tl.constexpr):
    """Grid (tiles of all sequences together, at most, KV heads): program i takes the i-th tile of
    the sequences' tiles laid end to end, found from the device-side query starts (a prefix sum of
    each sequence's tile count). Empty sequence slots have no tile, so a CUDA graph of many slots
    launches no program for those a step leaves empty. Run last tile first, as `_prefill_kernel`."""
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    idx = tl.arange(0, SEQS_P2)
    real = idx < num_seqs
    first_row = tl.load(qstart_ptr + idx, mask=real, other=0)
    rows = (tl.load(qstart_ptr + idx + 1, mask=real, other=0) - first_row) * GROUP
    tiles = tl.where(real, (rows + BLOCK_M - 1) // BLOCK_M, 0)
    ends = tl.cumsum(tiles, 0)
    b = tl.sum((ends <= pid).to(tl.int32), 0)  # the sequence whose tiles cover tile `pid`
    if b >= num_seqs:  # past the last tile: the grid's bound is loose
        return
    pid_m = pid - tl.sum(tl.where(idx == b, ends - tiles, 0), 0)
    q_first = tl.load(qstart_ptr + b)
    n = tl.load(qstart_ptr + b + 1) - q_first
    _attend(pid_m, b, tl.program_id(1), q_first, n, q_ptr, cache_ptr, tables_ptr, ctx_ptr, out_ptr, qk_scale,
            v_scale, stride_qt, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_tb, stride_ot,
            stride_oh, GROUP, HEAD_DIM, PAGE, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, IS_FP8)


@triton.jit
def _attend(pid_m, b, kvh, q_first, n, q_ptr, cache_ptr, tables_ptr, ctx_ptr, out_ptr, qk_scale, v_scale,
            stride_qt, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_tb, stride_ot, stride_oh,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            PRECISION: tl.constexpr, IS_FP8: tl.constexpr):
    """Tile pid_m (BLOCK_M of sequence b's (query, head) rows of KV head kvh, which exist): its
    attention. Both grids' kernels share it (inlined)."""
    rows = n * GROUP
    ctx = tl.load(ctx_ptr + b)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows
    j = offs_m // GROUP
    heads = kvh * GROUP + offs_m % GROUP
    q_pos = ctx - n + j  # absolute position of each row's query
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    # The dots' input type: the cache's, or q's over an FP8 cache (read unscaled: qk_scale holds
    # k_scale, v_scale multiplies the output).
    dot_ty = q_ptr.dtype.element_ty if IS_FP8 else cache_ptr.dtype.element_ty
    q_rows = (q_first + j).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(dot_ty)

    # Keys past the tile's last query are never seen; keys before `lo` are seen by every row of the
    # tile (they precede its first query), so their tiles need no mask: only the last tile or two,
    # along the diagonal, pay the mask's compares and selects.
    first_j = (pid_m * BLOCK_M) // GROUP
    last_j = (pid_m * BLOCK_M + BLOCK_M - 1) // GROUP
    hi = tl.minimum(ctx, ctx - n + last_j + 1)
    # (Clamped at 0: a row of no context, a graph's padding, has a negative first position.)
    lo = tl.maximum((ctx - n + first_j + 1) // BLOCK_N * BLOCK_N, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_base = cache_ptr + kvh * stride_ch
    table = tables_ptr + b.to(tl.int64) * stride_tb
    for n0 in range(0, lo, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        blk = tl.load(table + offs_n // PAGE).to(tl.int64)
        row = blk * stride_cb + (offs_n % PAGE) * stride_cs
        k = tl.load(kv_base + row[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
        v = tl.load(kv_base + stride_ckv + row[:, None] + d[None, :], mask=d_mask[None, :], other=0.0)
        if IS_FP8:  # widened through float32, which every GPU converts float8 to
            k = k.to(tl.float32).to(dot_ty)
            v = v.to(tl.float32).to(dot_ty)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(qk, 1))  # finite: every key here is seen
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v, input_precision=PRECISION)
        m_i = m_new
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        blk = tl.load(table + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = blk * stride_cb + (offs_n % PAGE) * stride_cs
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(kv_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(kv_base + stride_ckv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if IS_FP8:
            k = k.to(tl.float32).to(dot_ty)
            v = v.to(tl.float32).to(dot_ty)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # Every real row sees key 0, so m_new is finite once a key is seen; rows past the chunk
        # (masked out of the store) may stay -inf: keep them NaN-free anyway.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), v, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if IS_FP8:
        o = o * v_scale
    dst = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# 128-row tiles (4 warps, 3 stages) where a KV head's rows make at least this many of them across
# the KV heads, else 64-row tiles: fewer programs than ~6 waves of an H200's 132 SMs leave SMs idle
# at the end. One H200, 2026-11-29, one 4,096-key prompt of Qwen3-30B-A3B's shape with 256 to 4,096
# queries (`python -m pdserve.benchmarks.prefill_kernel`; docs/benchmarks.md, "A cached prefix").
LARGE_TILES_FROM = 768


def _tile_config(max_rows: int, head_dim: int, dtype: torch.dtype, kv_heads: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for the longest sequence's rows (queries x group)."""
    if dtype == torch.float32:  # twice the registers per element: smaller tiles
        return 32, 32, 4, 2
    if max_rows < 128 or head_dim > 128:
        return 64, 64, 4, 2
    if triton.cdiv(max_rows, 128) * kv_heads >= LARGE_TILES_FROM:
        return 128, 64, 4, 3
    return 64, 64, 4, 3


def paged_prefill_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int,
                            scale: float, out: torch.Tensor | None = None,
                            config: tuple[int, int, int, int] | None = None,
                            kv_scales: tuple[float, ...] = (), flat: bool = False) -> torch.Tensor:
    """q [T, heads, D]; kv_layer [2, blocks, page, kv_heads, D]; block_tables [B, max_blocks];
    context_lens [B], query_start [B+1] int32 on the device; max_query_len a host-side bound -> [T, heads, D].
    An FP8 kv_layer is read through kv_scales = (k_scale, v_scale). `flat`: launch a program per
    tile of the sequences' tiles end to end (at most T's tiles + B) instead of the longest
    sequence's tile count for every sequence: for many sequences of unequal lengths (a CUDA graph's
    slots, most of them empty or one decode row; a long chunk beside decoders)."""
    num_tokens, heads, head_dim = q.shape
    page, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = heads // kv_heads
    assert heads == group * kv_heads and q.stride(-1) == 1 and kv_layer.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    bsz = context_lens.shape[0]
    if num_tokens == 0 or bsz == 0:
        return out
    is_fp8 = kv_layer.dtype == FP8
    assert is_fp8 == bool(kv_scales), "an FP8 cache is read through its scales, and only it"
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    dot_dtype = q.dtype if is_fp8 else kv_layer.dtype
    block_m, block_n, warps, stages = config or _tile_config(max_query_len * group, head_dim, dot_dtype, kv_heads)
    strides = (q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
               kv_layer.stride(3), block_tables.stride(0), out.stride(0), out.stride(1))
    consts = dict(GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
                  BLOCK_D=triton.next_power_of_2(head_dim),
                  PRECISION="ieee" if dot_dtype == torch.float32 else "tf32", IS_FP8=is_fp8,
                  num_warps=warps, num_stages=stages)
    if flat:
        # Every sequence's tiles end to end: at most all rows' tiles plus one partial tile a sequence.
        grid = (triton.cdiv(num_tokens * group, block_m) + bsz, kv_heads)
        _prefill_kernel_flat[grid](q, kv_layer, block_tables, context_lens, query_start, out,
                                   scale * _LOG2E * k_scale, v_scale, bsz, *strides,
                                   SEQS_P2=triton.next_power_of_2(bsz), **consts)
    else:
        grid = (triton.cdiv(max_query_len * group, block_m), bsz, kv_heads)
        _prefill_kernel[grid](q, kv_layer, block_tables, context_lens, query_start, out,
                              scale * _LOG2E * k_scale, v_scale, *strides, **consts)
    return out
