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

An FP8 cache (`ModelConfig.kv_cache_dtype: fp8_e4m3`) stores float8 e4m3 values, each plane of
each layer with its own static scale: stored = clamp(value / scale, ±448), read = stored * scale.
The scales belong to the layout: they never change while the cache lives (a block written under
one scale and read under another would be wrong, and the prefix cache keeps blocks for long), and
the handshake carries them, so both ends of a transfer read the bytes alike.
"""

from dataclasses import dataclass

import torch

# kind -> what its planes hold, in order.
KV_KINDS: dict[str, tuple[str, ...]] = {"kv": ("k", "v"), "latent": ("latent",)}
# ModelConfig.kv_cache_dtype -> the stored dtype ("auto": the model's own).
KV_CACHE_DTYPES: dict[str, torch.dtype] = {"fp8_e4m3": torch.float8_e4m3fn}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value: quantizing saturates there


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # heads per plane entry: kv heads, or 1 for a latent
    head_dim: int  # width per head: head_dim, or kv_lora_rank + qk_rope_head_dim for a latent
    dtype: torch.dtype  # what the cache stores: the model's dtype, or FP8
    kind: str = "kv"
    # FP8 only: per layer, each plane's scale (stored = value / scale); every one 1.0 unless given.
    scales: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise ValueError(f"KV layout kind {self.kind!r} is not one of {', '.join(KV_KINDS)}")
        if not self.quantized:
            assert not self.scales, "scales belong to an FP8 cache"
            return
        if not self.scales:  # frozen: set once, here
            object.__setattr__(self, "scales", ((1.0,) * self.num_planes,) * self.num_layers)
        object.__setattr__(self, "scales", tuple(tuple(float(s) for s in layer) for layer in self.scales))
        assert len(self.scales) == self.num_layers and all(len(s) == self.num_planes for s in self.scales)
        assert all(s > 0 for layer in self.scales for s in layer), self.scales

    @classmethod
    def for_model(cls, args, num_blocks: int, block_size: int, dtype: torch.dtype,
                  scales: tuple[tuple[float, ...], ...] = (), tp=None, extra_layers: int = 0) -> "KVLayout":
        """The layout a model's cache takes (`args`: its pdserve.models.ModelArgs); with `tp` (a
        pdserve.models.tensor_parallel.TensorParallel) one rank's: the KV heads it holds.
        `extra_layers`: layers cached after the model's (a DeepSeek-V3 MTP drafter's, which shares
        the block tables and moves with the others)."""
        kind, _, heads, dim = args.kv_cache_entry()
        if tp is not None and kind == "kv":
            heads = len(tp.kv_heads(args.num_heads, heads))
        return cls(args.num_layers + extra_layers, num_blocks, block_size, heads, dim, dtype, kind, scales)

    @property
    def quantized(self) -> bool:
        """An FP8 cache: written through its scales, read back through them."""
        return self.dtype == FP8

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
