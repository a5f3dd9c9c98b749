"""Norms backend for CUDA: one Triton launch per call where the reference takes 6 to 15 torch ops.

Per decoder layer the reference's ~35 small ops become 3 launches: on a decode step replayed from
a CUDA graph each tiny kernel still costs its microseconds on the GPU, and on an eager prefill step
each costs its launch on the host. RoPE reads the float32 cos/sin tables by position inside the
kernel, so there is no per-step table lookup either. Same interface as `norms.TorchNorms`.
"""

import torch

from pdserve.ops.mla_rope import mla_rope
from pdserve.ops.rms_norm import fused_add_rms_norm, rms_norm
from pdserve.ops.rotary import qk_norm_rope


class TritonNorms:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), in one pass."""
        return fused_add_rms_norm(x, residual, weight, eps)

    def rope_inputs(self, rotary, positions: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel looks the tables up itself: positions [T], cos and sin [max_positions, D] float32."""
        return positions, rotary.cos, rotary.sin

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, rope, q_weight: torch.Tensor | None,
                     k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        positions, cos, sin = rope
        return qk_norm_rope(q, k, positions, cos, sin, q_weight, k_weight, eps)

    def mla_rope(self, q: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, rope, interleave: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Multi-head Latent Attention's RoPE and cache entry in one launch (`mla_rope.py`); `rope`:
        cos, sin [T, 1, qk_rope] (DeepSeek's models look them up once per forward themselves)."""
        cos, sin = rope
        return mla_rope(q, c_kv, k_rope, cos, sin, interleave)
