"""Tensor parallelism inside a replica: which slice of each weight a rank holds, and the all-reduce.

Megatron's split of a decoder layer over `size` ranks: the projections into heads (q, k, v; MLA's
q / q_b and kv_b) and into the MLP's intermediate width (gate, up; every expert's w13) are
column-parallel: each rank computes its heads / its part of the intermediate width from the whole
hidden state. The projections back (o_proj, down, every expert's w2) are row-parallel: each rank
multiplies its slice and one all-reduce sums the partial results, after which the bias (on every
rank, added once) follows. Two all-reduces per layer, none elsewhere.

KV heads: a rank holds kv_heads / size of them, or, when there are fewer KV heads than ranks, the one
its query heads read (a copy of it on size / kv_heads ranks). MLA's latent cache has no heads: every
rank caches the whole latent and up-projects its own heads from it.

Embedding, final norm and LM head are replicated: the logits come out whole on every rank with no
collective (rank 0 samples), at the cost of one vocab x hidden matrix per rank — small beside the
layers for every model served here; sharding the vocabulary is an all-gather away when it is not.

A sharded parameter records (dim, index, full length) in its module's `tp_shards`: the dummy weights
are drawn whole and sliced, and checkpoint tensors are sliced as they are read, so rank r holds
exactly rows `index` of the single-rank model's tensor.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass
class TensorParallel:
    rank: int
    size: int
    group: object = None  # a torch.distributed process group; None: the default one

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (x must be contiguous); x unchanged with one rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def agree_min(self, n: int, device: torch.device) -> int:
        """The smallest of every rank's `n` (a collective: every rank calls it). `device`: where the
        group's backend takes tensors (a GPU for NCCL)."""
        if self.size == 1:
            return n
        t = torch.tensor([n], dtype=torch.long, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def block(self, n: int, unit: int = 1) -> torch.Tensor:
        """Indices of this rank's contiguous n/size units of `unit` rows each (n divisible by size)."""
        local = n // self.size
        return torch.arange(self.rank * local * unit, (self.rank + 1) * local * unit)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> range:
        """The KV heads this rank's query heads read: its own share, or the single one it copies."""
        if num_kv_heads >= self.size:
            local = num_kv_heads // self.size
            return range(self.rank * local, (self.rank + 1) * local)
        return range(self.rank * num_kv_heads // self.size, self.rank * num_kv_heads // self.size + 1)


def rank_heads(num_heads: int, tp: TensorParallel | None) -> int:
    """The query heads a rank holds (all of them without tensor parallelism)."""
    return num_heads // tp.size if tp is not None else num_heads


def check_tp_size(args, size: int, key: str = "tp_size") -> None:
    """Raise ValueError naming `key` if the model cannot be split over `size` ranks."""
    if size < 1:
        raise ValueError(f"{key} must be >= 1, got {size}")
    if size == 1:
        return
    widths = {"num_attention_heads": args.num_heads}
    if any(not args.is_moe_layer(i) for i in range(args.num_layers)):
        widths["intermediate_size"] = args.intermediate_size
    if args.num_experts:
        widths["moe_intermediate_size"] = args.moe_intermediate_size
    if args.shared_expert_intermediate_size:
        widths["shared_expert_intermediate_size"] = args.shared_expert_intermediate_size
    for name, n in widths.items():
        if n % size:
            raise ValueError(f"{key} {size} must divide the model's {name} ({n})")
    kv = args.num_kv_heads
    if not args.is_mla and kv % size and size % kv:
        raise ValueError(f"{key} {size} and the model's num_key_value_heads ({kv}) must divide one another")


@torch.no_grad()
def shard_param(module: nn.Module, name: str, dim: int, index: torch.Tensor) -> None:
    """Keep rows `index` along `dim` of module.<name>; on the meta device, before allocation."""
    p = getattr(module, name)
    assert p.is_meta, "shard_param resizes parameters: call it on a model built on the meta device"
    shape = list(p.shape)
    full = shape[dim]
    shape[dim] = len(index)
    setattr(module, name, nn.Parameter(p.new_empty(shape), requires_grad=False))
    if not hasattr(module, "tp_shards"):
        module.tp_shards = {}
    module.tp_shards[name] = (dim, index, full)


def shard_linear_out(linear: nn.Linear, index: torch.Tensor) -> None:
    """Column-parallel: keep output rows `index` (weight and bias)."""
    shard_param(linear, "weight", 0, index)
    if linear.bias is not None:
        shard_param(linear, "bias", 0, index)


def shard_linear_in(linear: nn.Linear, index: torch.Tensor) -> None:
    """Row-parallel: keep input columns `index`; the bias stays whole (added after the all-reduce)."""
    shard_param(linear, "weight", 1, index)


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TensorParallel | None, matmul=F.linear) -> torch.Tensor:
    """linear(x) for a row-parallel layer: this rank's partial product, summed over ranks, plus bias.
    `matmul` (F.linear's contract): the attention backend's `linear`."""
    if tp is None or tp.size == 1:
        return matmul(x, linear.weight, linear.bias)
    out = tp.all_reduce(matmul(x, linear.weight).contiguous())
    return out if linear.bias is None else out + linear.bias


def slice_full(tensor: torch.Tensor, shard: tuple[int, torch.Tensor, int] | None) -> torch.Tensor:
    """A whole (single-rank) tensor -> this rank's slice of it; a tensor already local is returned as is."""
    if shard is None:
        return tensor
    dim, index, full = shard
    if tensor.dim() <= dim or tensor.shape[dim] != full:
        return tensor  # not the whole tensor: the shape check of the copy reports it
    return tensor.index_select(dim, index.to(tensor.device))
