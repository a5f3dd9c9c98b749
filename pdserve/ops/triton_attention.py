"""Attention backend for CUDA: Triton kernels over the paged KV cache, same interface as TorchAttention.

A step whose rows are all one token (decode) runs the split-K paged decode kernel; a step of fresh
prompts only (no cached prefix, no decode rows) runs torch's SDPA on its own K/V; any other step
(prefill chunks after a prefix, or prefill mixed with decode rows) runs the paged varlen prefill
kernel over every row. The decode path reads only device tensors (`ForwardBatch.context_lens_t`)
and sizes its grid from host-side numbers, so it never waits for the GPU and can be captured in a
CUDA graph. On that path the decode kernel writes the step's K/V into the cache itself (one launch
fewer; `fuse_kv_write=False` keeps the separate `write_kv_triton` launch).

An FP8 cache (`ForwardBatch.kv_scales`): every kernel writes and reads it through the layer's
(k_scale, v_scale); fresh prompts attend to their own K/V rounded through FP8 as the cache holds
them, so a prompt's output does not depend on which path (fresh, chunked, cached prefix) ran it.
"""

import torch
import torch.nn.functional as F

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.ops.decode_attention import decode_num_splits, paged_decode_attention
from pdserve.ops.kv_quant import round_trip
from pdserve.ops.kv_write import write_kv_triton
from pdserve.ops.prefill_attention import paged_prefill_attention


class TritonAttention:
    """Paged attention with Triton kernels; `decode_splits` fixes the split count (CUDA graphs)."""

    # The model computes q, k and v with one GEMM (Attention.fuse_qkv): a batch-1 decode step on
    # an H200 went from 744 kernels / 3.94 ms GPU time to 648 / 3.47 ms (docs/benchmarks-history.md). k and
    # v arrive as strided views; every kernel here takes strides.
    fuse_qkv = True
    # No Multi-head Latent Attention kernels yet: a DeepSeek model refuses this backend when it is
    # built (pdserve.models.mla), rather than compute garbage over a latent cache.
    supports_mla = False

    def __init__(self, decode_splits: int | None = None, fuse_kv_write: bool = True,
                 min_keys_per_split: int | None = None, fresh_sdpa: bool = True):
        self.decode_splits = decode_splits
        self.fuse_kv_write = fuse_kv_write
        self.min_keys_per_split = min_keys_per_split
        self.fresh_sdpa = fresh_sdpa

    def warm_up(self, longest: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> int:
        """Before ready: fresh prompts' attention once at every padded length up to `longest`, so
        that SDPA's per-length plans exist before traffic needs them; returns how many lengths."""
        if not self.fresh_sdpa:
            return 0
        lengths = range(FRESH_BUCKET, _padded(longest) + 1, FRESH_BUCKET)
        for n in lengths:
            q = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)
            kv = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
            _fresh_prompts(q, kv, kv, [0, n], 1.0)
        return len(lengths)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads, D]."""
        kv_layer, scales = batch.kv_cache[layer], batch.layer_scales(layer)
        decode = q.shape[0] == batch.num_seqs  # every sequence brings exactly one token
        fused = decode and self.fuse_kv_write
        if not fused:
            write_kv_triton(kv_layer, k, v, batch.slot_mapping, scales)
        _ensure_device_metadata(batch, q.device)
        if decode:
            extra = {} if self.min_keys_per_split is None else {"min_keys_per_split": self.min_keys_per_split}
            splits = self.decode_splits or decode_num_splits(
                batch.num_seqs, kv_layer.shape[3], max(batch.context_lens), q.device, **extra)
            new_kv = dict(k_new=k, v_new=v, slot_mapping=batch.slot_mapping) if fused else {}
            return paged_decode_attention(q, kv_layer, batch.block_tables, batch.context_lens_t, scale,
                                          splits, block_n=32 if q.dtype == torch.float32 else 64,
                                          kv_scales=scales, **new_kv)
        query_lens = batch.query_lens
        if self.fresh_sdpa and query_lens == batch.context_lens:
            if scales:
                k, v = round_trip(k, scales[0]), round_trip(v, scales[1])
            return _fresh_prompts(q, k, v, batch.query_start, scale)
        max_query_len = max(query_lens)
        return paged_prefill_attention(q, kv_layer, batch.block_tables, batch.context_lens_t,
                                       batch.query_start_t, max_query_len, scale, kv_scales=scales)


# SDPA's cuDNN backend (torch's pick for fresh prompts on Hopper) builds an execution plan the first
# time it meets a sequence length: 55-90 ms more on one H200 for a 129- to 4095-token prompt of a new
# length (docs/benchmarks.md), on every new length, where flash attention instead cost 11 ms more
# on every 4k prompt. So each prompt's rows are padded at the end to a multiple of FRESH_BUCKET:
# causal attention keeps every real row exact (a row attends to keys at or before it, and the
# padding comes after it), the plans are few (chunk_size / FRESH_BUCKET), and the warm-up builds
# each before the replica is ready (`warm_up`). The cost: at most FRESH_BUCKET - 1 more rows of
# attention per prompt.
FRESH_BUCKET = 128


def _padded(n: int) -> int:
    return -(-n // FRESH_BUCKET) * FRESH_BUCKET


def _fresh_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int],
                   scale: float) -> torch.Tensor:
    """Prompts with no cached prefix attend only to this step's own K/V: torch's SDPA (GQA native)
    is faster there than our paged kernel, which reads the cache through the block table. One call
    per prompt; a prefill step holds few."""
    out = torch.empty_like(q)
    for a, b in zip(starts, starts[1:]):
        n = b - a
        rows = [t[a:b] for t in (q, k, v)]
        if _padded(n) != n:
            rows = [F.pad(t, (0, 0, 0, 0, 0, _padded(n) - n)) for t in rows]  # zero rows after the prompt
        qi, ki, vi = (t.transpose(0, 1).unsqueeze(0) for t in rows)  # [1, heads, padded, D]
        o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        out[a:b] = o[0, :, :n].transpose(0, 1)
    return out


def _ensure_device_metadata(batch: ForwardBatch, device: torch.device) -> None:
    """Fill the int32 device copies of the host lists when whoever built the batch did not."""
    if batch.context_lens_t is None:
        batch.context_lens_t = torch.tensor(batch.context_lens, dtype=torch.int32, device=device)
    if batch.query_start_t is None:
        batch.query_start_t = torch.tensor(batch.query_start, dtype=torch.int32, device=device)
