"""Building blocks shared by every model family: norm, RoPE, attention, dense and sparse MLPs.

Each block computes exactly what transformers' modeling code computes (same op order, same
float32 islands), so that logits match the HF reference bit-for-bit in float32 and closely in bf16.
"""

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.models.args import ModelArgs
from pdserve.models.tensor_parallel import (TensorParallel, row_parallel, shard_linear_in, shard_linear_out,
                                            shard_param)
from pdserve.ops.norms import TorchNorms


class RMSNorm(nn.Module):
    """RMSNorm through a norms backend (`TorchNorms` unless given); with a residual, the residual
    add before it is fused in and the sum returned beside the output: it is the next residual."""

    def __init__(self, dim: int, eps: float, kernels=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = kernels or TorchNorms()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., dim] -> [..., dim]; with `residual`: (norm(x + residual), x + residual)."""
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] float32 on the CPU, and the cos/sin scale, as transformers has them."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exps)
    rope_type = scaling["rope_type"] if scaling else "default"
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    assert rope_type == "yarn", rope_type
    return _yarn_inv_freq(head_dim, theta, scaling)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between smoothed.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    factor, old_len = s["factor"], s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # avoid a division by zero in the ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attn_factor


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, float32, looked up by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self.register_buffer("cos", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim, dtype=torch.float32), persistent=False)
        self.build_cache()

    @torch.no_grad()
    def build_cache(self) -> None:
        """Fill the tables; call again after `to_empty` (a model built on the meta device)."""
        if self.cos.is_meta:
            return
        # Computed on the CPU whatever the target device, so that every engine (prefill on one
        # GPU, decode on another or on the CPU) rotates keys identically.
        inv_freq, scale = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = t[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_positions, head_dim]
        self.cos.copy_(emb.cos() * scale)
        self.sin.copy_(emb.sin() * scale)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, head_dim] in `dtype`, ready to broadcast over heads."""
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)


class Attention(nn.Module):
    """Self-attention over the paged KV cache; the backend writes this step's K/V and attends."""

    def __init__(self, args: ModelArgs, layer_idx: int, backend, norms):
        super().__init__()
        self.layer_idx = layer_idx
        self.norms = norms  # q/k norm and RoPE
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.scale = args.head_dim ** -0.5
        self.backend = backend
        h, q_dim, kv_dim = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = nn.Linear(h, q_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(h, kv_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(h, kv_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=args.o_proj_bias)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps) if args.qk_norm else None
        self.qkv = None  # (weight, bias) of the three projections stacked, once `fuse_qkv` ran
        self.tp: TensorParallel | None = None

    def shard_tp(self, tp: TensorParallel) -> None:
        """Keep this rank's query heads and the KV heads they read; o_proj becomes row-parallel."""
        d = self.head_dim
        kv = tp.kv_heads(self.num_heads, self.num_kv_heads)
        shard_linear_out(self.q_proj, tp.block(self.num_heads, d))
        kv_rows = torch.arange(kv.start * d, kv.stop * d)
        shard_linear_out(self.k_proj, kv_rows)
        shard_linear_out(self.v_proj, kv_rows)
        shard_linear_in(self.o_proj, tp.block(self.num_heads, d))
        self.num_heads, self.num_kv_heads, self.tp = self.num_heads // tp.size, len(kv), tp

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Stack q_proj, k_proj and v_proj into one weight (and bias), and make the three parameters
        views of it: one GEMM per step instead of three, no second copy. Call once the weights are
        loaded. Only the GPU path does (TritonAttention.fuse_qkv): on the CPU reference a wider
        GEMM may sum in another order than transformers' three."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        weight = torch.cat([m.weight for m in projs])
        bias = torch.cat([m.bias for m in projs]) if self.q_proj.bias is not None else None
        row = 0
        for m in projs:
            n = m.weight.shape[0]
            m.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
            row += n
        self.qkv = (weight, bias)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> q [T, heads, D], k and v [T, kv_heads, D] (views of one GEMM's output once fused)."""
        t, d = x.shape[0], self.head_dim
        if self.qkv is None:
            return (self.q_proj(x).view(t, self.num_heads, d), self.k_proj(x).view(t, self.num_kv_heads, d),
                    self.v_proj(x).view(t, self.num_kv_heads, d))
        q_dim, kv_dim = self.num_heads * d, self.num_kv_heads * d
        q, k, v = self.backend.linear(x, *self.qkv).split([q_dim, kv_dim, kv_dim], dim=-1)
        return q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `rope` from the norms backend's `rope_inputs`. Calls
        batch.layer_done(layer) once the layer's KV is cached."""
        q, k, v = self.project(x)
        qk_norm = self.q_norm is not None  # Qwen3 normalises each head before RoPE
        q, k = self.norms.qk_norm_rope(q, k, rope, self.q_norm.weight if qk_norm else None,
                                       self.k_norm.weight if qk_norm else None,
                                       self.q_norm.eps if qk_norm else 0.0)
        o = self.backend.forward(self.layer_idx, q, k, v, batch, self.scale)  # [T, heads, D]
        if batch.layer_done is not None:
            batch.layer_done(self.layer_idx)
        return row_parallel(self.o_proj, o.flatten(1), self.tp, self.backend.linear)


class GatedMLP(nn.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.tp: TensorParallel | None = None

    def shard_tp(self, tp: TensorParallel) -> None:
        """Keep this rank's share of the intermediate width: gate/up rows, down columns."""
        rows = tp.block(self.gate_proj.out_features)
        shard_linear_out(self.gate_proj, rows)
        shard_linear_out(self.up_proj, rows)
        shard_linear_in(self.down_proj, rows)
        self.tp = tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (the whole of it with one rank): before the all-reduce."""
        return F.linear(F.silu(self.gate_proj(x)) * self.up_proj(x), self.down_proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        if self.tp is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.tp.all_reduce(self.partial(x).contiguous())


class RouterGate(nn.Linear):
    """The MoE router's linear layer, its logits computed by the MoE backend (on a GPU, a GEMV for a
    decode step's few tokens: pdserve.ops.routing.router_gemv). Still called as a module, so forward
    hooks on `*.mlp.gate` see every routing (bench_engine counts the experts hit with them)."""

    def __init__(self, in_features: int, num_experts: int, backend):
        super().__init__(in_features, num_experts, bias=False)
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.router_logits(x, self.weight)


class SparseMoE(nn.Module):
    """Routed SwiGLU experts, optionally plus a shared expert: sigmoid-gated (Qwen2-MoE) or not
    (DeepSeek, whose `route` is its own: pdserve.models.deepseek).

    The experts' weights are stored fused, the layout the MoE backends take: w13 [E, 2I, H]
    (gate rows then up rows) and w2 [E, H, I].
    """

    def __init__(self, args: ModelArgs, backend, renormalize: bool):
        super().__init__()
        e, h, i = args.num_experts, args.hidden_size, args.moe_intermediate_size
        self.top_k, self.renormalize, self.backend = args.num_experts_per_tok, renormalize, backend
        self.num_experts = e
        self.experts: list[int] = list(range(e))  # global id of the expert in each slot of w13 / w2
        self.exchange = None  # an EPExchange when the experts are sharded over ranks
        self.tp: TensorParallel | None = None
        # While a padded prefill step runs (engine/prefill_graphs.py): 1 for its rows that hold tokens,
        # 0 for the bucket's padding, which no expert computes.
        self.row_valid: torch.Tensor | None = None
        self.gate = RouterGate(h, e, backend)  # the router
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.shared_expert = self.shared_expert_gate = None
        # Shared experts folded into w13 / w2 as the slots after the routed ones (DeepseekMoE's
        # fold_shared_experts): the router appends them to every token's top-k.
        self.num_shared_slots = 0
        if args.shared_expert_intermediate_size:
            self.shared_expert = GatedMLP(h, args.shared_expert_intermediate_size)
            if args.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def hold_experts(self, experts: list[int]) -> None:
        """Keep only these experts' weights (expert parallel); call before the weights are allocated."""
        assert self.w13.is_meta, "hold_experts() resizes parameters: call it on a model built on the meta device"
        self.experts = list(experts)
        self.w13 = nn.Parameter(self.w13.new_empty(len(experts), *self.w13.shape[1:]))
        self.w2 = nn.Parameter(self.w2.new_empty(len(experts), *self.w2.shape[1:]))

    def shard_tp(self, tp: TensorParallel) -> None:
        """Every expert keeps this rank's share of its intermediate width (w13: that share of the
        gate rows and of the up rows; w2: those columns), the shared expert too; the router is
        whole. One all-reduce sums routed and shared partial outputs."""
        inter = self.w2.shape[2]
        rows = tp.block(inter)
        shard_param(self, "w13", 1, torch.cat([rows, rows + inter]))
        shard_param(self, "w2", 2, rows)
        if self.shared_expert is not None:
            self.shared_expert.shard_tp(tp)
        self.tp = tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> weights [T, k] float32, expert ids [T, k]: softmax, top-k, renormalised
        where the family says (the backend's kernel on the GPU)."""
        return self.backend.route(self.gate(x), self.top_k, self.renormalize)

    def skip_padding(self, ids: torch.Tensor) -> torch.Tensor:
        """A padded step's padding rows take no expert: their pairs get the skip id (one past the
        last slot), which every MoE backend leaves out. (Identical padding rows of a `varlen` graph
        all routed to the same experts and made a 16-token step's experts 2.6x slower on an H200.)"""
        if self.row_valid is None:
            return ids
        return ids.masked_fill(self.row_valid[:, None] == 0, self.w13.shape[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        weights, ids = self.route(x)
        ids = self.skip_padding(ids)
        if self.exchange is None:
            out = self.backend.forward(x, self.w13, self.w2, weights, ids)
        else:  # the other experts live on other ranks
            out = self.exchange.forward(x, self.w13, self.w2, weights, ids, self.backend)
        if self.shared_expert is not None:
            # Partial with tensor parallelism: the gate scales it linearly, so one all-reduce below suffices.
            shared = self.shared_expert(x) if self.tp is None else self.shared_expert.partial(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out if self.tp is None else self.tp.all_reduce(out.contiguous())
