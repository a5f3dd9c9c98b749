"""RMSNorm and RoPE, torch reference: what transformers computes, op for op.

A norms backend serves three calls of every decoder layer: RMSNorm, RMSNorm after the residual add
(the sum is also returned: it is the next residual), and RoPE on q and k (after Qwen3's per-head
q/k RMSNorm when the model has one). `TritonNorms` (triton_norms.py) has the same interface with
one kernel per call; this reference keeps transformers' op order and float32 islands, so logits
match HF bit for bit in float32.
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
