"""Multi-head Latent Attention (DeepSeek-V2/V3) over a latent KV cache.

Per token the layer caches one vector: the normalised KV latent c_kv (kv_lora_rank wide) followed
by the rotated key every head shares (qk_rope_head_dim) — `KVLayout` kind "latent". Keys and
values are never cached: attention up-projects them from the latents through kv_b_proj
(`expand_latent`), per head k = [W_uk c, k_rope] and v = W_uv c. Queries come straight from the
hidden state (q_proj; V2-Lite) or through a rank-q_lora_rank bottleneck with its own RMSNorm
(q_a_proj, q_a_layernorm, q_b_proj; V2, V3). The parameter names are transformers'.

The attention itself is the backend's `forward_mla`: the reference (pdserve/ops/attention.py)
up-projects the context's latents every step; the Triton backend (pdserve/ops/mla_attention.py)
absorbs kv_b_proj into the query and the output for decode rows and attends over the latents. A
backend without `supports_mla` is refused when the model is built.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.models.args import ModelArgs
from pdserve.models.layers import RMSNorm
from pdserve.models.tensor_parallel import TensorParallel, row_parallel, shard_linear_in, shard_linear_out
from pdserve.ops.norms import TorchNorms

# transformers builds the two latent norms with RMSNorm's default eps, not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(args: ModelArgs) -> float:
    """qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where the rope scaling has
    an mscale_all_dim (DeepSeek: the attention logits grow with the context extension)."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    s = args.rope_scaling or {}
    m_all = s.get("mscale_all_dim")
    if s and m_all:
        factor = s["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class MLAttention(nn.Module):
    """Multi-head Latent Attention; the backend writes this step's latents and attends."""

    def __init__(self, args: ModelArgs, layer_idx: int, backend, norms):
        super().__init__()
        if not getattr(backend, "supports_mla", False):
            raise ValueError(
                f"{args.architecture} uses Multi-head Latent Attention over a latent KV cache, which the "
                f"attention backend {type(backend).__name__} cannot compute; use attention_backend "
                f"'torch' or 'triton'")
        self.layer_idx, self.backend = layer_idx, backend
        self.norms = norms or TorchNorms()  # RoPE and the cache entry (`mla_rope`); one kernel on the GPU
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = args.num_heads, args.q_lora_rank, args.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_head_dim, self.rope_interleave = args.v_head_dim, args.rope_interleave
        self.scale = mla_softmax_scale(args)
        h, heads, qk = args.hidden_size, args.num_heads, args.qk_nope_head_dim + args.qk_rope_head_dim
        bias = args.attention_bias
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(h, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(args.q_lora_rank, _LATENT_NORM_EPS, norms)
            self.q_b_proj = nn.Linear(args.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, args.kv_lora_rank + args.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(args.kv_lora_rank, _LATENT_NORM_EPS, norms)
        self.kv_b_proj = nn.Linear(args.kv_lora_rank, heads * (args.qk_nope_head_dim + args.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * args.v_head_dim, h, bias=bias)
        self.q_kv_a = None  # (weight, bias) of the two projections of x stacked, once `fuse_qkv` ran
        self.tp: TensorParallel | None = None

    def shard_tp(self, tp: TensorParallel) -> None:
        """Keep this rank's heads of the up-projections (q or q_b, kv_b) and o_proj's columns; the
        down-projections to the latents and the latent cache are whole on every rank."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        shard_linear_out(self.q_proj if self.q_proj is not None else self.q_b_proj, tp.block(self.num_heads, qk))
        shard_linear_out(self.kv_b_proj, tp.block(self.num_heads, self.qk_nope_head_dim + self.v_head_dim))
        shard_linear_in(self.o_proj, tp.block(self.num_heads, self.v_head_dim))
        self.num_heads, self.tp = self.num_heads // tp.size, tp

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Stack the two projections of the hidden state — to the queries (q_proj, or q_a_proj into
        the q bottleneck) and to the latent with the shared rope key (kv_a_proj_with_mqa) — into one
        weight (and bias) and make the parameters views of it: one GEMM instead of two. Call once
        the weights are loaded; only the GPU path does (TritonAttention.fuse_qkv), as
        Attention.fuse_qkv."""
        projs = (self.q_proj if self.q_proj is not None else self.q_a_proj, self.kv_a_proj_with_mqa)
        weight = torch.cat([m.weight for m in projs])
        bias = None
        if any(m.bias is not None for m in projs):  # V3 biases q_a and kv_a; V2-Lite's q_proj has none
            bias = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in projs])
        row = 0
        for m in projs:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
            row += n
        self.q_kv_a = (weight, bias)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, heads x (qk_nope + qk_rope)], kv_a [T, kv_lora_rank + qk_rope] (views
        of one GEMM's output once fused)."""
        if self.q_kv_a is None:
            q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            return q, self.kv_a_proj_with_mqa(x)
        kv_width = self.kv_lora_rank + self.qk_rope_head_dim
        q, kv_a = self.backend.linear(x, *self.q_kv_a).split([self.q_kv_a[0].shape[0] - kv_width, kv_width], -1)
        if self.q_proj is None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q, kv_a

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `rope`: cos, sin [T, 1, qk_rope_head_dim]. Calls
        batch.layer_done(layer) once the layer's latents are cached."""
        t = x.shape[0]
        q, kv_a = self._project(x)
        c_kv, k_rope = kv_a.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        # q [T, heads, qk_nope + qk_rope] with its rope part rotated; latent [T, kv_lora_rank +
        # qk_rope_head_dim], the cache entry: the normalised c_kv, then the rotated shared key.
        q, latent = self.norms.mla_rope(q.view(t, self.num_heads, -1), self.kv_a_layernorm(c_kv), k_rope, rope,
                                        self.rope_interleave)
        o = self.backend.forward_mla(self.layer_idx, q, latent, batch, self.scale, self)  # [T, heads, v_head_dim]
        if batch.layer_done is not None:
            batch.layer_done(self.layer_idx)
        return row_parallel(self.o_proj, o.flatten(1), self.tp, self.backend.linear)

    def expand_latent(self, entries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache entries [1, ..., L, 1, kv_lora_rank + qk_rope_head_dim] -> keys [..., L, heads,
        qk_nope + qk_rope] and values [..., L, heads, v_head_dim]: the latent up-projected by
        kv_b_proj (one GEMM, as transformers computes it), the shared rope key beside every head's."""
        latent = entries[0, ..., 0, :]
        c_kv, k_rope = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        kv = F.linear(c_kv.to(self.kv_b_proj.weight.dtype), self.kv_b_proj.weight)
        kv = kv.view(*kv.shape[:-1], self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], -1)
        # Two copies into one buffer, not torch.cat of the broadcast rope key: cat's batched-copy
        # kernel is slow on a long prompt, and runs in every layer.
        k = k_nope.new_empty(*k_nope.shape[:-1], self.qk_nope_head_dim + self.qk_rope_head_dim)
        k[..., : self.qk_nope_head_dim] = k_nope
        k[..., self.qk_nope_head_dim:] = k_rope.unsqueeze(-2)  # the shared rope key, beside every head's
        return k, v
