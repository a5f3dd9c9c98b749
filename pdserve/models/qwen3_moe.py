"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): q/k norm attention, routed experts, no shared expert."""

from torch import nn

from pdserve.models.decoder import DecoderLM
from pdserve.models.layers import GatedMLP, SparseMoE


class Qwen3MoeForCausalLM(DecoderLM):
    """MoE layers chosen by decoder_sparse_step / mlp_only_layers (all of them in published models)."""

    def make_mlp(self, layer_idx: int) -> nn.Module:
        args = self.args
        if not args.is_moe_layer(layer_idx):
            return GatedMLP(args.hidden_size, args.intermediate_size)
        assert not args.shared_expert_intermediate_size, "Qwen3-MoE has no shared expert"
        return SparseMoE(args, self.moe_backend, renormalize=args.norm_topk_prob)
