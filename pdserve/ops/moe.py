"""Mixture-of-experts compute, torch reference: routing and the experts' SwiGLU MLPs."""

import torch
import torch.nn.functional as F


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, keep the top k. router_logits [T, E] -> weights [T, k] float32, ids [T, k]."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_route(router_logits: torch.Tensor, top_k: int, *, scoring: str, method: str, n_group: int,
                  topk_group: int, correction_bias: torch.Tensor | None, renormalize: bool,
                  scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing, op for op as transformers' V2 / V3 routers. router_logits [T, E] float32
    -> weights [T, k] float32, ids [T, k].

    Scores are the softmax (V2) or the sigmoid (V3) of the logits. "greedy" takes the top k;
    "group_limited_greedy" (V2) first keeps the topk_group of n_group expert groups whose best score
    is highest; "noaux_tc" (V3) chooses on scores + correction_bias, a group rated by the sum of its
    best two. The weights are the chosen experts' scores (without the bias), renormalised to sum to 1
    if asked, times `scaling` (routed_scaling_factor). The reference, in plain torch; the GPU MoE
    backend runs it in one launch (`grouped_topk`, pdserve.ops.routing)."""
    scores = router_logits.softmax(dim=-1) if scoring == "softmax" else router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if method != "greedy" and n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        if method == "group_limited_greedy":
            group_scores = grouped.max(dim=-1).values
        else:  # noaux_tc
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        keep = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e).bool()
        choice = choice.masked_fill(~keep, 0.0 if method == "group_limited_greedy" else float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def with_shared_slots(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, num_shared: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """weights, ids [T, k] -> [T, k + num_shared]: every token also takes the slots of the shared
    experts folded in after the E routed ones (ids E, E+1, ...) at weight 1."""
    if not num_shared:
        return weights, ids
    t = ids.shape[0]
    slots = torch.arange(num_experts, num_experts + num_shared, device=ids.device).expand(t, num_shared)
    return torch.cat([weights, weights.new_ones(t, num_shared)], 1), torch.cat([ids, slots.to(ids.dtype)], 1)


class TorchMoE:
    """Reference experts backend: loops over the experts that received tokens."""

    # The reference keeps DeepSeek's shared experts a module of their own, op for op as
    # transformers; a test process may turn this on to check the fold on the CPU
    # (DeepseekMoE.fold_shared_experts: this backend computes any slots it is given).
    fold_shared_experts = False

    def router_logits(self, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
        """x [T, H] @ weight [E, H].T -> [T, E]: the router's linear layer; out_dtype float32 (x and
        weight 16-bit, one dtype, on a GPU): the products summed and kept in float32, one GEMM."""
        if out_dtype == torch.float32:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return torch.nn.functional.linear(x, weight)

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> weights [T, k] float32, ids [T, k]: `route`."""
        return route(router_logits, top_k, renormalize)

    def grouped_route(self, router_logits: torch.Tensor, top_k: int, num_shared: int = 0, **kw
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's routing (`grouped_route`, keywords as there) -> weights, ids [T, k + num_shared]:
        the shared experts' slots appended where they are folded in."""
        weights, ids = grouped_route(router_logits, top_k, **kw)
        return with_shared_slots(weights, ids, router_logits.shape[1], num_shared)

    def forward(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, k] -> [T, H].
        A pair whose id is E (SKIP_EXPERT(w13)) adds nothing: expert parallel, served elsewhere."""
        out = torch.zeros_like(x)
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        order = torch.argsort(flat_ids, stable=True)  # skipped pairs sort last, past every expert's run
        counts = torch.bincount(flat_ids, minlength=w13.shape[0])[:w13.shape[0]].tolist()
        flat_weights = topk_weights.flatten()
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            tokens = sel // top_k
            gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[expert])
            out.index_add_(0, tokens, (y * flat_weights[sel, None]).to(x.dtype))
        return out
