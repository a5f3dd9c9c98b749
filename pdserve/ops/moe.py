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


class TorchMoE:
    """Reference experts backend: loops over the experts that received tokens."""

    def route(self, router_logits: torch.Tensor, top_k: int, renormalize: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """router_logits [T, E] -> weights [T, k] float32, ids [T, k]: `route`."""
        return route(router_logits, top_k, renormalize)

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
