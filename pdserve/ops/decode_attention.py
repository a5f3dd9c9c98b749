"""Paged decode attention in Triton: one query token per sequence, K/V read through the block table.

One program handles all query heads of one KV head (GQA: K/V are read once for the whole group)
over one slice of the context (split-K, "flash-decoding"); a second kernel merges the slices by
their log-sum-exp. Everything the kernels read is on the device (block tables, int32 context
lengths) and the grid depends only on the batch size and a split count chosen on the host, so a
launch can be captured in a CUDA graph and replayed for other context lengths: each program
derives its slice from its sequence's context length. A sequence of context 0 (graph padding)
gets a zero output.

Fused KV write (`k_new`/`v_new`/`slot_mapping` given): the step's K/V need no separate launch. The
program whose slice holds a sequence's last position (ctx - 1, the new token) stores the new K/V
into the cache at the sequence's slot and uses them straight from registers; every program reads
the cache only below ctx - 1, so nothing reads a slot this launch writes.

FP8 cache (`kv_scales` given): keys and values are read as float8 and widened to q's dtype for the
dots; their scales are applied outside the loop — k_scale folded into the softmax scale, v_scale
into the output — so the inner loop pays nothing for them. The fused write stores the new token
quantized and attends to exactly what it stored.
"""

import functools
import math

import torch
import triton
import triton.language as tl

from pdserve.forward.kv_cache import FP8
from pdserve.ops import pdl
from pdserve.ops.kv_write import quantize

_LOG2E = 1.4426950408889634
MIN_KEYS_PER_SPLIT = 64  # one BLOCK_N chunk: below this a split's fixed cost outweighs the parallelism
MAX_SPLITS = 32
PROGRAMS_PER_SM = 2


@triton.jit
def _slice(ctx_ptr, b, split, num_splits, BLOCK_N: tl.constexpr):
    """Sequence b's context length and this split's keys [start, end), whole BLOCK_N chunks."""
    ctx = tl.load(ctx_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), num_splits) * BLOCK_N
    start = split * per_split
    return ctx, start, tl.minimum(start + per_split, ctx)


@triton.jit
def _kv_chunk(kv_base, table, n0, end, stride_ckv, stride_cb, stride_cs, d,
              HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The cached K and V of positions n0 .. n0 + BLOCK_N (those below `end`), through the block table."""
    offs = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs < end
    blk = tl.load(table + offs // PAGE, mask=n_mask, other=0).to(tl.int64)
    row = blk * stride_cb + (offs % PAGE) * stride_cs
    kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(kv_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(kv_base + stride_ckv + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
    return k, v, n_mask


@triton.jit
def _attend(q, k, v, n_mask, m_i, l_i, acc, qk_scale, IS_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """One chunk of keys into the running max, sum and output (online softmax, log2 units)."""
    if IS_FP8:  # widened through float32, which every GPU converts float8 to
        k = k.to(tl.float32).to(q.dtype)
        v = v.to(tl.float32).to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N], log2 units
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(q_ptr, cache_ptr, tables_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                         k_new_ptr, v_new_ptr, slot_ptr,
                         qk_scale, k_scale, v_scale, num_splits,
                         stride_qb, stride_qh, stride_ckv, stride_cb, stride_cs, stride_ch, stride_tb,
                         stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         stride_knb, stride_knh, stride_vnb, stride_vnh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         DIRECT: tl.constexpr, PRECISION: tl.constexpr, NEW_KV: tl.constexpr,
                         IS_FP8: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, BLOCK_D)
    kv_base = cache_ptr + kvh * stride_ch
    table = tables_ptr + b.to(tl.int64) * stride_tb
    if PREFETCH:
        # (NEW_KV only.) Before the wait, what no kernel of this step's last two wrote: the context
        # lengths and block tables (set before the step's first kernel) and the cache below the new
        # token (earlier steps'). Under PDL every kernel before the one before has ended when this
        # launch's programs start, so the first chunk's K/V load while that kernel (the q/k norm
        # and RoPE) runs.
        ctx, start, end = _slice(ctx_ptr, b, split, num_splits, BLOCK_N)
        k_pre, v_pre, mask_pre = _kv_chunk(kv_base, table, start, tl.minimum(end, ctx - 1), stride_ckv, stride_cb,
                                           stride_cs, d, HEAD_DIM, PAGE, BLOCK_N)
    pdl.wait(USE_PDL)
    if not PREFETCH:
        ctx, start, end = _slice(ctx_ptr, b, split, num_splits, BLOCK_N)

    hs = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + hs
    hd_mask = (hs < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    kv_ty = cache_ptr.dtype.element_ty
    # The dots' input type: the cache's, or q's over an FP8 cache (its values widened, unscaled:
    # qk_scale holds k_scale, v_scale multiplies the output).
    dot_ty = q_ptr.dtype.element_ty if IS_FP8 else kv_ty
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=hd_mask, other=0.0)
    q = q.to(dot_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    if NEW_KV:
        # The new token (position ctx - 1) comes from k_new/v_new; the cache is read below it.
        last = ctx - 1
        owner = (start <= last) & (last < end)
        d_mask = d < HEAD_DIM
        k_new = tl.load(k_new_ptr + b * stride_knb + kvh * stride_knh + d, mask=d_mask, other=0.0)
        v_new = tl.load(v_new_ptr + b * stride_vnb + kvh * stride_vnh + d, mask=d_mask, other=0.0)
        if IS_FP8:  # stored quantized; attended as stored (unscaled, as the cache is read)
            k_new = quantize(k_new, k_scale, kv_ty)
            v_new = quantize(v_new, v_scale, kv_ty)
        else:
            k_new = k_new.to(kv_ty)
            v_new = v_new.to(kv_ty)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        dst = cache_ptr + (tl.maximum(slot, 0) // PAGE) * stride_cb + (tl.maximum(slot, 0) % PAGE) * stride_cs \
            + kvh * stride_ch + d
        w_mask = d_mask & owner & (slot >= 0)
        tl.store(dst, k_new, mask=w_mask)
        tl.store(dst + stride_ckv, v_new, mask=w_mask)
        qk_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # [BLOCK_H]
        m_i = tl.where(owner, qk_new, m_i)
        l_i = tl.where(owner, 1.0, l_i)
        acc = tl.where(owner, tl.zeros([BLOCK_H, BLOCK_D], tl.float32) + v_new.to(tl.float32)[None, :], acc)
        end = tl.minimum(end, last)
    first = start
    if PREFETCH:
        if start < end:  # (an empty slice attends to nothing: its chunk is all masked)
            m_i, l_i, acc = _attend(q, k_pre, v_pre, mask_pre, m_i, l_i, acc, qk_scale, IS_FP8, PRECISION)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        k, v, n_mask = _kv_chunk(kv_base, table, n0, end, stride_ckv, stride_cb, stride_cs, d, HEAD_DIM, PAGE, BLOCK_N)
        m_i, l_i, acc = _attend(q, k, v, n_mask, m_i, l_i, acc, qk_scale, IS_FP8, PRECISION)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty slice (or context 0) leaves zeros
    if IS_FP8:
        o = o * v_scale
    if DIRECT:
        dst = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=hd_mask)
    else:
        dst = part_o_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :]
        tl.store(dst, o, mask=hd_mask)
        lse = m_i + tl.log2(l_i)  # -inf for an empty slice
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=hs < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_splits,
                          stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                          USE_PDL: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl.wait(USE_PDL)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + b * stride_lb + h * stride_lh + s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty slices weigh 0
    den = tl.sum(w, 0)
    o = tl.load(part_o_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    o = tl.sum(o * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the Triton interpreter: any small number
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device,
                      min_keys_per_split: int = MIN_KEYS_PER_SPLIT) -> int:
    """How many slices to cut each context into so that batch x kv_heads x splits is about
    PROGRAMS_PER_SM x the SM count, each slice at least `min_keys_per_split` keys (host-side only)."""
    programs = num_seqs * num_kv_heads
    want = math.ceil(PROGRAMS_PER_SM * _num_sms(device) / programs)
    by_len = math.ceil(max_context / min_keys_per_split)
    return max(1, min(want, by_len, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, num_splits: int,
                           out: torch.Tensor | None = None, block_n: int = 64,
                           k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                           slot_mapping: torch.Tensor | None = None,
                           kv_scales: tuple[float, ...] = ()) -> torch.Tensor:
    """q [B, heads, D] (sequence b's one token), kv_layer [2, blocks, page, kv_heads, D],
    block_tables [B, max_blocks], context_lens [B] int32 (device) -> out [B, heads, D].

    With k_new, v_new [B, kv_heads, D] and slot_mapping [B] (int, -1 skips the write) the step's K/V
    are written into kv_layer by the same launch (the cache at the new token's slot is not read:
    its K/V come from k_new/v_new); without them the cache must already hold them. An FP8
    kv_layer is read (and written) through kv_scales = (k_scale, v_scale)."""
    bsz, heads, head_dim = q.shape
    page, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = heads // kv_heads
    assert heads == group * kv_heads and q.stride(-1) == 1 and kv_layer.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    if bsz == 0:
        return out
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(bsz, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q.device)
    new_kv = k_new is not None
    if new_kv:
        assert v_new is not None and slot_mapping is not None and k_new.shape[0] == bsz
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1
    else:
        k_new = v_new = slot_mapping = q  # unused
    block_d = triton.next_power_of_2(head_dim)
    is_fp8 = kv_layer.dtype == FP8
    assert is_fp8 == bool(kv_scales), "an FP8 cache is read through its scales, and only it"
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    precision = "ieee" if (q.dtype if is_fp8 else kv_layer.dtype) == torch.float32 else "tf32"
    _decode_split_kernel[(bsz, kv_heads, num_splits)](
        q, kv_layer, block_tables, context_lens, out, part_o, part_lse, k_new, v_new, slot_mapping,
        scale * _LOG2E * k_scale, k_scale, v_scale, num_splits,
        q.stride(0), q.stride(1), kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0), out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if not direct else 0,
        part_lse.stride(0), part_lse.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d, BLOCK_N=block_n, DIRECT=direct, PRECISION=precision, NEW_KV=new_kv,
        IS_FP8=is_fp8, PREFETCH=new_kv and pdl.prefetches("attention"), num_warps=4, num_stages=2,
        **pdl.launch_kwargs(q.device))
    if not direct:
        merge_splits(part_o, part_lse, out, num_splits)
    return out


def merge_splits(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int) -> None:
    """out [B, heads, D] = the slices' outputs part_o [B, heads, splits, D] (float32) weighted by
    their log-sum-exps part_lse [B, heads, splits] (log2 units); empty slices (-inf) weigh 0. Also
    the MLA decode kernel's second launch (pdserve.ops.mla_decode)."""
    bsz, heads, head_dim = out.shape
    _decode_reduce_kernel[(bsz, heads)](
        part_o, part_lse, out, num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=8 if head_dim >= 512 else 4 if head_dim >= 128 else 2, **pdl.launch_kwargs(out.device))
