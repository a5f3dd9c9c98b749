"""Writes this step's K/V into the paged cache: one Triton launch for K and V together.

The GPU counterpart of `attention.write_kv` (two index_copy_ launches). A negative slot skips the
token, so a CUDA-graph batch padded to its bucket size can point its padding rows at slot -1.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_ckv, stride_cb, stride_cs, stride_ch,
                     block_size, num_kv_heads,
                     HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
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
    tl.store(dst, k.to(ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(ty), mask=mask)


def write_kv_triton(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [T, kv_heads, head_dim] into kv_layer [2, blocks, block_size, kv_heads, head_dim]
    at slot_mapping [T] (int64; -1 skips the row)."""
    t, kv_heads, head_dim = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and kv_layer.stride(-1) == 1
    _write_kv_kernel[(t,)](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        kv_layer.shape[2], kv_heads,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4 if kv_heads * head_dim >= 1024 else 1)
