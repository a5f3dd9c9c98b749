"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): routed experts plus a sigmoid-gated shared expert."""

from torch import nn

from pdserve.models.decoder import DecoderLM
from pdserve.models.layers import GatedMLP, SparseMoE


class Qwen2MoeForCausalLM(DecoderLM):
    """q/k/v bias; MoE layers chosen by decoder_sparse_step / mlp_only_layers, the others dense."""

    def make_mlp(self, layer_idx: int) -> nn.Module:
        args = self.args
        if not args.is_moe_layer(layer_idx):
            return GatedMLP(args.hidden_size, args.intermediate_size)
        # Top-k weights are renormalized only if norm_topk_prob; the shared expert comes from
        # shared_expert_intermediate_size.
        return SparseMoE(args, self.moe_backend, renormalize=args.norm_topk_prob)
