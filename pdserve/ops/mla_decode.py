"""Paged decode attention for Multi-head Latent Attention (DeepSeek-V2/V3) in Triton, absorbed form.

With kv_b_proj folded into the query and the output (weight absorption: the caller turns q_nope
into q_nope W_UK and the result back through W_UV, pdserve.ops.mla_attention), attention runs in
the latent space itself: every head attends to the one cache entry per token that all heads share
— key [c_kv, k_rope] (kv_lora_rank + qk_rope_head_dim wide: 576 for V2-Lite), value c_kv
(kv_lora_rank: 512). It is multi-query attention with one wide head: a program takes BLOCK_H
query heads of one sequence over one slice of its context and reads each latent tile once, for
the scores and for the values alike. The context is split as in the GQA kernel
(pdserve.ops.decode_attention: split-K, a log-sum-exp merge, `merge_splits`), from device-side
context lengths with a host-sized grid, so a launch is CUDA-graph safe; a context of 0 (graph
padding) gives zeros.

Fused latent write (`latent_new`/`slot_mapping` given): the program whose slice holds a sequence's
last position stores the step's latent at its slot (one of the sequence's head blocks writes;
every one of them uses it from registers) and reads the cache only below it, as the GQA kernel.

FP8 cache (`kv_scales` = (latent_scale,)): tiles are read as float8 and widened to q's dtype; the
one scale of the latent plane multiplies keys and values alike, so it is folded into the softmax
scale and into the output, outside the loop.
"""

import torch
import triton
import triton.language as tl

from pdserve.forward.kv_cache import FP8
from pdserve.ops import pdl
from pdserve.ops.decode_attention import decode_num_splits, merge_splits
from pdserve.ops.kv_write import quantize

_LOG2E = 1.4426950408889634
BLOCK_H = 16  # query heads per program: tl.dot's smallest M; all of V2-Lite's 16 heads in one
# From this many programs per split (sequences x blocks of BLOCK_H heads) on, the context is not
# split. A program here holds 16 heads' 512-wide accumulator (the GQA kernel's holds one group of
# 128), so fewer of them fill an SM, and a second split costs a wave plus the merge's float32
# partials: at V2-Lite's decode batch of 256 one split beats the two decode_num_splits picks
# (check_kernels --preset deepseek-v2-lite --only mla --sweep; docs/benchmarks-history.md).
MLA_ONE_SPLIT_PROGRAMS = 256


@triton.jit(do_not_specialize=["num_splits"])
def _mla_decode_kernel(qc_ptr, qr_ptr, cache_ptr, tables_ptr, ctx_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                       new_ptr, slot_ptr, qk_scale, c_scale, num_splits, num_heads,
                       stride_qcb, stride_qch, stride_qrb, stride_qrh, stride_cb, stride_cs, stride_tb,
                       stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_nb,
                       RANK: tl.constexpr, ROPE: tl.constexpr, PAGE: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
                       NEW_LATENT: tl.constexpr, IS_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx, BLOCK_N), num_splits) * BLOCK_N  # keys per split, whole chunks
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    c = tl.arange(0, BLOCK_C)
    c_mask = c < RANK
    r = tl.arange(0, BLOCK_R)
    r_mask = r < ROPE
    kv_ty = cache_ptr.dtype.element_ty
    # The dots' input type: the cache's, or q's over an FP8 cache (its values widened, unscaled:
    # qk_scale holds the latent's scale, which also multiplies the output).
    dot_ty = qc_ptr.dtype.element_ty if IS_FP8 else kv_ty
    q_c = tl.load(qc_ptr + b * stride_qcb + heads[:, None] * stride_qch + c[None, :],
                  mask=h_mask[:, None] & c_mask[None, :], other=0.0).to(dot_ty)  # [BLOCK_H, BLOCK_C]
    q_r = tl.load(qr_ptr + b * stride_qrb + heads[:, None] * stride_qrh + r[None, :],
                  mask=h_mask[:, None] & r_mask[None, :], other=0.0).to(dot_ty)  # [BLOCK_H, BLOCK_R]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    table = tables_ptr + b.to(tl.int64) * stride_tb
    if NEW_LATENT:
        # The new token (position ctx - 1) comes from latent_new; the cache is read below it.
        last = ctx - 1
        owner = (start <= last) & (last < end)
        c_new = tl.load(new_ptr + b * stride_nb + c, mask=c_mask, other=0.0)
        r_new = tl.load(new_ptr + b * stride_nb + RANK + r, mask=r_mask, other=0.0)
        if IS_FP8:  # stored quantized; attended as stored (unscaled, as the cache is read)
            c_new = quantize(c_new, c_scale, kv_ty)
            r_new = quantize(r_new, c_scale, kv_ty)
        else:
            c_new = c_new.to(kv_ty)
            r_new = r_new.to(kv_ty)
        slot = tl.load(slot_ptr + b).to(tl.int64)
        dst = cache_ptr + (tl.maximum(slot, 0) // PAGE) * stride_cb + (tl.maximum(slot, 0) % PAGE) * stride_cs
        writes = owner & (slot >= 0) & (hb == 0)  # the sequence's other head blocks hold the same latent
        tl.store(dst + c, c_new, mask=c_mask & writes)
        tl.store(dst + RANK + r, r_new, mask=r_mask & writes)
        qk_new = (tl.sum(q_c.to(tl.float32) * c_new.to(tl.float32)[None, :], 1)
                  + tl.sum(q_r.to(tl.float32) * r_new.to(tl.float32)[None, :], 1)) * qk_scale  # [BLOCK_H]
        m_i = tl.where(owner, qk_new, m_i)
        l_i = tl.where(owner, 1.0, l_i)
        acc = tl.where(owner, tl.zeros([BLOCK_H, BLOCK_C], tl.float32) + c_new.to(tl.float32)[None, :], acc)
        end = tl.minimum(end, last)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs < end
        blk = tl.load(table + offs // PAGE, mask=n_mask, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (offs % PAGE) * stride_cs
        lat = tl.load(row[:, None] + c[None, :], mask=n_mask[:, None] & c_mask[None, :], other=0.0)
        rope = tl.load(row[:, None] + RANK + r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        if IS_FP8:  # widened through float32, which every GPU converts float8 to
            lat = lat.to(tl.float32).to(dot_ty)
            rope = rope.to(tl.float32).to(dot_ty)
        qk = tl.dot(q_c, tl.trans(lat), input_precision=PRECISION)
        qk += tl.dot(q_r, tl.trans(rope), input_precision=PRECISION)
        qk = tl.where(n_mask[None, :], qk * qk_scale, float("-inf"))  # [BLOCK_H, BLOCK_N], log2 units
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        # The value is the latent tile already loaded for the scores: one read serves both.
        acc = acc * alpha[:, None] + tl.dot(p.to(dot_ty), lat, input_precision=PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty slice (or context 0) leaves zeros
    if IS_FP8:
        o = o * c_scale
    o_mask = h_mask[:, None] & c_mask[None, :]
    if DIRECT:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + c[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        dst = part_o_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + c[None, :]
        tl.store(dst, o, mask=o_mask)
        lse = m_i + tl.log2(l_i)  # -inf for an empty slice
        tl.store(part_lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


def mla_num_splits(num_seqs: int, num_heads: int, max_context: int, device: torch.device) -> int:
    """The split count for a batch (host-side only): one from MLA_ONE_SPLIT_PROGRAMS programs on,
    else decode_num_splits with a program per block of BLOCK_H heads."""
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    if num_seqs * head_blocks >= MLA_ONE_SPLIT_PROGRAMS:
        return 1
    return decode_num_splits(num_seqs, head_blocks, max_context, device)


def paged_mla_decode(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_layer: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, num_splits: int,
                     out: torch.Tensor | None = None, latent_new: torch.Tensor | None = None,
                     slot_mapping: torch.Tensor | None = None, kv_scales: tuple[float, ...] = (),
                     block_n: int | None = None, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Sequence b's one query token against its cached latents.

    q_latent [B, heads, kv_lora_rank] (q_nope W_UK: the query in latent space) and q_rope [B, heads,
    qk_rope_head_dim] (the roped part), any strides with the last one 1; kv_layer [1, blocks, page,
    1, kv_lora_rank + qk_rope_head_dim]; block_tables [B, max_blocks]; context_lens [B] int32
    (device) -> out [B, heads, kv_lora_rank] (softmax-weighted latents, still to go through W_UV).

    With latent_new [B, kv_lora_rank + qk_rope_head_dim] and slot_mapping [B] (int, -1 skips the
    write) the step's latents are written into kv_layer by the same launch; without them the cache
    must already hold them. An FP8 kv_layer is read (and written) through kv_scales = (scale,)."""
    bsz, heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    page, dim = kv_layer.shape[2], kv_layer.shape[4]
    assert kv_layer.shape[0] == 1 and kv_layer.shape[3] == 1 and dim == rank + rope and q_rope.shape[:2] == (bsz, heads)
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1 and kv_layer.stride(-1) == 1
    if out is None:
        out = q_latent.new_empty(bsz, heads, rank)
    if bsz == 0:
        return out
    direct = num_splits == 1
    if direct:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(bsz, heads, num_splits, rank, dtype=torch.float32, device=q_latent.device)
        part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q_latent.device)
    new = latent_new is not None
    if new:
        assert slot_mapping is not None and latent_new.shape == (bsz, dim) and latent_new.stride(-1) == 1
    else:
        latent_new = slot_mapping = q_latent  # unused
    is_fp8 = kv_layer.dtype == FP8
    assert is_fp8 == bool(kv_scales), "an FP8 cache is read through its scale, and only it"
    c_scale = kv_scales[0] if kv_scales else 1.0
    dot_dtype = q_latent.dtype if is_fp8 else kv_layer.dtype
    if block_n is None:  # float32 tiles take twice the registers and shared memory
        block_n = 16 if dot_dtype == torch.float32 else 32
    _mla_decode_kernel[(bsz, triton.cdiv(heads, BLOCK_H), num_splits)](
        q_latent, q_rope, kv_layer, block_tables, context_lens, out, part_o, part_lse, latent_new, slot_mapping,
        scale * _LOG2E * c_scale, c_scale, num_splits, heads,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_layer.stride(1), kv_layer.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_o.stride(2) if not direct else 0,
        part_lse.stride(0), part_lse.stride(1), latent_new.stride(0),
        RANK=rank, ROPE=rope, PAGE=page, BLOCK_H=BLOCK_H,
        BLOCK_C=max(16, triton.next_power_of_2(rank)), BLOCK_R=max(16, triton.next_power_of_2(rope)),
        BLOCK_N=block_n, DIRECT=direct, PRECISION="ieee" if dot_dtype == torch.float32 else "tf32",
        NEW_LATENT=new, IS_FP8=is_fp8, num_warps=num_warps, num_stages=num_stages, **pdl.launch_kwargs(q_latent.device))
    if not direct:
        merge_splits(part_o, part_lse, out, num_splits)
    return out
