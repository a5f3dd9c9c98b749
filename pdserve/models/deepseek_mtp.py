"""DeepSeek-V3's multi-token-prediction (MTP) layer, as a drafter for speculative decoding.

The checkpoint stores it as the layer after the last (`model.layers.{num_hidden_layers}.*`, with
`num_nextn_predict_layers: 1` in config.json): two RMSNorms `enorm` and `hnorm`, `eh_proj` (a
Linear 2H -> H), a whole decoder layer (MLA attention and MoE, as the model's MoE layers), and
`shared_head.norm` + `shared_head.head` (its own copy of the LM head). Its `embed_tokens` is the
main model's, shared: not loaded twice.

At position p it reads the main model's hidden state there, h_p (the output after the final norm,
as vLLM's and SGLang's MTP drafters take it), and the embedding of the token that followed,
x_{p+1}:

    h'_p = Layer(eh_proj(concat(enorm(embed(x_{p+1})), hnorm(h_p))))   logits = head(norm(h'_p))

and the logits guess x_{p+2}. The layer attends over its own KV at positions 0..p (one more layer
of the paged cache, `kv_layer`, over the sequence's own block table). As in vLLM, the embedding at
position 0 is zeroed. One layer, one draft a step: it is not run again on its own output.
"""

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.models.args import ModelArgs
from pdserve.models.layers import RMSNorm

# The layer's own tensors in the checkpoint (under layers.{num_hidden_layers}.); the rest there is
# its decoder layer's, or the shared embedding.
OWN_TENSORS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")
SHARED_TENSORS = ("embed_tokens.",)


class SharedHead(nn.Module):
    def __init__(self, args: ModelArgs, norms):
        super().__init__()
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, norms)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)


class DeepseekMTP(nn.Module):
    """One MTP layer; `mtp_block` is a decoder layer built by the model (its attention caches in
    layer `kv_layer` of the KV cache: the one after the model's)."""

    def __init__(self, args: ModelArgs, block: nn.Module, norms):
        super().__init__()
        h = args.hidden_size
        self.kv_layer = args.num_layers
        self.enorm = RMSNorm(h, args.rms_norm_eps, norms)
        self.hnorm = RMSNorm(h, args.rms_norm_eps, norms)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.mtp_block = block
        self.shared_head = SharedHead(args, norms)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        """embeds [T, H] (of the tokens after each position), hidden [T, H] (the main model's there)
        -> h' [T, H] before the head's norm; writes the layer's KV at batch.slot_mapping."""
        embeds = torch.where((batch.positions == 0)[:, None], 0, embeds)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))
        x, residual = self.mtp_block(x, None, rope, batch)
        return x + residual

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h' [N, H] -> draft logits [N, vocab] float32."""
        return F.linear(self.shared_head.norm(h), self.shared_head.head.weight).float()


def checkpoint_name(rest: str) -> str | None:
    """Our name for the MTP layer's checkpoint tensor `layers.{L}.<rest>`; None: the shared embedding."""
    if rest.startswith(SHARED_TENSORS):
        return None
    return f"mtp.{rest}" if rest.startswith(OWN_TENSORS) else f"mtp.mtp_block.{rest}"
