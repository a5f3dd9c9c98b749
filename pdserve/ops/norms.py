"""RMSNorm and RoPE, torch reference: what transformers computes, op for op.

A norms backend serves three calls of every decoder layer: RMSNorm, RMSNorm after the residual add
(the sum is also returned: it is the next residual), and RoPE on q and k (after Qwen3's per-head
q/k RMSNorm when the model has one; for Multi-head Latent Attention, RoPE on q's and the shared
key's rope parts, which also assembles the cache entry: `mla_rope`). `TritonNorms`
(triton_norms.py) has the same interface with one kernel per call; this reference keeps
transformers' op order and float32 islands, so logits match HF bit for bit in float32.
"""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., dim] -> [..., dim]; normalised in float32, scaled in x's dtype as HF does."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D] -> [T, heads, D] (NeoX layout: halves, not pairs)."""
    return x * cos + _rotate_half(x) * sin


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek lays them out; x [T, h, r],
    cos/sin [T, 1, r] in the usual cat(freqs, freqs) form. The result is de-interleaved (the
    rotated even elements, then the odd ones), as transformers' V3 returns it: q and k are
    permuted alike, so their dot product is the same. Computed in cos's dtype (float32 for V2,
    whose transformers code rotates in complex64)."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    xf = x.to(cos.dtype)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


class TorchNorms:
    """The reference: a handful of torch ops per call."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual)."""
        summed = x + residual
        return rms_norm(summed, weight, eps), summed

    def rope_inputs(self, rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """What `qk_norm_rope` reads, computed once per forward: cos, sin [T, 1, D] in `dtype`."""
        return rotary(positions, dtype)

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, rope, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, heads, D], k [T, kv_heads, D] -> rotated q, k; each head RMS-normalised first
        when the weights [D] are given."""
        if q_weight is not None:
            q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
        cos, sin = rope
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def mla_rope(self, q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, rope, interleave: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-head Latent Attention (DeepSeek): q [T, heads, qk_nope + qk_rope] -> q with its rope
        part rotated; c_kv [T, kv_lora_rank] (normalised) and k_rope [T, qk_rope] -> the cache entry
        [T, kv_lora_rank + qk_rope]: c_kv, then k_rope rotated. `rope`: cos, sin [T, 1, qk_rope];
        interleave: pairs (`rotate_pairs`) rather than halves."""
        cos, sin = rope

        def rotate(x: torch.Tensor) -> torch.Tensor:
            return rotate_pairs(x, cos, sin) if interleave else apply_rotary(x, cos.to(x.dtype), sin.to(x.dtype))

        q_nope, q_rope = q.split([q.shape[-1] - k_rope.shape[-1], k_rope.shape[-1]], -1)
        return (torch.cat([q_nope, rotate(q_rope)], dim=-1),
                torch.cat([c_kv, rotate(k_rope.unsqueeze(1))[:, 0]], dim=-1))
