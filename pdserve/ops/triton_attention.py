"""Attention backend for CUDA: Triton kernels over the paged KV cache, same interface as TorchAttention.

K/V caches (`forward`: MHA, GQA). A step whose rows are all one token (decode) runs the split-K
paged decode kernel; a step of fresh prompts only (no cached prefix, no decode rows) runs torch's
SDPA on its own K/V; any other step (prefill chunks after a prefix, or prefill mixed with decode
rows, or a CUDA graph of several fresh prompts: `ForwardBatch.varlen_rows`) runs the paged varlen
prefill kernel over every row. The decode path reads only device tensors (`ForwardBatch.context_lens_t`)
and sizes its grid from host-side numbers, so it never waits for the GPU and can be captured in a
CUDA graph. On that path the decode kernel writes the step's K/V into the cache itself (one launch
fewer; `fuse_kv_write=False` keeps the separate `write_kv_triton` launch).

An FP8 cache (`ForwardBatch.kv_scales`): every kernel writes and reads it through the layer's
(k_scale, v_scale); fresh prompts attend to their own K/V rounded through FP8 as the cache holds
them, so a prompt's output does not depend on which path (fresh, chunked, cached prefix) ran it.

Latent caches (`forward_mla`: Multi-head Latent Attention, DeepSeek-V2/V3): decode rows attend
over the latents with kv_b_proj absorbed into the query and the output (pdserve.ops.mla_decode,
split-K like the GQA kernel, the latent write fused in, CUDA-graph safe); prefill chunks
up-project their context's latents and run SDPA (pdserve.ops.mla_attention). FP8 latents through
the layer's one scale, on every path.
"""

import torch

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.ops.decode_attention import decode_num_splits, paged_decode_attention
from pdserve.ops.gemv_linear import linear
from pdserve.ops.kv_quant import round_trip
from pdserve.ops.kv_write import write_kv_triton, write_latent_triton
from pdserve.ops.mla_attention import mla_decode, mla_mixed
from pdserve.ops.mla_decode import mla_num_splits
from pdserve.ops.prefill_attention import paged_prefill_attention
from pdserve.ops.sdpa import FRESH_BUCKET, padded_len, prompt_attention


# A prefill graph of more sequence slots than this (its sequences and the padding's) launches its
# attention over the sequences' tiles end to end (paged_prefill_attention's `flat`): with a program
# per tile slot of every sequence slot, the 4,096-token bucket's grid alone is 256 tiles a slot.
# Above the 33 slots of EngineConfig's default graphs (a prefill replica's), whose grid was timed
# first; decode and colocated replicas' graphs of 128 slots run the flat grid (H200, 2026-11-29:
# docs/benchmarks.md, "A chunk beside many decoders").
FLAT_FROM_SLOTS = 33
# An eager step of more sequences than FLAT_FROM_SLOTS (a chunk mixed into many decoders: the
# chunk's tile count for every decoder) launches the flat grid too when this is set. Off: beside 96
# decoders it timed within 3 % of today's grid, one run each (`python -m pdserve.benchmarks.mixed_step
# ... --flat-eager` against the same run without it).
FLAT_EAGER = False


class TritonAttention:
    """Paged attention with Triton kernels; `decode_splits` fixes the split count (CUDA graphs)."""

    # The model computes q, k and v with one GEMM (Attention.fuse_qkv): fewer kernels and less GPU
    # time in a decode step (docs/benchmarks-history.md). k and v arrive as strided views; every
    # kernel here takes strides.
    fuse_qkv = True
    # Multi-head Latent Attention (DeepSeek-V2/V3) over a latent cache: `forward_mla`.
    supports_mla = True
    # The layers' dense projections (fused q/k/v, o; MLA's fused q + kv_a, o): one GEMV launch for a
    # decode step's few rows, in the PDL chain (pdserve/ops/gemv_linear.py); cuBLAS beyond.
    linear = staticmethod(linear)

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
        lengths = range(FRESH_BUCKET, padded_len(longest) + 1, FRESH_BUCKET)
        for n in lengths:
            q = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)
            kv = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
            _fresh_prompts(q, kv, kv, [0, n], 1.0)
        return len(lengths)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads, D]."""
        kv_layer, scales = batch.kv_cache[layer], batch.layer_scales(layer)
        varlen = batch.varlen_rows is not None  # a CUDA graph of several fresh prompts
        decode = not varlen and q.shape[0] == batch.num_seqs  # every sequence brings exactly one token
        fused = decode and self.fuse_kv_write
        if not fused:
            write_kv_triton(kv_layer, k, v, batch.slot_mapping, scales)
        _ensure_device_metadata(batch, q.device)
        if varlen:  # each prompt over its own K/V, just cached, bounds from the device lists
            return paged_prefill_attention(q, kv_layer, batch.block_tables, batch.context_lens_t,
                                           batch.query_start_t, batch.varlen_rows, scale, kv_scales=scales,
                                           flat=batch.num_seqs > FLAT_FROM_SLOTS)
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
                                       batch.query_start_t, max_query_len, scale, kv_scales=scales,
                                       flat=FLAT_EAGER and batch.num_seqs > FLAT_FROM_SLOTS)

    def forward_mla(self, layer: int, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch,
                    scale: float, attn) -> torch.Tensor:
        """Multi-head Latent Attention. q [T, heads, qk_nope + qk_rope] (rope part rotated), latent
        [T, kv_lora_rank + qk_rope] (the cache entry) -> [T, heads, v_head_dim]; `attn` is the layer
        (pdserve.models.mla.MLAttention: kv_b_proj, the widths). A decode step runs absorbed over
        the latents (its latent write fused into the kernel unless fuse_kv_write is off); any other
        step writes the latents first, then runs its one-token rows absorbed and its chunks
        expanded (pdserve.ops.mla_attention)."""
        kv_layer, scales = batch.kv_cache[layer], batch.layer_scales(layer)
        assert batch.varlen_rows is None, "MLA's fresh prompts have no varlen kernel: one prompt per graph"
        decode = q.shape[0] == batch.num_seqs  # every sequence brings exactly one token
        fused = decode and self.fuse_kv_write
        if not fused:
            write_latent_triton(kv_layer, latent, batch.slot_mapping, scales)
        _ensure_device_metadata(batch, q.device)
        if not decode:
            return mla_mixed(q, latent, kv_layer, scales, batch, scale, attn)
        splits = self.decode_splits or mla_num_splits(batch.num_seqs, attn.num_heads, max(batch.context_lens),
                                                      q.device)
        new = dict(latent_new=latent, slot_mapping=batch.slot_mapping) if fused else {}
        return mla_decode(q, kv_layer, batch.block_tables, batch.context_lens_t, scale, splits, attn, scales, **new)


def _fresh_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int],
                   scale: float) -> torch.Tensor:
    """Prompts with no cached prefix attend only to this step's own K/V: torch's SDPA (GQA native)
    is faster there than our paged kernel, which reads the cache through the block table. One call
    per prompt (rows padded to FRESH_BUCKET, pdserve.ops.sdpa); a prefill step holds few."""
    out = torch.empty_like(q)
    for a, b in zip(starts, starts[1:]):
        out[a:b] = prompt_attention(q[a:b], k[a:b], v[a:b], scale)
    return out


def _ensure_device_metadata(batch: ForwardBatch, device: torch.device) -> None:
    """Fill the int32 device copies of the host lists when whoever built the batch did not."""
    if batch.context_lens_t is None:
        batch.context_lens_t = torch.tensor(batch.context_lens, dtype=torch.int32, device=device)
    if batch.query_start_t is None:
        batch.query_start_t = torch.tensor(batch.query_start, dtype=torch.int32, device=device)
