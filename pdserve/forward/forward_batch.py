"""The per-step description of a batch that a model forward needs besides its weights."""

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """One engine step's tokens, flattened over sequences, and where their KV lives.

    Sequence i owns tokens ``query_start[i]:query_start[i+1]`` of the flat batch. Its KV after
    this step covers ``context_lens[i]`` tokens (cached prefix + this step's tokens), stored in
    the blocks ``block_tables[i, :ceil(context_lens[i] / block_size)]``.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64, block_id * block_size + offset
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with 0
    query_start: list[int]  # [num_seqs + 1], host-side so the reference path never syncs
    context_lens: list[int]  # [num_seqs], host-side
    logits_indices: torch.Tensor  # [num_sampled] rows of the hidden states that become logits
    kv_cache: torch.Tensor  # [layers, planes, num_blocks, block_size, heads, dim]: kv_cache.KVLayout
    # Called with the layer index once that layer's KV is in the cache: layer-wise KV streaming.
    layer_done: Callable[[int], None] | None = None
    # Device copies of the host lists for GPU kernels, which must not read host memory (CUDA graphs).
    context_lens_t: torch.Tensor | None = None  # [num_seqs] int32
    query_start_t: torch.Tensor | None = None  # [num_seqs + 1] int32
    # An FP8 cache: per layer, each plane's scale (KVLayout.scales); () for a cache of the model's dtype.
    kv_scales: tuple[tuple[float, ...], ...] = ()
    # Set in a CUDA graph of several fresh prompts (engine/prefill_graphs.py): the host lists are
    # placeholders fixed at capture; attention runs per prompt from the device lists, through the
    # varlen kernel sized for this many query rows.
    varlen_rows: int | None = None
    # The host tensors positions, slot_mapping and block_tables were copied from (ModelRunner.prepare):
    # rank 0 of a tensor-parallel replica sends them to its followers without waiting for the GPU.
    host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def layer_scales(self, layer: int) -> tuple[float, ...]:
        """Layer `layer`'s plane scales ((k, v) or (latent,)); () for a cache of the model's dtype."""
        return self.kv_scales[layer] if self.kv_scales else ()

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    @property
    def query_lens(self) -> list[int]:
        return [self.query_start[i + 1] - self.query_start[i] for i in range(self.num_seqs)]

    @property
    def block_size(self) -> int:
        return self.kv_cache.shape[3]
