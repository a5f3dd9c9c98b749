"""SiLU-and-multiply in Triton: the SwiGLU activation of a fused gate/up projection."""

import torch
import triton
import triton.language as tl

from pdserve.ops import pdl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter_size, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    pdl.wait(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < inter_size
    gate = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter_size + c, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2I] (gate then up) -> silu(gate) * up [T, I], computed in float32."""
    rows, two_i = x.shape
    inter_size = two_i // 2
    assert x.stride(-1) == 1
    if out is None:
        out = torch.empty(rows, inter_size, dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter_size))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter_size, block))](
            x, out, inter_size, x.stride(0), out.stride(0), BLOCK=block, num_warps=4, **pdl.launch_kwargs(x.device))
    return out
