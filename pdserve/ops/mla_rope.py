"""Multi-head Latent Attention's RoPE and cache entry in one Triton launch (the GPU norms backend).

The reference (pdserve.models.mla) rotates the rope part of q and the shared key with ~9 torch
ops each, then concatenates q's two parts and the latent's: ~20 small kernels per layer, which
on a decode step replayed from a CUDA graph cost their microseconds each. Here one program per
token writes q [nope, rotated rope] for every head and the cache entry [c_kv, rotated k_rope].

Both of DeepSeek's layouts: interleaved pairs (x0, x1), (x2, x3), ... whose rotated halves come
out de-interleaved (`rotate_pairs`, V2, V3 by default) or NeoX halves (`apply_rotary`). With the
cos/sin of cat(freqs, freqs) both are out[:half] = x1·c − x2·s, out[half:] = x2·c + x1·s, c and s
the first halves; only where x1 and x2 are read from differs. Computed in float32, rounded once.
"""

import torch
import triton
import triton.language as tl

from pdserve.ops import pdl


@triton.jit
def _mla_rope_kernel(q_ptr, c_ptr, kr_ptr, cos_ptr, sin_ptr, q_out_ptr, lat_ptr, num_heads,
                     stride_qt, stride_qh, stride_ct, stride_kt, stride_cos, stride_sin,
                     stride_qot, stride_qoh, stride_lt,
                     NOPE: tl.constexpr, ROPE: tl.constexpr, RANK: tl.constexpr, INTERLEAVE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_NOPE: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    half = ROPE // 2
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < half
    c = tl.load(cos_ptr + t * stride_cos + j, mask=j_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + j, mask=j_mask, other=0.0).to(tl.float32)
    if INTERLEAVE:
        first, second = 2 * j, 2 * j + 1
    else:
        first, second = j, j + half

    # q: every head's nope part as it is, its rope part rotated.
    h = tl.arange(0, BLOCK_H)[:, None]
    h_mask = h < num_heads
    d = tl.arange(0, BLOCK_NOPE)[None, :]
    src = q_ptr + t * stride_qt + h * stride_qh
    dst = q_out_ptr + t * stride_qot + h * stride_qoh
    ty = q_out_ptr.dtype.element_ty
    tl.store(dst + d, tl.load(src + d, mask=h_mask & (d < NOPE)), mask=h_mask & (d < NOPE))
    rm = h_mask & j_mask[None, :]
    x1 = tl.load(src + NOPE + first[None, :], mask=rm, other=0.0).to(tl.float32)
    x2 = tl.load(src + NOPE + second[None, :], mask=rm, other=0.0).to(tl.float32)
    tl.store(dst + NOPE + j[None, :], (x1 * c[None, :] - x2 * s[None, :]).to(ty), mask=rm)
    tl.store(dst + NOPE + half + j[None, :], (x2 * c[None, :] + x1 * s[None, :]).to(ty), mask=rm)

    # The cache entry: the normalised latent, then the shared key rotated.
    e = tl.arange(0, BLOCK_C)
    lat = lat_ptr + t * stride_lt
    lty = lat_ptr.dtype.element_ty
    tl.store(lat + e, tl.load(c_ptr + t * stride_ct + e, mask=e < RANK).to(lty), mask=e < RANK)
    k1 = tl.load(kr_ptr + t * stride_kt + first, mask=j_mask, other=0.0).to(tl.float32)
    k2 = tl.load(kr_ptr + t * stride_kt + second, mask=j_mask, other=0.0).to(tl.float32)
    tl.store(lat + RANK + j, (k1 * c - k2 * s).to(lty), mask=j_mask)
    tl.store(lat + RANK + half + j, (k2 * c + k1 * s).to(lty), mask=j_mask)


def mla_rope(q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, nope + rope] (the rope part unrotated), c_kv [T, rank] (normalised), k_rope
    [T, rope] (unrotated), cos/sin [T, 1, rope] (the position's, cat(freqs, freqs)) -> q [T, heads,
    nope + rope] with its rope part rotated, and the cache entry [T, rank + rope]: c_kv, then k_rope
    rotated. Inputs may be strided views (last stride 1)."""
    t, heads, qk = q.shape
    rope, rank = k_rope.shape[-1], c_kv.shape[-1]
    nope = qk - rope
    q_out = torch.empty(t, heads, qk, dtype=q.dtype, device=q.device)
    latent = torch.empty(t, rank + rope, dtype=c_kv.dtype, device=q.device)
    if t == 0:
        return q_out, latent
    assert rope % 2 == 0 and cos.shape[-1] == rope and sin.shape[-1] == rope
    for x in (q, c_kv, k_rope, cos, sin):
        assert x.stride(-1) == 1
    _mla_rope_kernel[(t,)](
        q, c_kv, k_rope, cos, sin, q_out, latent, heads,
        q.stride(0), q.stride(1), c_kv.stride(0), k_rope.stride(0), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), latent.stride(0),
        NOPE=nope, ROPE=rope, RANK=rank, INTERLEAVE=interleave, BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_NOPE=triton.next_power_of_2(nope), BLOCK_HALF=triton.next_power_of_2(rope // 2),
        BLOCK_C=triton.next_power_of_2(rank), num_warps=4 if heads * qk >= 2048 else 1, **pdl.launch_kwargs(q.device))
    return q_out, latent
