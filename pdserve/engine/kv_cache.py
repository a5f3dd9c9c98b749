"""The worker's one KV allocation, paged in blocks.

Layout [layers, 2 (k, v), blocks, block_size, kv_heads, head_dim]: for a given layer and k/v, a
run of consecutive block ids is one contiguous byte range, so a run moves as one descriptor.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of one layer's K (or V)."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes across all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def num_blocks_for(budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype) -> int:
    per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize
    return max(1, budget_bytes // per_block)


def allocate_kv_cache(layout: KVLayout, device: torch.device) -> torch.Tensor:
    """[layers, 2, blocks, block_size, kv_heads, head_dim], zero-filled."""
    return torch.zeros(layout.shape, dtype=layout.dtype, device=device)
