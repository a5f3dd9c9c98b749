"""RMSNorm in Triton, optionally fused with the residual add before it.

Same math as `norms.rms_norm`: normalised in float32, rounded to x's dtype, then scaled by the
weight (the product rounded once, to the promoted dtype, as torch does).
"""

import torch
import triton
import triton.language as tl

from pdserve.ops import pdl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, dim, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = d < dim
    w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    pdl.wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + d, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # x + residual rounded to x's dtype, as the unfused add would leave it
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + d, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + d, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / dim + eps)
    y = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + d, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out):
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    assert x2.stride(-1) == 1 and weight.is_contiguous()
    if out is None:
        out = torch.empty(x2.shape, dtype=torch.result_type(weight, x), device=x.device)
    out = out.view(x2.shape)
    res2 = residual.reshape(-1, dim) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    rows = x2.shape[0]
    if rows:
        block_d = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, dim, eps,
                                  x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
                                  HAS_RESIDUAL=residual is not None, BLOCK_D=block_d,
                                  num_warps=min(8, max(1, block_d // 256)), **pdl.launch_kwargs(x.device))
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., dim], weight [dim] -> [..., dim]."""
    return _launch(x, None, weight, eps, out)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); x, residual [..., dim]."""
    return _launch(x, residual, weight, eps, out)
