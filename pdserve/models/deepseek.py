"""DeepSeek-V2 / V2-Lite / V3: Multi-head Latent Attention (pdserve.models.mla) over a latent KV
cache, dense first layers (first_k_dense_replace), then routed experts beside ungated shared
experts, routed by grouped top-k (V2: softmax, greedy or group_limited_greedy; V3: sigmoid,
noaux_tc with the learned e_score_correction_bias), weights times routed_scaling_factor. YaRN RoPE
on the rope part of q and of the shared key, with mscale in the softmax scale.
"""

import os
import re

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.models.args import ModelArgs
from pdserve.models.decoder import DecoderLayer, DecoderLM
from pdserve.models import deepseek_mtp
from pdserve.models.layers import GatedMLP, SparseMoE
from pdserve.models.mla import MLAttention

_LAYER = re.compile(r"layers\.(\d+)\.")
# From this many tokens on, as long as the batch takes the fused-MoE kernel, folded shared experts run
# apart from the routed ones, as dense GEMMs over every token: in the fused kernel each tile of
# BLOCK_M rows reads the shared weights again (at a decode batch of 256, 16 reads of 35 MB a layer
# for DeepSeek-V2-Lite, half again the routed experts' own traffic). Below it the fold saves the
# launches; from the grouped-GEMM size on the shared slots are two full groups there, and apart's
# extra passes cost more (docs/benchmarks-history.md, DeepSeek-V2-Lite, 2026-11-24). (Env: to
# measure both ways.)
SHARED_APART_TOKENS = int(os.environ.get("PDSERVE_SHARED_APART_TOKENS", "128"))
# Hub and transformers names -> ours: the block's shared experts are one MLP `shared_expert` (as
# Qwen2-MoE's, without its gate), the router's bias lives beside the experts.
_RENAMES = [
    (re.compile(r"\.mlp\.shared_experts\."), ".mlp.shared_expert."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.e_score_correction_bias"),
]


class DeepseekMoE(SparseMoE):
    """Routed experts (the MoE backends') plus the shared experts, routed as DeepSeek does."""

    def __init__(self, args: ModelArgs, backend):
        super().__init__(args, backend, renormalize=args.norm_topk_prob)
        self.scoring, self.topk_method = args.scoring_func, args.topk_method
        self.n_group, self.topk_group = args.n_group, args.topk_group
        self.routed_scaling_factor = args.routed_scaling_factor
        self.e_score_correction_bias = None
        if args.topk_method == "noaux_tc":  # float32 whatever the model's dtype, as transformers keeps it
            self.e_score_correction_bias = nn.Parameter(torch.zeros(args.num_experts, dtype=torch.float32))
        self.gate_weight_f32: torch.Tensor | None = None  # the router's weight in float32, once folded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.num_shared_slots
        path = getattr(self.backend, "path", None)  # (the GPU backend's kernel choice for this size)
        if (not n or self.exchange is not None or x.shape[0] < SHARED_APART_TOKENS
                or path is not None and path(x.shape[0], x.dtype) != "fused"):
            return super().forward(x)
        weights, ids = self.route(x, shared=False)
        out = self.backend.forward(x, self.w13, self.w2, weights, self.skip_padding(ids))
        # The shared slots (w13 [n, 2I, H], w2 [n, H, I] after the routed ones), each weight read once:
        # their gate/up rows are one [n x 2I, H] matrix, so one GEMM; SiLU-and-mul in one pass; each
        # slot's down projection accumulated into `out` by its GEMM (beta = 1). Before: batched GEMMs,
        # float32 elementwise passes and a sum over the slots, several times the floor of a layer.
        e = self.w13.shape[0] - n
        t, hidden, inter = x.shape[0], self.w2.shape[1], self.w2.shape[2]
        gate_up = torch.mm(x, self.w13[e:].reshape(n * 2 * inter, hidden).t())  # [T, n x 2I]
        if x.is_cuda:
            from pdserve.ops.activation import silu_and_mul  # (Triton: the GPU path only)

            act = silu_and_mul(gate_up.view(t * n, 2 * inter)).view(t, n * inter)
        else:
            g = gate_up.view(t, n, 2, inter)
            act = (F.silu(g[:, :, 0].float()) * g[:, :, 1].float()).to(x.dtype).view(t, n * inter)
        for j in range(n):
            out.addmm_(act[:, j * inter:(j + 1) * inter], self.w2[e + j].t())
        return out if self.tp is None else self.tp.all_reduce(out.contiguous())

    def route(self, x: torch.Tensor, shared: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> weights, ids [T, k (+ the shared slots, once folded, unless not `shared`)]."""
        # The router's logits in float32 from float32 inputs, as transformers computes them.
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and self.gate.weight.dtype == x.dtype:
            # Products of 16-bit floats are exact in float32, so a GEMM that accumulates and writes
            # float32 gives those logits (up to summation order) without converting x first: the
            # conversion and a float32 SIMT GEMM were a visible part of a long prompt's step. (A
            # decode step's few tokens: the backend's GEMV, in the chain of PDL launches.)
            logits = self.backend.router_logits(x, self.gate.weight, out_dtype=torch.float32)
        else:
            w = self.gate.weight.float() if self.gate_weight_f32 is None else self.gate_weight_f32
            logits = F.linear(x.float(), w)
        return self.backend.grouped_route(logits, self.top_k, num_shared=self.num_shared_slots if shared else 0,
                                          scoring=self.scoring, method=self.topk_method,
                                          n_group=self.n_group, topk_group=self.topk_group,
                                          correction_bias=self.e_score_correction_bias,
                                          renormalize=self.renormalize, scaling=self.routed_scaling_factor)

    @torch.no_grad()
    def fold_shared_experts(self) -> None:
        """The shared experts become expert slots after the routed ones, which every token takes at
        weight 1: the routed experts' one fused call computes them too (no GEMMs, activation and
        add of their own). Call once the weights are loaded; only the GPU path does
        (TritonMoE.fold_shared_experts): on the CPU reference the sums would run in another order
        than transformers'. Also keeps the router's weight in float32, not converted every step.

        The shared MLP (width n x I: n_shared_experts of moe_intermediate_size) splits along its
        intermediate width into n experts of width I: SiLU(gate) * up is per column and down sums
        over the columns, so the n slots' outputs sum to the MLP's. With tensor parallelism each
        rank holds n x I / tp of the shared width and I / tp of each expert's, so its share folds
        the same way into n slots (the all-reduce sums routed and shared alike); with expert
        parallelism every rank appends the slots to its own experts and serves its own tokens'
        (EPExchange.fold_shared)."""
        self.gate_weight_f32 = self.gate.weight.float()
        shared = self.shared_expert
        inter, hidden = self.w2.shape[2], self.w2.shape[1]
        if shared is None or self.num_shared_slots or shared.down_proj.weight.shape[1] % inter:
            return
        n = shared.down_proj.weight.shape[1] // inter
        gate_up = torch.cat([shared.gate_proj.weight.view(n, inter, hidden),
                             shared.up_proj.weight.view(n, inter, hidden)], 1)  # [n, 2I, H]
        down = shared.down_proj.weight.view(hidden, n, inter).transpose(0, 1)  # [n, H, I]
        # One layer at a time: the old tensors are freed as the new ones replace them.
        self.w13 = nn.Parameter(torch.cat([self.w13, gate_up]), requires_grad=False)
        self.w2 = nn.Parameter(torch.cat([self.w2, down]), requires_grad=False)
        self.shared_expert = None
        self.num_shared_slots = n
        if self.exchange is not None:
            self.exchange.fold_shared(n)


class DeepseekV2ForCausalLM(DecoderLM):
    """MLA in every layer; layers [0, first_k_dense_replace) dense, the others DeepseekMoE."""

    # transformers' V2 rotates q and k in float32 (as complex64) whatever the model's dtype.
    rope_dtype: torch.dtype | None = torch.float32

    def make_attention(self, layer_idx: int) -> nn.Module:
        return MLAttention(self.args, layer_idx, self.attn_backend, self.norms)

    def make_mlp(self, layer_idx: int) -> nn.Module:
        args = self.args
        if not args.is_moe_layer(layer_idx):
            return GatedMLP(args.hidden_size, args.intermediate_size)
        return DeepseekMoE(args, self.moe_backend)

    def rope_inputs(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, qk_rope_head_dim] (YaRN's attention factor folded in), whatever the norms
        backend: MLA rotates only part of q and the shared key, in its own layer."""
        return self.rotary_emb(positions, self.rope_dtype or dtype)

    def checkpoint_name(self, hf_name: str) -> str | None:
        name = super().checkpoint_name(hf_name)
        if name is None:
            return None
        m = _LAYER.match(name)
        if m and int(m[1]) >= self.args.num_layers:
            # V3's multi-token-prediction layer(s) past the last: the first is loaded where the
            # engine drafts with it (add_mtp), the others never are.
            if self.mtp is None or int(m[1]) != self.args.num_layers:
                return None
            name = deepseek_mtp.checkpoint_name(name[m.end():])
            if name is None:
                return None
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        return name

    def add_mtp(self) -> None:
        """Build the checkpoint's multi-token-prediction layer (pdserve.models.deepseek_mtp) beside
        the model, its decoder layer cached in the KV cache's layer after the model's. On the meta
        device, before allocation, as the model."""
        args = self.args
        if not args.num_nextn_predict_layers:
            raise ValueError(f"speculative.method 'mtp' needs a checkpoint with a multi-token-prediction "
                             f"layer: this {args.architecture} has none (config.json num_nextn_predict_layers "
                             f"is 0 or unset); use method 'ngram'")
        i = args.num_layers
        block = DecoderLayer(args, self.make_attention(i), self.make_mlp(i), self.norms)
        self.mtp = deepseek_mtp.DeepseekMTP(args, block, self.norms)

    def mtp_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer over `batch` (input_ids: the token after each position) given the main
        model's hidden states there: h' [T, H]; its logits are `mtp.compute_logits`."""
        embeds = self.embed_tokens(batch.input_ids)
        return self.mtp(embeds, hidden, self.rope_inputs(batch.positions, embeds.dtype), batch)

    def hub_name(self, name: str) -> str:
        name = name.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        return super().hub_name(name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V2's layers with sigmoid routing (noaux_tc); RoPE in the model's dtype, on pairs unless
    rope_interleave is false."""

    rope_dtype = None
