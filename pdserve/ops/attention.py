"""Paged attention, torch reference: writes this step's KV into the cache, then attends over it.

It is the CPU path and the oracle for the GPU kernels. Decode rows (one query token) are batched
into one padded SDPA call; prefill chunks run one sequence at a time with a causal mask offset by
the cached prefix.
"""

import torch
import torch.nn.functional as F

from pdserve.engine.forward_batch import ForwardBatch


def write_kv(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter k, v [num_tokens, kv_heads, head_dim] into kv_layer [2, blocks, block_size, kv_heads, head_dim]."""
    flat = kv_layer.flatten(1, 2)  # [2, blocks * block_size, kv_heads, head_dim], a view
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


class TorchAttention:
    """Reference attention backend."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                batch: ForwardBatch, scale: float) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads, D]."""
        kv_layer = batch.kv_cache[layer]
        write_kv(kv_layer, k, v, batch.slot_mapping)
        out = torch.empty_like(q)
        qlens = batch.query_lens
        decode_rows = [i for i, n in enumerate(qlens) if n == 1]
        if decode_rows:
            self._decode(q, kv_layer, batch, decode_rows, scale, out)
        for i, n in enumerate(qlens):
            if n > 1:
                self._prefill(q, kv_layer, batch, i, scale, out)
        return out

    def _decode(self, q, kv_layer, batch, rows, scale, out) -> None:
        bs = batch.block_size
        ctx = [batch.context_lens[i] for i in rows]
        max_blocks = (max(ctx) + bs - 1) // bs
        tables = batch.block_tables[rows, :max_blocks]  # [B, max_blocks]
        idx = torch.tensor([batch.query_start[i] for i in rows], device=q.device)
        keys = kv_layer[0][tables].flatten(1, 2)  # [B, max_blocks * bs, kv_heads, D]
        values = kv_layer[1][tables].flatten(1, 2)
        lens = torch.tensor(ctx, device=q.device)
        mask = torch.arange(keys.shape[1], device=q.device)[None, :] < lens[:, None]  # [B, L]
        o = F.scaled_dot_product_attention(
            q[idx].unsqueeze(2).to(keys.dtype),  # [B, heads, 1, D]
            keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        out[idx] = o.squeeze(2).to(out.dtype)

    def _prefill(self, q, kv_layer, batch, i, scale, out) -> None:
        bs = batch.block_size
        start, end = batch.query_start[i], batch.query_start[i + 1]
        n, ctx = end - start, batch.context_lens[i]
        table = batch.block_tables[i, : (ctx + bs - 1) // bs]
        keys = kv_layer[0][table].flatten(0, 1)[:ctx]  # [ctx, kv_heads, D]
        values = kv_layer[1][table].flatten(0, 1)[:ctx]
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
