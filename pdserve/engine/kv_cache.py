"""The worker's one KV allocation, paged in blocks.

Layout [layers, planes, blocks, block_size, heads, dim]. What a plane holds is the layout's
*kind*:

- "kv" (MHA / GQA): two planes, K then V, each [blocks, block_size, kv_heads, head_dim].
- "latent" (Multi-head Latent Attention, DeepSeek-V2/V3): one plane, heads 1, dim kv_lora_rank +
  qk_rope_head_dim: per token the normalised latent c_kv followed by the roped key every head
  shares. Keys and values are up-projected from it when attending; there is no V plane.

For a given layer and plane, a run of consecutive block ids is one contiguous byte range, so a run
moves as one descriptor. Everything that moves or copies blocks (the kvtransfer backends, the
prefix cache's reuse) works on (layer, plane, block) units of `bytes_per_block` bytes and never
looks inside one: a latent cache moves exactly as a K/V cache does.
"""

from dataclasses import dataclass

import torch

# kind -> what its planes hold, in order.
KV_KINDS: dict[str, tuple[str, ...]] = {"kv": ("k", "v"), "latent": ("latent",)}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # heads per plane entry: kv heads, or 1 for a latent
    head_dim: int  # width per head: head_dim, or kv_lora_rank + qk_rope_head_dim for a latent
    dtype: torch.dtype
    kind: str = "kv"

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise ValueError(f"KV layout kind {self.kind!r} is not one of {', '.join(KV_KINDS)}")

    @classmethod
    def for_model(cls, args, num_blocks: int, block_size: int, dtype: torch.dtype) -> "KVLayout":
        """The layout a model's cache takes (`args`: its pdserve.models.ModelArgs)."""
        kind, _, heads, dim = args.kv_cache_entry()
        return cls(args.num_layers, num_blocks, block_size, heads, dim, dtype, kind)

    @property
    def num_planes(self) -> int:
        return len(KV_KINDS[self.kind])

    @property
    def dims(self) -> str:
        """The dimension order, naming what the planes hold: the handshake compares it."""
        if self.kind == "latent":
            return "layers,latent,blocks,block_size,1,kv_lora_rank+qk_rope_head_dim"
        return "layers,kv,blocks,block_size,kv_heads,head_dim"

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.num_planes, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer's plane (K, V or latent): the unit every copy moves."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers and planes."""
        return self.num_planes * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def num_blocks_for(budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, num_planes: int = 2) -> int:
    per_block = num_planes * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
    return max(1, budget_bytes // per_block)


def allocate_kv_cache(layout: KVLayout, device: torch.device) -> torch.Tensor:
    """[layers, planes, blocks, block_size, heads, dim], zero-filled."""
    return torch.zeros(layout.shape, dtype=layout.dtype, device=device)
