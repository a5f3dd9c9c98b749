"""Writes this step's K/V (or MLA's latents) into the paged cache: one Triton launch per layer.

The GPU counterparts of `attention.write_kv` (two index_copy_ launches, K and V) and
`attention.write_latent` (Multi-head Latent Attention's one plane). A negative slot skips the
token, so a CUDA-graph batch padded to its bucket size can point its padding rows at slot -1.
An FP8 cache stores clamp(value / scale, ±448) (`quantize`, as `kv_quant.quantize` does; the
attention kernels call it too where they write).
"""

import torch
import triton
import triton.language as tl

from pdserve.forward.kv_cache import FP8
from pdserve.ops import pdl


@triton.jit
def quantize(x, scale, ty: tl.constexpr):
    """x / scale saturated at ±448 (float8 e4m3's largest finite value), in the cache's type `ty`."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -448.0), 448.0).to(ty)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ckv, stride_cb, stride_cs, stride_ch,
                     block_size, num_kv_heads,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
                     USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < num_kv_heads) & (d < HEAD_DIM)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + blk * stride_cb + off * stride_cs + h * stride_ch + d
    ty = cache_ptr.dtype.element_ty
    if IS_FP8:
        k = quantize(k, k_scale, ty)
        v = quantize(v, v_scale, ty)
    tl.store(dst, k.to(ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(ty), mask=mask)


def write_kv_triton(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                    scales: tuple[float, ...] = ()) -> None:
    """Scatter k, v [T, kv_heads, head_dim] into kv_layer [2, blocks, block_size, kv_heads, head_dim]
    at slot_mapping [T] (int64; -1 skips the row); an FP8 cache through scales = (k_scale, v_scale)."""
    t, kv_heads, head_dim = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_layer.stride(-1) == 1
    is_fp8 = kv_layer.dtype == FP8
    assert is_fp8 == bool(scales), "an FP8 cache is written through its scales, and only it"
    k_scale, v_scale = scales or (1.0, 1.0)
    _write_kv_kernel[(t,)](
        k, v, kv_layer, slot_mapping, k_scale, v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        kv_layer.shape[2], kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        IS_FP8=is_fp8, num_warps=4 if kv_heads * head_dim >= 1024 else 1, **pdl.launch_kwargs(k.device))


@triton.jit
def _write_latent_kernel(x_ptr, cache_ptr, slot_ptr, scale, stride_xt, stride_cb, stride_cs, block_size,
                         DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, BLOCK_D)
    x = tl.load(x_ptr + t * stride_xt + d, mask=d < DIM)
    ty = cache_ptr.dtype.element_ty
    if IS_FP8:
        x = quantize(x, scale, ty)
    tl.store(cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + d, x.to(ty),
             mask=d < DIM)


def write_latent_triton(kv_layer: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor,
                        scales: tuple[float, ...] = ()) -> None:
    """Scatter latent [T, dim] into kv_layer [1, blocks, block_size, 1, dim] at slot_mapping [T]
    (int64; -1 skips the row); an FP8 cache through scales = (latent_scale,)."""
    t, dim = latent.shape
    if t == 0:
        return
    assert kv_layer.shape[0] == 1 and kv_layer.shape[3] == 1 and kv_layer.shape[4] == dim
    assert latent.stride(-1) == 1 and kv_layer.stride(-1) == 1
    is_fp8 = kv_layer.dtype == FP8
    assert is_fp8 == bool(scales), "an FP8 cache is written through its scale, and only it"
    _write_latent_kernel[(t,)](
        latent, kv_layer, slot_mapping, scales[0] if scales else 1.0,
        latent.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.shape[2],
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), IS_FP8=is_fp8, num_warps=4 if dim >= 512 else 1,
        **pdl.launch_kwargs(latent.device))
