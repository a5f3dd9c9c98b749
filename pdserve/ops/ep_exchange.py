"""Expert-parallel dispatch and combine of a MoE layer's tokens over torch.distributed.

Each rank holds some of the experts (ExpertPlacement). For every MoE layer of every step, every
rank of the group calls `forward` with its own tokens (possibly none) and gets back, per token,
the weighted sum over its top-k experts wherever they live. Two paths:

- all-gather / reduce-scatter: each rank gathers every rank's tokens with their routing (one
  collective), padded to the step's agreed largest batch, runs its own experts over the pairs it
  serves (the others, and padding, carry the skip id: no kernel computes them), and a
  reduce-scatter sums the partial results and hands each rank its rows. Static shapes, no host
  sync: safe inside a CUDA graph. For small batches, where reading the experts' weights, not the
  extra rows, is what a step costs.
- all-to-all: a token goes once to each rank that serves one of its experts, with counts
  exchanged first (one host sync per layer); results come back the same way. Only the needed
  rows move and only owned pairs are computed: the path for large batches.

The ranks agree on the step's largest batch before the step (`begin_step`), so all take the same path.
When every rank's batch is decode-only and the largest fits the captured buckets, the step replays
CUDA graphs (pdserve/engine/cuda_graphs.py) on every rank, all-gather path, padded to one bucket.
"""

import torch
import torch.distributed as dist

from pdserve.ops.expert_placement import ExpertPlacement

# torch 2.13 renamed these (the old names warn); the GPU machine's torch 2.11 has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

ALL_GATHER, ALL_TO_ALL = "all_gather", "all_to_all"


class EPExchange:
    def __init__(self, placement: ExpertPlacement, device: torch.device, threshold: int, group=None):
        self.placement = placement
        self.rank, self.size = placement.rank, placement.ep_size
        self.threshold = threshold  # a step whose largest batch has this many tokens takes the all-to-all path
        self.group = group  # None: the default process group
        self.num_local = len(placement.local_experts)
        self._serving = placement.serving_rank().to(device)  # [ep_size, num_experts]
        self._slot = placement.local_slot().to(device)  # [num_experts (+ shared slots)]
        self.num_shared = 0  # the MoE layers' shared experts folded in as slots (fold_shared)
        self.max_tokens = 0  # the current step's largest batch over the ranks
        self.graph_batch = 0  # the largest batch the decode graphs hold (0: no graphs); set by DecodeGraphs
        self.graphed = False  # this step replays the decode graphs on every rank
        # While capturing: 1 for a real row of the bucket, 0 for padding, so that padding is neither
        # computed nor counted as expert load. A static buffer of the graphs; None in eager steps.
        self.row_valid: torch.Tensor | None = None
        # Tokens this rank routed to each expert, summed over MoE layers; on the device, no sync per layer.
        self.tokens_step = torch.zeros(placement.num_experts, dtype=torch.long, device=device)
        self.tokens_total = torch.zeros_like(self.tokens_step)  # before the current step

    def fold_shared(self, num_shared: int) -> None:
        """The MoE layers' shared experts are slots after each rank's own experts (global ids E, E+1,
        ...; DeepseekMoE.fold_shared_experts): every rank holds them and computes them for its own
        tokens, inside the same backend call as the routed pairs it serves."""
        if self.num_shared == num_shared:
            return
        assert self.num_shared == 0, "every MoE layer folds the same number of shared experts"
        dev = self._slot.device
        ranks = torch.arange(self.size, device=dev)[:, None].expand(self.size, num_shared)
        self._serving = torch.cat([self._serving, ranks], 1)  # a token's shared experts: its own rank
        self._slot = torch.cat([self._slot, self.num_local + torch.arange(num_shared, device=dev)])
        self.num_shared = num_shared

    def begin_step(self, max_tokens: int, decode_only: bool = False) -> None:
        """The ranks agreed this step's largest batch (tokens on one rank), and whether every rank's
        batch is decode-only: it fixes padding, path, and whether the step replays graphs."""
        self.tokens_total += self.tokens_step
        self.tokens_step.zero_()
        self.max_tokens = max_tokens
        self.graphed = decode_only and 0 < max_tokens <= self.graph_batch and max_tokens < self.threshold

    @property
    def path(self) -> str:
        return ALL_GATHER if self.graphed or self.max_tokens < self.threshold else ALL_TO_ALL

    def expert_load(self) -> tuple[list[int], list[int]]:
        """Tokens this rank routed to each expert, summed over layers: (since start, in the latest step)."""
        step = self.tokens_step.tolist()
        return [a + b for a, b in zip(self.tokens_total.tolist(), step)], step

    def forward(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, backend) -> torch.Tensor:
        """x [T, H]; w13/w2 this rank's experts (placement.local_experts order, then the shared slots);
        topk_* [T, k (+ shared slots)], global expert ids -> [T, H]. `backend` computes the local
        experts (pdserve.ops.moe interface)."""
        assert x.shape[0] <= self.max_tokens, f"{x.shape[0]} tokens, but the ranks agreed on {self.max_tokens}"
        routed = topk_ids[:, :topk_ids.shape[1] - self.num_shared]  # the load counts routed experts only
        flat = routed.flatten()
        counts = torch.ones_like(flat) if self.row_valid is None else \
            self.row_valid[:, None].expand(routed.shape).flatten().long()
        self.tokens_step.index_add_(0, flat, counts)
        if self.path == ALL_TO_ALL:
            return self._all_to_all(x, w13, w2, topk_weights, topk_ids, backend)
        return self._all_gather(x, w13, w2, topk_weights, topk_ids, backend)

    # -- all-gather / reduce-scatter -------------------------------------------------------------

    def _all_gather(self, x, w13, w2, weights, ids, backend) -> torch.Tensor:
        (t, k), h, p, n = ids.shape, x.shape[1], self.max_tokens, self.size
        # One collective for tokens and routing: each row is its token, then its k weights and k
        # expert ids as float32 (ids < 2**24 are exact) reinterpreted in x's dtype. Padding rows
        # weigh 0 (each collective pays NCCL's latency once per layer: fewer is faster).
        route = torch.zeros(p, 2 * k, dtype=torch.float32, device=x.device)
        # In a replayed graph the bucket's padding rows are rows of x: row_valid weighs them 0.
        route[:t, :k] = weights if self.row_valid is None else weights * self.row_valid[:, None]
        route[:t, k:] = ids
        route = route.view(x.dtype)  # [p, 2k * 4 / x's element size]
        send = x.new_zeros(p, h + route.shape[1])
        send[:t, :h] = x
        send[:, h:] = route
        recv = x.new_empty(n * p, send.shape[1])
        _all_gather(recv, send, group=self.group)
        x_all = recv[:, :h]  # rows strided past their routing: the backends take a row stride
        route_all = recv[:, h:].contiguous().view(torch.float32)
        w_all, ids_all = route_all[:, :k], route_all[:, k:].long()
        src = torch.arange(n * p, device=x.device) // p  # the rank each row comes from
        # Pairs this rank serves; padding (weight 0) is nobody's. The rest carry the skip id
        # (one past this rank's experts and shared slots), which every MoE backend leaves out.
        mine = (self._serving[src[:, None], ids_all] == self.rank) & (w_all != 0)  # [n * p, k]
        local_ids = torch.where(mine, self._slot[ids_all], self.num_local + self.num_shared)
        y = backend.forward(x_all, w13, w2, w_all, local_ids)  # [n * p, H]
        out = x.new_empty(p, h)
        _reduce_scatter(out, y.contiguous(), group=self.group)
        return out[:t]

    # -- all-to-all ------------------------------------------------------------------------------

    def _all_to_all(self, x, w13, w2, weights, ids, backend) -> torch.Tensor:
        (t, k), h, n = ids.shape, x.shape[1], self.size
        dest = self._serving[self.rank][ids]  # [T, k]: the rank computing each (token, expert) pair
        pairs_to = dest[None] == torch.arange(n, device=x.device)[:, None, None]  # [n, T, k]
        rows_to = pairs_to.any(-1)  # [n, T]: a token goes once to each rank serving any of its pairs
        counts = torch.stack([rows_to.sum(1), pairs_to.sum((1, 2))], 1).flatten()  # [n * 2]: rows, pairs
        counts_in = torch.empty_like(counts)
        dist.all_to_all_single(counts_in, counts, group=self.group)
        sizes = torch.cat([counts, counts_in]).tolist()  # the one host sync of this path
        send, recv, pairs_in = sizes[0:2 * n:2], sizes[2 * n::2], sum(sizes[2 * n + 1::2])
        flat = _first_true(rows_to, sum(send))  # rows grouped by destination rank
        to_rank, token = flat // t, flat % t
        # Each row carries its token's routing, with the pairs served by other ranks marked -1.
        here = dest[token] == to_rank[:, None]
        route = torch.cat([torch.where(here, weights[token], 0.0),
                           torch.where(here, ids[token], -1).float()], 1)  # [rows, 2k]
        x_in = x.new_empty(sum(recv), h)
        dist.all_to_all_single(x_in, x[token], recv, send, group=self.group)
        route_in = route.new_empty(sum(recv), 2 * k)
        dist.all_to_all_single(route_in, route, recv, send, group=self.group)
        y = self._local_pairs(x_in, route_in, pairs_in, w13, w2, backend)  # [rows in, H]
        back = x.new_empty(len(token), h)
        dist.all_to_all_single(back, y, send, recv, group=self.group)
        return x.new_zeros(t, h).index_add_(0, token, back)

    def _local_pairs(self, x, route, num_pairs: int, w13, w2, backend) -> torch.Tensor:
        """Per received row, the weighted sum over its pairs served here; one row per pair, so that
        no expert computes a pair it does not own."""
        if num_pairs == 0:  # (GPU kernels need not handle empty launches)
            return x.new_zeros(x.shape)
        k = route.shape[1] // 2
        ids = route[:, k:].long()
        flat = _first_true(ids >= 0, num_pairs)
        row, j = flat // k, flat % k
        y = backend.forward(x[row], w13, w2, route[row, j, None], self._slot[ids[row, j]][:, None])
        return x.new_zeros(x.shape).index_add_(0, row, y)


def _first_true(mask: torch.Tensor, count: int) -> torch.Tensor:
    """Flat indices of mask's `count` true entries, in order; no host sync, `count` is known."""
    return torch.argsort((~mask).flatten().to(torch.uint8), stable=True)[:count]
