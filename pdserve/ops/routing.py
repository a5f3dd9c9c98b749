"""MoE routing in one Triton launch: softmax over experts, top-k, optional renormalisation.

Chooses the same experts as `moe.route`: the softmax is monotonic, so the k largest logits are the
k largest probabilities; ties go to the lower expert id.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_t + e, mask=e < num_experts, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    ex = tl.exp(x - m)
    probs = ex / tl.sum(ex, 0)
    total = 1.0
    if RENORMALIZE:  # a first pass for the chosen experts' total probability
        pick = x
        total = 0.0
        for i in tl.static_range(TOP_K):
            best = tl.argmax(pick, 0, tie_break_left=True)
            total += tl.sum(tl.where(e == best, probs, 0.0), 0)
            pick = tl.where(e == best, float("-inf"), pick)
    # Pick the top k one at a time; `pick` keeps the logits, knocked out to -inf once chosen.
    pick = x
    for i in tl.static_range(TOP_K):
        best = tl.argmax(pick, 0, tie_break_left=True)
        w = tl.sum(tl.where(e == best, probs, 0.0), 0)
        tl.store(weights_ptr + t * TOP_K + i, w / total)
        tl.store(ids_ptr + t * TOP_K + i, best.to(ids_ptr.dtype.element_ty))
        pick = tl.where(e == best, float("-inf"), pick)


def fused_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> weights [T, k] float32, ids [T, k] int64 (as `moe.route`)."""
    t, e = router_logits.shape
    assert router_logits.stride(-1) == 1 and top_k <= e
    if out is not None:
        weights, ids = out
    else:
        weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
        ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        _topk_softmax_kernel[(t,)](router_logits, weights, ids, e, router_logits.stride(0),
                                   TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(e),
                                   num_warps=1 if e <= 128 else 4)
    return weights, ids
