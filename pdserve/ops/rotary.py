"""RoPE (NeoX layout: halves, not pairs) in Triton, optionally after Qwen3's per-head q/k RMSNorm.

Same math as `norms.apply_rotary` (and `norms.rms_norm` on each head first when weights are
given), reading cos/sin from RotaryEmbedding's float32 tables by position. A token's q heads are split over
programs of Q_HEADS_PER_PROGRAM heads where a step has few tokens (a decode step at batch 1 ran one
program for all 36 heads: 2.7 us a layer on an H200), and one more program rotates its k heads;
everything is computed in float32 and rounded once.
"""

import torch
import triton
import triton.language as tl

from pdserve.ops import pdl


@triton.jit
def _norm_rope_heads(x_ptr, o_ptr, w_ptr, num_heads, stride_h, stride_oh, c1, c2, s1, s2, eps,
                     HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                     NORM: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < num_heads)[:, None] & (i < HALF)[None, :]
    src = x_ptr + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    ty = o_ptr.dtype.element_ty
    if NORM:  # RMSNorm over the head: normalise, round to the dtype, scale, round
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * rstd).to(ty).to(tl.float32) * w1).to(ty).to(tl.float32)
        x2 = ((x2 * rstd).to(ty).to(tl.float32) * w2).to(ty).to(tl.float32)
    dst = o_ptr + h[:, None] * stride_oh + i[None, :]
    tl.store(dst, (x1 * c1 - x2 * s1).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * c2 + x1 * s2).to(ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
                         num_q_heads, num_k_heads, eps,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh,
                         stride_kot, stride_koh, stride_cos,
                         HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                         BLOCK_HK: tl.constexpr, NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (tokens, q head groups + 1): program (t, g) takes q heads [g * BLOCK_HQ, ...) of token t,
    the last group of each token its k heads."""
    t = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    pdl.wait(USE_PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c1 = tl.load(cos_ptr + pos * stride_cos + i, mask=i_mask, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + pos * stride_cos + HALF + i, mask=i_mask, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + pos * stride_cos + i, mask=i_mask, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_cos + HALF + i, mask=i_mask, other=0.0)[None, :]
    first = g * BLOCK_HQ
    if first < num_q_heads:
        _norm_rope_heads(q_ptr + t * stride_qt + first * stride_qh, qo_ptr + t * stride_qot + first * stride_qoh,
                         qw_ptr, num_q_heads - first, stride_qh, stride_qoh,
                         c1, c2, s1, s2, eps, HALF, BLOCK_HALF, BLOCK_HQ, NORM)
    else:
        _norm_rope_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, kw_ptr, num_k_heads, stride_kh, stride_koh,
                         c1, c2, s1, s2, eps, HALF, BLOCK_HALF, BLOCK_HK, NORM)


# A step of at most this many tokens splits each token's q heads over programs of Q_HEADS_PER_PROGRAM;
# a longer one has programs enough (one for a token's q heads, one for its k heads).
SPLIT_HEADS_MAX_TOKENS = 16
Q_HEADS_PER_PROGRAM = 4


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D], k [T, kv_heads, D], positions [T], cos/sin tables [max_positions, D] float32;
    with q_weight/k_weight [D] each head is RMS-normalised first -> rotated q, k (new tensors)."""
    t, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    norm = q_weight is not None
    assert (k_weight is not None) == norm and head_dim % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride(-1) == 1 and cos.stride() == sin.stride()
    q_out, k_out = out if out is not None else (torch.empty_like(q), torch.empty_like(k))
    if t:
        half = head_dim // 2
        per_program = (min(Q_HEADS_PER_PROGRAM, triton.next_power_of_2(q_heads)) if t <= SPLIT_HEADS_MAX_TOKENS
                       else triton.next_power_of_2(q_heads))
        _qk_norm_rope_kernel[(t, triton.cdiv(q_heads, per_program) + 1)](
            q, k, q_out, k_out, positions, cos, sin, q_weight if norm else cos, k_weight if norm else cos,
            q_heads, k_heads, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_out.stride(0), q_out.stride(1),
            k_out.stride(0), k_out.stride(1), cos.stride(0),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=per_program,
            BLOCK_HK=triton.next_power_of_2(k_heads), NORM=norm, num_warps=4, **pdl.launch_kwargs(q.device))
    return q_out, k_out


def rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE alone: q [T, heads, D], k [T, kv_heads, D] -> rotated copies."""
    return qk_norm_rope(q, k, positions, cos, sin)
