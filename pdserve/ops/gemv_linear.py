"""A linear layer for a handful of rows (decode at batch 1..8): one Triton GEMV launch.

At batch 1 a decode step is a chain of small launches inside a CUDA graph, and the dense
projections are among its largest: on one H200 (Qwen3-30B-A3B shape) the fused q/k/v projection
took 7.9 us per layer and the o projection 8.9 us (cuBLAS's split-K kernel plus its reduce), at
62 % and 44 % of the HBM copy rate; the router's 0.5 MB GEMM took 5.0 us, all of it latency.
Here one program owns BLOCK_N output features of every row: it streams their weight rows once,
K in BLOCK_K chunks (the loop software-pipelined: NUM_STAGES chunks in flight), and multiplies
them by the (at most BLOCK_T) input rows with one small tensor-core dot per chunk. No split-K, so
no second kernel and no float32 scratch; the bias is added in the same launch.

Grids depend only on the shapes (host-known): CUDA-graph safe. `linear` is the dispatch the
Triton backends use: this kernel up to `GEMV_LINEAR_MAX_TOKENS` rows on a GPU, `F.linear`
otherwise (the CPU reference never comes here).
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Up to this many rows, `linear` takes the GEMV (PDSERVE_GEMV_LINEAR_MAX_TOKENS=0: always F.linear,
# the reference a benchmark compares against). Past 8 rows the weight is re-read per 16-row tile
# by cuBLAS too, and its tiles win.
GEMV_LINEAR_MAX_TOKENS = int(os.environ.get("PDSERVE_GEMV_LINEAR_MAX_TOKENS", "8"))


@triton.jit
def _gemv_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, N, K, stride_xt, stride_wn, stride_ot,
                        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                        NUM_STAGES: tl.constexpr):
    nt = tl.program_id(0)
    offs_n = nt * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N read row N - 1 (in bounds, never stored): the loads stay unmasked along N.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_tile = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + offs_t[None, :].to(tl.int64) * stride_xt + offs_k[:, None]  # [BLOCK_K, BLOCK_T]
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            w = tl.load(w_tile + k0)
            x = tl.load(x_tile + k0, mask=t_mask[None, :], other=0.0)
        else:
            k_mask = offs_k < K - k0
            w = tl.load(w_tile + k0, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_tile + k0, mask=t_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(w, x.to(w.dtype), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows).to(tl.float32)[:, None]
    dst = out_ptr + offs_t[None, :].to(tl.int64) * stride_ot + offs_n[:, None]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & t_mask[None, :])


def gemv_linear_config(num_tokens: int, out_features: int, in_features: int) -> dict:
    """Fixed table (no autotuning; `check_kernels --only linear --sweep` times alternatives)."""
    return dict(BLOCK_N=16, BLOCK_K=min(512, max(16, triton.next_power_of_2(in_features))),
                num_warps=4, num_stages=3)


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract for x [T, K] (T small), weight [N, K], bias [N] or None -> [T, N] in x's dtype."""
    num_tokens, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    if out is None:
        out = x.new_empty(num_tokens, n)
    assert out.shape == (num_tokens, n) and out.stride(1) == 1
    if num_tokens == 0:
        return out
    cfg = config or gemv_linear_config(num_tokens, n, k)
    bn, bk = cfg["BLOCK_N"], min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(k)))
    _gemv_linear_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, out, num_tokens, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_T=max(16, triton.next_power_of_2(num_tokens)), BLOCK_N=bn,
        BLOCK_K=bk, EVEN_K=k % bk == 0, PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        NUM_STAGES=cfg["num_stages"], num_warps=cfg["num_warps"])
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the GEMV for up to GEMV_LINEAR_MAX_TOKENS rows of a 2-D x on a GPU."""
    if (x.dim() == 2 and 0 < x.shape[0] <= GEMV_LINEAR_MAX_TOKENS and x.is_cuda
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype):
        return gemv_linear(x, weight, bias)
    return F.linear(x, weight, bias)
