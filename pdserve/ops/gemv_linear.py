"""A dense projection for one or two rows (decode at batch 1 and 2): one Triton GEMV launch.

A small-batch decode step is a chain of short kernels, each launched with programmatic dependent
launch (pdserve/ops/pdl.py) so that its launch and prologue overlap the kernel before. cuBLAS's
kernels take no part in that: the fused q/k/v projection and the o projection (split-K plus its
reduce kernel on an H200) broke the chain three times a layer, and ran at 1.8-2.5x their bytes'
time (check_kernels, graph-replayed: 9.0 us for 21 MB, 9.9 us for 16.8 MB).

One program owns BLOCK_N output features: it streams their weight rows once, over the whole reduced
dimension in BLOCK_K chunks, and multiplies them with the input rows, summed elementwise in float32
and reduced once at the end. The loop over K is unrolled (K a compile-time constant, as in the MoE
GEMVs, pdserve/ops/gemv_moe.py), so a program has all its chunks' loads in flight. No split-K: no
second kernel, no float32 scratch; the bias is added in the same launch. (The post-attention norm
done by the launch's last program to finish, pdserve/ops/arrival.py, measured slower: 1.02x at
batch 2, docs/benchmarks.md.)

Measured (one H200, 2026-11-30, docs/benchmarks.md): the decode step at batch 1 0.90x cuBLAS's
(2.70 against 3.00 ms), batch 2 0.97x (3.80 against 3.93 ms). Beyond two rows it lost: a
tensor-core-dot variant (rows padded to 16) was 1.10x / 1.09x slower in the step at 4 / 8 rows, one
reducing each chunk per row 1.10x / 1.24x; both were removed. A first version (pipelined loop, dots
at every row count, no PDL) measured no faster than cuBLAS on an H100 (2026-11-27).

Grids depend only on the shapes: CUDA-graph safe. `linear` is what the Triton backends call: this
kernel for up to GEMV_LINEAR_MAX_TOKENS rows on a GPU, `F.linear` otherwise.
"""

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pdserve.ops import pdl

# Up to this many rows `linear` takes the GEMV (PDSERVE_GEMV_LINEAR: 2, 1, or 0: always F.linear, the
# reference a benchmark compares against). Beyond two rows cuBLAS is faster (docs/benchmarks.md).
MAX_ROWS = 2
GEMV_LINEAR_MAX_TOKENS = min(MAX_ROWS, int(os.environ.get("PDSERVE_GEMV_LINEAR", "2")))


@triton.jit
def _gemv_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, stride_xt, stride_wn, stride_ot,
                        K: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PREFETCH: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """ROWS: 1 or 2 input rows, each summed elementwise in float32 and reduced once at the end.
    PREFETCH: the first chunk of weight rows is loaded before the wait (no kernel writes weights)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    # Features past N read row N - 1 (in bounds, never stored): the weight loads need no mask along N.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    if PREFETCH:
        w_first = tl.load(w_tile, mask=(offs_k < K)[None, :], other=0.0)
    pdl.wait(USE_PDL)  # x is the kernel before's output
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: the next chunks' loads go out before this one's sums
        if EVEN_K:
            if PREFETCH and k0 == 0:
                w = w_first.to(tl.float32)
            else:
                w = tl.load(w_tile + k0).to(tl.float32)
            x0 = tl.load(x_ptr + k0 + offs_k).to(tl.float32)
        else:
            k_mask = offs_k < K - k0
            if PREFETCH and k0 == 0:
                w = w_first.to(tl.float32)
            else:
                w = tl.load(w_tile + k0, mask=k_mask[None, :], other=0.0).to(tl.float32)
            x0 = tl.load(x_ptr + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        acc0 += w * x0[None, :]
        if ROWS == 2:
            if EVEN_K:
                x1 = tl.load(x_ptr + stride_xt + k0 + offs_k).to(tl.float32)
            else:
                x1 = tl.load(x_ptr + stride_xt + k0 + offs_k, mask=offs_k < K - k0, other=0.0).to(tl.float32)
            acc1 += w * x1[None, :]
    y0 = tl.sum(acc0, 1)
    y1 = tl.sum(acc1, 1)  # (one row: zeros, never stored)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows).to(tl.float32)
        y0 += bias
        y1 += bias
    tl.store(out_ptr + offs_n, y0.to(out_ptr.dtype.element_ty), mask=n_mask)
    if ROWS == 2:
        tl.store(out_ptr + stride_ot + offs_n, y1.to(out_ptr.dtype.element_ty), mask=n_mask)


def gemv_linear_config(num_tokens: int, in_features: int) -> dict:
    """Fixed table (no autotuning; `check_kernels --only linear --sweep` times alternatives). Tiles of
    8 features: on an H200 (Qwen3-30B-A3B, graph-replayed, 2026-11-30) 8-row tiles beat 16-, 32- and
    64-row ones at both shapes and both row counts; the chunk a quarter of the reduced dimension for
    one row (q/k/v 7.2 us at 512, o 6.2 us at 1024) and 1,024 for two (9.3 / 7.2 us)."""
    bk = max(256, min(1024, in_features // 4)) if num_tokens == 1 else 1024
    return dict(BLOCK_N=8, BLOCK_K=bk, num_warps=4)


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's contract for x [T, K] (T = 1 or 2), weight [N, K], bias [N] or None -> [T, N] in x's dtype."""
    num_tokens, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    if out is None:
        out = x.new_empty(num_tokens, n)
    assert out.shape == (num_tokens, n) and out.stride(1) == 1
    if num_tokens == 0:
        return out
    cfg = config or gemv_linear_config(num_tokens, k)
    bn, bk = cfg["BLOCK_N"], min(cfg["BLOCK_K"], max(16, triton.next_power_of_2(k)))
    assert num_tokens <= MAX_ROWS, f"gemv_linear takes 1 to {MAX_ROWS} rows, not {num_tokens} (F.linear beyond)"
    _gemv_linear_kernel[(triton.cdiv(n, bn),)](
        x, weight, bias if bias is not None else weight, out, n,
        x.stride(0), weight.stride(0), out.stride(0),
        K=k, HAS_BIAS=bias is not None, ROWS=num_tokens, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0,
        PREFETCH=pdl.prefetches("linear"),
        num_warps=cfg["num_warps"], **pdl.launch_kwargs(x.device))
    return out


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and 0 < x.shape[0] <= GEMV_LINEAR_MAX_TOKENS and x.is_cuda
            and x.stride(1) == 1 and weight.stride(1) == 1 and x.dtype == weight.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the GEMV for up to GEMV_LINEAR_MAX_TOKENS rows of a 2-D x on a GPU."""
    if _takes_gemv(x, weight):
        return gemv_linear(x, weight, bias)
    return F.linear(x, weight, bias)

