"""MoE routing in one Triton launch per step, one program per token; and the router's logits for a
handful of tokens.

- `fused_topk` (Qwen3-MoE, Mixtral, Qwen2-MoE): softmax over experts, top-k, optional
  renormalisation. Chooses the same experts as `moe.route`: the softmax is monotonic, so the k
  largest logits are the k largest probabilities; ties go to the lower expert id.
- `grouped_topk` (DeepSeek-V2 / V2-Lite / V3): `moe.grouped_route` in one launch where the
  reference takes 7-15 ops: softmax or sigmoid scores; "greedy", "group_limited_greedy" (the
  topk_group of n_group groups with the best top score) or "noaux_tc" (scores + the correction
  bias, a group rated by the sum of its best two); weights renormalised if asked, times the routed
  scaling factor; and the shared experts' slots appended to every token's top-k (ids E, E+1, ...,
  weight 1), for a MoE layer whose shared experts are folded into the routed ones.
- `router_gemv` (decode at batch 1..8): the router's logits, x @ gate.T, as a GEMV spread over the
  experts' rows. cuBLAS ran Qwen3-30B-A3B's [1, 2048] x [2048, 128] on 2 CTAs: 4.9 us a layer for
  0.5 MB (an H200's batch-1 step, docs/benchmarks.md), outside the PDL chain. Float32 logits too
  (DeepSeek's, whose cuBLAS call was the same).
"""

import torch
import triton
import triton.language as tl

from pdserve.ops import pdl


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_t,
                         TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         USE_PDL: tl.constexpr):
    t = tl.program_id(0)
    pdl.wait(USE_PDL)
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
                                   num_warps=1 if e <= 128 else 4, **pdl.launch_kwargs(router_logits.device))
    return weights, ids


# The kernel's METHOD.
_METHODS = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


@triton.jit
def _grouped_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, group_size, stride_t, scaling,
                         TOP_K: tl.constexpr, NUM_SHARED: tl.constexpr, SIGMOID: tl.constexpr,
                         METHOD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    t = tl.program_id(0)
    pdl.wait(USE_PDL)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        ex = tl.exp(x - tl.max(x, 0))
        scores = ex / tl.sum(ex, 0)
    # What experts are chosen on. Softmax and sigmoid are monotonic: without a bias the logits
    # order the experts (and a group's best expert) as the scores do, exactly, rounding aside.
    # noaux_tc rates a group by a sum of two scores, which the logits do not order.
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    elif METHOD == 2:  # noaux_tc
        choice = scores
    else:
        choice = x
    choice = tl.where(valid, choice, float("-inf"))
    if METHOD != 0 and N_GROUP > 1:  # not greedy
        grp = e // group_size
        g = tl.arange(0, BLOCK_G)
        group_score = tl.full([BLOCK_G], float("-inf"), tl.float32)
        for i in tl.static_range(N_GROUP):
            member = tl.where(grp == i, choice, float("-inf"))
            best = tl.max(member, 0)
            if METHOD == 2:  # plus the second best (a tie with the best counts twice, as topk(2) does)
                first = tl.argmax(member, 0, tie_break_left=True)
                best += tl.max(tl.where(e == first, float("-inf"), member), 0)
            group_score = tl.where(g == i, best, group_score)
        keep = e < 0
        for i in tl.static_range(TOPK_GROUP):
            chosen = tl.argmax(group_score, 0, tie_break_left=True)
            keep = keep | (grp == chosen)
            group_score = tl.where(g == chosen, float("-inf"), group_score)
        # The reference fills the other groups with 0 (group_limited_greedy) or -inf (noaux_tc);
        # top_k never exceeds the kept experts (ModelArgs checks it), so either loses every pick.
        choice = tl.where(keep, choice, float("-inf"))
    # The top k one at a time, highest first (ties to the lower id); weights are the scores.
    slot = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(choice, 0, tie_break_left=True)
        w = tl.where(slot == i, tl.sum(tl.where(e == best, scores, 0.0), 0), w)
        ids = tl.where(slot == i, best.to(tl.int64), ids)
        choice = tl.where(e == best, float("-inf"), choice)
    if RENORMALIZE:
        w = w / (tl.sum(w, 0) + 1e-20)
    w = w * scaling
    # The shared experts' slots: every token, weight 1 (unscaled: they are not routed).
    shared = (slot >= TOP_K) & (slot < TOP_K + NUM_SHARED)
    w = tl.where(shared, 1.0, w)
    ids = tl.where(shared, (num_experts + slot - TOP_K).to(tl.int64), ids)
    width = TOP_K + NUM_SHARED
    tl.store(weights_ptr + t * width + slot, w, mask=slot < width)
    tl.store(ids_ptr + t * width + slot, ids.to(ids_ptr.dtype.element_ty), mask=slot < width)


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, scoring: str, method: str, n_group: int,
                 topk_group: int, correction_bias: torch.Tensor | None, renormalize: bool, scaling: float,
                 num_shared: int = 0, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.grouped_route` in one launch: router_logits [T, E] -> weights [T, k + num_shared] float32,
    ids [T, k + num_shared] int64; columns k.. are the shared experts' slots (ids E + j, weight 1).
    The k routed columns come highest choice first; the reference's order is unspecified (sorted=False)."""
    t, e = router_logits.shape
    assert router_logits.stride(-1) == 1 and top_k <= e and scoring in ("softmax", "sigmoid")
    assert method == "greedy" or e % n_group == 0, (e, n_group)
    width = top_k + num_shared
    if out is not None:
        weights, ids = out
    else:
        weights = torch.empty(t, width, dtype=torch.float32, device=router_logits.device)
        ids = torch.empty(t, width, dtype=torch.int64, device=router_logits.device)
    if t:
        has_bias = correction_bias is not None
        _grouped_topk_kernel[(t,)](
            router_logits, correction_bias if has_bias else router_logits, weights, ids, e, e // n_group,
            router_logits.stride(0), float(scaling),
            TOP_K=top_k, NUM_SHARED=num_shared, SIGMOID=scoring == "sigmoid", METHOD=_METHODS[method],
            N_GROUP=n_group, TOPK_GROUP=topk_group, HAS_BIAS=has_bias, RENORMALIZE=renormalize,
            BLOCK_E=triton.next_power_of_2(e), BLOCK_G=triton.next_power_of_2(n_group),
            BLOCK_K=triton.next_power_of_2(width), num_warps=1 if e <= 128 else 4,
            **pdl.launch_kwargs(router_logits.device))
    return weights, ids


@triton.jit
def _router_gemv_kernel(x_ptr, w_ptr, out_ptr, num_experts, stride_xt, stride_we, stride_ot,
                        K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Grid (tokens, experts / BLOCK_E): BLOCK_E experts' logits of one token, float32 sums; the loop
    over the hidden size unrolled, so a program's loads are in flight together. PREFETCH: the first
    chunk of the router's rows is loaded before the wait (no kernel writes weights)."""
    t = tl.program_id(0)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_mask = offs_e < num_experts
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + offs_e[:, None].to(tl.int64) * stride_we + offs_k[None, :]
    if PREFETCH:
        w_first = tl.load(w_rows, mask=e_mask[:, None] & (offs_k < K)[None, :], other=0.0)
    pdl.wait(USE_PDL)
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    acc = tl.zeros([BLOCK_E, BLOCK_K], tl.float32)
    for k0 in tl.static_range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        xk = tl.load(x_row + k0 + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if PREFETCH and k0 == 0:
            w = w_first.to(tl.float32)
        else:
            w = tl.load(w_rows + k0, mask=e_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += w * xk[None, :]
    logits = tl.sum(acc, 1)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs_e, logits.to(out_ptr.dtype.element_ty), mask=e_mask)


def router_gemv(x: torch.Tensor, weight: torch.Tensor, block_e: int = 4, block_k: int = 512,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, H] @ weight [E, H].T -> [T, E] in x's dtype (as F.linear), summed in float32; with
    out_dtype float32 the sums unrounded (DeepSeek's routers take float32 logits)."""
    t, hidden = x.shape
    e = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and weight.shape[1] == hidden
    out = torch.empty(t, e, dtype=out_dtype or x.dtype, device=x.device)
    if t:
        _router_gemv_kernel[(t, triton.cdiv(e, block_e))](
            x, weight, out, e, x.stride(0), weight.stride(0), out.stride(0),
            K=hidden, BLOCK_E=block_e, BLOCK_K=min(block_k, triton.next_power_of_2(hidden)),
            PREFETCH=pdl.prefetches("router"), num_warps=4,
            **pdl.launch_kwargs(x.device))
    return out
