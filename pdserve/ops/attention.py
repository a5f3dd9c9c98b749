"""Paged attention, torch reference: writes this step's KV into the cache, then attends over it.

It is the CPU path and the oracle for the GPU kernels. Decode rows (one query token) are batched
into one padded SDPA call; prefill chunks run one sequence at a time with a causal mask offset by
the cached prefix.

Two kinds of cache (pdserve.forward.kv_cache): K/V planes (MHA, GQA: `forward`), and MLA's latent
plane (`forward_mla`, DeepSeek-V2/V3). Both gather the context's cache entries the same way; an
`expand` function turns them into keys and values — for K/V the planes themselves, for a latent
the up-projection through the layer's kv_b_proj.

An FP8 cache (`ForwardBatch.kv_scales` given) is written quantized (`kv_quant.quantize`, each
plane through its layer's scale) and dequantized as it is gathered, so attention — prefill chunks
and decode rows alike, this step's tokens included — always computes over what the cache holds.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.forward.kv_cache import FP8
from pdserve.ops.kv_quant import dequantize_planes, quantize

# entries [planes, ..., L, heads, dim] gathered from the cache -> keys [..., L, h, Dk], values [..., L, h, Dv]
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _stored(kv_layer: torch.Tensor, x: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache, x) as index_copy_ takes them: x in the cache's dtype; an FP8 cache and x
    quantized through `scale`, both seen as bytes (index_copy_ has no float8 kernel)."""
    if kv_layer.dtype != FP8:
        return kv_layer, x.to(kv_layer.dtype)
    return kv_layer.view(torch.uint8), quantize(x, scale).view(torch.uint8)


def _kept(slot_mapping: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(slot_mapping, *rows) without the rows whose slot is negative: padding that writes nowhere
    (a CUDA-graph batch's padded rows), as the Triton write kernels skip them."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return (slot_mapping, *rows)
    return (slot_mapping[keep], *(r[keep] for r in rows))


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             scales: tuple[float, ...] = ()) -> None:
    """Scatter k, v [num_tokens, kv_heads, head_dim] into kv_layer [2, blocks, block_size, kv_heads, head_dim]
    (FP8: quantized through scales = (k_scale, v_scale)); a row whose slot is -1 is not written."""
    slot_mapping, k, v = _kept(slot_mapping, k, v)
    k_scale, v_scale = scales or (None, None)
    cache, k = _stored(kv_layer, k, k_scale)
    _, v = _stored(kv_layer, v, v_scale)
    flat = cache.flatten(1, 2)  # [2, blocks * block_size, kv_heads, head_dim], a view
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def write_latent(kv_layer: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor,
                 scales: tuple[float, ...] = ()) -> None:
    """Scatter latent [num_tokens, dim] into kv_layer [1, blocks, block_size, 1, dim] (MLA; FP8:
    quantized through scales = (latent_scale,)); a row whose slot is -1 is not written."""
    slot_mapping, latent = _kept(slot_mapping, latent)
    cache, latent = _stored(kv_layer, latent, scales[0] if scales else None)
    flat = cache.flatten(1, 2)  # [1, blocks * block_size, 1, dim], a view
    flat[0, :, 0].index_copy_(0, slot_mapping, latent)


def gather(kv_layer: torch.Tensor, blocks: torch.Tensor, scales: tuple[float, ...], dtype: torch.dtype
           ) -> torch.Tensor:
    """kv_layer[:, blocks] -> [planes, *blocks.shape, block_size, heads, dim]; from an FP8 cache
    dequantized to `dtype` (each plane through its scale), otherwise as stored."""
    if kv_layer.dtype != FP8:
        return kv_layer[:, blocks]
    raw = kv_layer.view(torch.uint8)[:, blocks].view(FP8)  # gathered as bytes: every device indexes uint8
    return dequantize_planes(raw, scales, dtype)


def _planes(entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return entries[0], entries[1]


class TorchAttention:
    """Reference attention backend."""

    # It computes Multi-head Latent Attention (`forward_mla`), as the Triton backend does.
    supports_mla = True
    # The layers' dense projections (fused q/k/v, o; MLA's fused q + kv_a, o): transformers' own op.
    linear = staticmethod(F.linear)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads, D]."""
        kv_layer, scales = batch.kv_cache[layer], batch.layer_scales(layer)
        write_kv(kv_layer, k, v, batch.slot_mapping, scales)
        return self._attend(q, kv_layer, scales, batch, scale, v.shape[-1], _planes)

    def forward_mla(self, layer: int, q: torch.Tensor, latent: torch.Tensor, batch: ForwardBatch,
                    scale: float, attn) -> torch.Tensor:
        """Multi-head Latent Attention. q [T, heads, qk_nope + qk_rope] (rope part rotated),
        latent [T, kv_lora_rank + qk_rope] (normalised c_kv, then the rotated shared key) ->
        [T, heads, v_head_dim]. `attn` is the layer (pdserve.models.mla.MLAttention): its
        `expand_latent` up-projects cached latents to keys and values.

        The straightforward form, not the absorbed one: every step up-projects the whole context's
        latents (K and V per head, as transformers does) and runs ordinary attention over them.
        Exact against the reference, and cheap enough on the CPU; the GPU backend folds kv_b_proj
        into q and the output for decode rows instead (attention over the latent itself,
        pdserve.ops.mla_attention)."""
        kv_layer, scales = batch.kv_cache[layer], batch.layer_scales(layer)
        write_latent(kv_layer, latent, batch.slot_mapping, scales)
        return self._attend(q, kv_layer, scales, batch, scale, attn.v_head_dim, attn.expand_latent)

    def _attend(self, q: torch.Tensor, kv_layer: torch.Tensor, scales: tuple[float, ...], batch: ForwardBatch,
                scale: float, value_dim: int, expand: Expand) -> torch.Tensor:
        out = q.new_empty(*q.shape[:2], value_dim)
        qlens, ctx = batch.query_lens, batch.context_lens
        decode_rows = [i for i, n in enumerate(qlens) if n == 1 and ctx[i]]
        if decode_rows:
            self._decode(q, kv_layer, scales, batch, decode_rows, scale, out, expand)
        for i, n in enumerate(qlens):
            if n and not ctx[i]:  # no context (a padded batch's padding rows): attends to nothing
                out[batch.query_start[i]:batch.query_start[i + 1]] = 0
            elif n > 1:
                self._prefill(q, kv_layer, scales, batch, i, scale, out, expand)
        return out

    def _decode(self, q, kv_layer, scales, batch, rows, scale, out, expand: Expand) -> None:
        bs = batch.block_size
        ctx = [batch.context_lens[i] for i in rows]
        max_blocks = (max(ctx) + bs - 1) // bs
        tables = batch.block_tables[rows, :max_blocks]  # [B, max_blocks]
        idx = torch.tensor([batch.query_start[i] for i in rows], device=q.device)
        keys, values = expand(gather(kv_layer, tables, scales, q.dtype).flatten(2, 3))  # [B, max_blocks * bs, kv_heads, D]
        lens = torch.tensor(ctx, device=q.device)
        mask = torch.arange(keys.shape[1], device=q.device)[None, :] < lens[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(
            q[idx].unsqueeze(2).to(keys.dtype),  # [B, heads, 1, D]
            keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out[idx] = o.squeeze(2).to(out.dtype)

    def _prefill(self, q, kv_layer, scales, batch, i, scale, out, expand: Expand) -> None:
        bs = batch.block_size
        start, end = batch.query_start[i], batch.query_start[i + 1]
        n, ctx = end - start, batch.context_lens[i]
        table = batch.block_tables[i, : (ctx + bs - 1) // bs]
        keys, values = expand(gather(kv_layer, table, scales, q.dtype).flatten(1, 2)[:, :ctx])  # [ctx, kv_heads, D]
        qi = q[start:end].transpose(0, 1).unsqueeze(0).to(keys.dtype)  # [1, heads, n, D]
        ki = keys.transpose(0, 1).unsqueeze(0)
        vi = values.transpose(0, 1).unsqueeze(0)
        if ctx == n:
            o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query j sits at absolute position ctx - n + j and sees keys up to and including it.
            qpos = torch.arange(ctx - n, ctx, device=q.device)
            mask = torch.arange(ctx, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
