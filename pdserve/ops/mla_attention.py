"""Multi-head Latent Attention (DeepSeek-V2/V3) on the GPU path: the form each row of a step runs in.

The cache holds per token the latent [c_kv, k_rope] (pdserve.models.mla). Per head, the reference
up-projects keys k = [W_UK c_kv, k_rope] and values v = W_UV c_kv through kv_b_proj (W_UK, W_UV:
its rows of the head's nope key and of its value) and attends over them. Two forms compute that:

- Absorbed, for decode rows (one query token: every row of a decode step, the one-token rows of
  a mixed step). q_nope·(W_UK c) = (q_nope W_UK)·c and Σ p W_UV c = W_UV Σ p c, so the query goes
  into latent space (one batched GEMM per step, [heads, B, nope] x [heads, nope, rank]),
  attention runs over the cached latents themselves (pdserve.ops.mla_decode: 576 values read per
  token where the expanded form would build 16 x 320 of them, per step, for V2-Lite), and its
  latent-space output comes back through W_UV. Only device work of fixed shapes: CUDA-graph safe.
- Expanded, for prefill rows (a chunk of several tokens): as the reference, the context's latents
  up-projected to K/V (one GEMM, ctx x rank x heads·(nope + v)) and torch's SDPA over them
  (pdserve.ops.sdpa). Per chunk the up-projection costs what its attention does, and the
  attention runs at head_dim 192 rather than 576. A chunk after a cached prefix zero-pads V to the
  q/k head width, which flash attention requires (the padding's output columns are dropped); a
  fresh prompt's V keeps its width (SDPA's cuDNN backend takes it, and is faster so). A fresh
  prompt (nothing cached before it) expands this step's own latents, rounded through FP8 when the cache is FP8 so
  that it attends to what the cache holds; a chunk after a cached prefix reads the prefix from
  the cache (dequantized).
"""

import torch
import torch.nn.functional as F

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.ops.attention import gather
from pdserve.ops.kv_quant import round_trip
from pdserve.ops.mla_decode import mla_num_splits, paged_mla_decode
from pdserve.ops.sdpa import chunk_attention, prompt_attention


def absorbed_weights(attn) -> tuple[torch.Tensor, torch.Tensor]:
    """W_UK [heads, qk_nope, rank] and W_UV [heads, v_head_dim, rank]: views of the layer's kv_b_proj
    weight ([heads x (qk_nope + v_head_dim), rank]), no copy."""
    w = attn.kv_b_proj.weight.view(attn.num_heads, attn.qk_nope_head_dim + attn.v_head_dim, attn.kv_lora_rank)
    return w[:, :attn.qk_nope_head_dim], w[:, attn.qk_nope_head_dim:]


def mla_decode(q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
               scale: float, num_splits: int, attn, kv_scales: tuple[float, ...] = (),
               latent_new: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence, absorbed: q [B, heads, qk_nope + qk_rope] -> [B, heads, v_head_dim].
    `attn` is the layer (pdserve.models.mla.MLAttention); latent_new / slot_mapping: the step's
    latents [B, rank + rope], written by the attention launch itself (paged_mla_decode)."""
    w_uk, w_uv = absorbed_weights(attn)
    nope = attn.qk_nope_head_dim
    q_latent = torch.bmm(q[..., :nope].transpose(0, 1), w_uk)  # [heads, B, rank]
    o_latent = q.new_empty(q.shape[1], q.shape[0], attn.kv_lora_rank)  # heads-major: what W_UV's bmm reads
    paged_mla_decode(q_latent.transpose(0, 1), q[..., nope:], kv_layer, block_tables, context_lens, scale,
                     num_splits, out=o_latent.transpose(0, 1), latent_new=latent_new, slot_mapping=slot_mapping,
                     kv_scales=kv_scales)
    return torch.bmm(o_latent, w_uv.transpose(1, 2)).transpose(0, 1)  # [B, heads, v_head_dim]


def mla_mixed(q: torch.Tensor, latent: torch.Tensor, kv_layer: torch.Tensor, kv_scales: tuple[float, ...],
              batch: ForwardBatch, scale: float, attn) -> torch.Tensor:
    """Any step that is not all decode rows, its latents already cached: q [T, heads, qk_nope + qk_rope],
    latent [T, rank + rope] -> [T, heads, v_head_dim]. One-token rows absorbed, in one launch;
    each longer row expanded."""
    out = q.new_empty(q.shape[0], q.shape[1], attn.v_head_dim)
    qlens = batch.query_lens
    rows = [i for i, n in enumerate(qlens) if n == 1]
    if rows:
        dev = q.device
        at = torch.tensor([batch.query_start[i] for i in rows], device=dev)
        sel = torch.tensor(rows, device=dev)
        splits = mla_num_splits(len(rows), attn.num_heads, max(batch.context_lens[i] for i in rows), dev)
        out[at] = mla_decode(q[at], kv_layer, batch.block_tables[sel], batch.context_lens_t[sel], scale, splits,
                             attn, kv_scales)
    for i, n in enumerate(qlens):
        if n > 1:
            a, b = batch.query_start[i], batch.query_start[i + 1]
            out[a:b] = _expanded(q[a:b], _context(latent[a:b], kv_layer, kv_scales, batch, i, q.dtype), scale, attn)
    return out


def _context(own: torch.Tensor, kv_layer: torch.Tensor, kv_scales: tuple[float, ...], batch: ForwardBatch,
             i: int, dtype: torch.dtype) -> torch.Tensor:
    """Sequence i's latents [ctx, rank + rope] as the cache holds them: a fresh prompt's are this
    step's own (`own`, rounded through FP8 for an FP8 cache); otherwise read through its block table."""
    ctx = batch.context_lens[i]
    if own.shape[0] == ctx:
        return round_trip(own, kv_scales[0]) if kv_scales else own
    table = batch.block_tables[i, : -(-ctx // batch.block_size)]
    return gather(kv_layer, table, kv_scales, dtype).flatten(1, 2)[0, :ctx, 0]


def _expanded(q: torch.Tensor, entries: torch.Tensor, scale: float, attn) -> torch.Tensor:
    """q [n, heads, qk] (the context's last n positions) over the latents entries [ctx, rank + rope],
    up-projected -> [n, heads, v_head_dim]."""
    k, v = attn.expand_latent(entries[None, :, None])  # [ctx, heads, qk], [ctx, heads, v]
    if q.shape[0] == k.shape[0]:
        # A fresh prompt (causal from the top left): SDPA takes V at its own width there (cuDNN on
        # Hopper), faster than with V padded to the q/k width.
        return prompt_attention(q, k.to(q.dtype), v.to(q.dtype), scale)
    width = max(q.shape[-1], v.shape[-1])  # flash attention takes one head width for q, k and v

    def widened(t: torch.Tensor) -> torch.Tensor:  # zero columns: scores and values unchanged
        t = t.to(q.dtype)
        return F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t

    return chunk_attention(widened(q), widened(k), widened(v), scale)[..., :attn.v_head_dim]
