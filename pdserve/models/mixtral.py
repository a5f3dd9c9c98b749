"""Mixtral: every layer routed (softmax, top-k, always renormalized); its own checkpoint names."""

import re

from torch import nn

from pdserve.models.decoder import DecoderLM
from pdserve.models.layers import SparseMoE

# Hub checkpoints name the block `block_sparse_moe` and the experts' projections w1 (gate),
# w3 (up), w2 (down); transformers 5 renames the block to `mlp` in memory. Map both to ours.
_RENAMES = [
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.experts\.(\d+)\.w1\."), r".experts.\1.gate_proj."),
    (re.compile(r"\.experts\.(\d+)\.w3\."), r".experts.\1.up_proj."),
    (re.compile(r"\.experts\.(\d+)\.w2\."), r".experts.\1.down_proj."),
]


class MixtralForCausalLM(DecoderLM):
    """No attention bias, no shared expert; experts as wide as intermediate_size."""

    def make_mlp(self, layer_idx: int) -> nn.Module:
        return SparseMoE(self.args, self.moe_backend, renormalize=True)

    def checkpoint_name(self, hf_name: str) -> str | None:
        name = super().checkpoint_name(hf_name)
        if name is not None:
            for pattern, repl in _RENAMES:
                name = pattern.sub(repl, name)
        return name

    def hub_name(self, name: str) -> str:
        return super().hub_name(name.replace(".mlp.", ".block_sparse_moe."))

    def hub_expert_name(self, moe_prefix: str, expert: int, proj: str) -> str:
        w = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
        return f"model.{moe_prefix.replace('.mlp', '.block_sparse_moe')}.experts.{expert}.{w}.weight"
