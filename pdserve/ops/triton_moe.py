"""MoE backend for CUDA: fused top-k routing (DeepSeek's grouped routing too), and per batch size (a
host-known shape, so each choice is fixed inside a CUDA graph) one of: the GEMV MoE (a handful of
tokens: no sort/align pass), the Triton fused MoE (small batches, decode) or `torch._grouped_mm`
(large bf16 batches)."""

import torch

from pdserve.ops.fused_moe import fused_moe
from pdserve.ops.gemv_moe import gemv_moe
from pdserve.ops.grouped_mm_moe import grouped_mm_moe
from pdserve.ops.routing import fused_topk, grouped_topk, router_gemv

# From this many tokens on, bf16 batches take torch._grouped_mm. Below it the fused path (its 128-row
# tiles from 128 rows an expert) is the faster one for the whole MoE, Qwen3-30B-A3B's and
# DeepSeek-V2-Lite's; from 3k tokens the two are even or _grouped_mm leads (docs/benchmarks-history.md,
# light load and first requests, 2026-11-27). Was 512, then 2048: decode batches of 512, the gathered
# rows of expert-parallel steps (N ranks x 256) and 2k-token prompts then took the slower path.
GROUPED_MM_MIN_TOKENS = 3072
# Up to this many tokens, the GEMV path (check_kernels.py's "moe gemv" rows against "moe fused").
# Since its loops unroll (and its tiles are 32 rows), replayed from a graph it leads at every T up
# to 8: 31.4 / 49.2 / 78.5 / 131.4 us against 37.1 / 52.7 / 83.2 / 138.2 at T = 1 / 2 / 4 / 8
# (Qwen3-30B-A3B's shape, one H200, 2026-11-29; DeepSeek-V2-Lite's not timed). Was 1: fused led from T=2.
GEMV_MAX_TOKENS = 8
# Up to this many tokens the router's logits come from `router_gemv`, beyond from cuBLAS.
ROUTER_GEMV_MAX_TOKENS = 8


class TritonMoE:
    """Same interface as TorchMoE, plus `route`."""

    # DeepSeek's shared experts ride in the routed experts' fused call (DeepseekMoE.fold_shared_experts):
    # a layer's MoE is then the router GEMM, one routing launch and the experts' kernels.
    fold_shared_experts = True

    def __init__(self, grouped_mm_min_tokens: int = GROUPED_MM_MIN_TOKENS, gemv_max_tokens: int = GEMV_MAX_TOKENS):
        self.grouped_mm_min_tokens = grouped_mm_min_tokens
        self.gemv_max_tokens = gemv_max_tokens

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
        """x [T, H] @ weight [E, H].T -> [T, E] in x's dtype, or float32 (out_dtype; 16-bit x and
        weight of one dtype: the products exact, summed in float32): a GEMV over the experts' rows
        for a handful of tokens, cuBLAS beyond."""
        if x.shape[0] <= ROUTER_GEMV_MAX_TOKENS and x.stride(1) == 1 and weight.stride(1) == 1:
            return router_gemv(x, weight, out_dtype=out_dtype)
        if out_dtype == torch.float32:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return torch.nn.functional.linear(x, weight)

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> weights [T, k] float32, ids [T, k]: softmax, top-k, renormalise."""
        return fused_topk(router_logits, top_k, renormalize)

    def grouped_route(self, router_logits: torch.Tensor, top_k: int, num_shared: int = 0, **kw
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's routing in one launch (`grouped_topk`; keywords as `moe.grouped_route`)
        -> weights, ids [T, k + num_shared]."""
        return grouped_topk(router_logits, top_k, num_shared=num_shared, **kw)

    def path(self, num_tokens: int, dtype: torch.dtype) -> str:
        """Which implementation `forward` takes for this many tokens: "gemv", "fused" or "grouped_mm"."""
        if num_tokens <= self.gemv_max_tokens:
            return "gemv"
        if dtype == torch.bfloat16 and num_tokens >= self.grouped_mm_min_tokens:
            return "grouped_mm"
        return "fused"

    def forward(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, k] -> [T, H]."""
        path = self.path(x.shape[0], x.dtype)
        if path == "gemv":
            return gemv_moe(x, w13, w2, topk_weights, topk_ids)
        if path == "grouped_mm":
            return grouped_mm_moe(x, w13, w2, topk_weights, topk_ids)
        return fused_moe(x, w13, w2, topk_weights, topk_ids)
