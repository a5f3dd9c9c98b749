"""Drafting with DeepSeek-V3's multi-token-prediction layer (pdserve/models/deepseek_mtp.py).

After every step whose tokens are known (the engine never overlaps a speculating step), the MTP
layer runs over each scheduled sequence's positions whose target hidden state holds: a prompt
chunk's every position, a decode step's one, a verify step's last token and its accepted drafts.
At position p it reads the target's hidden state h_p and the token x_{p+1} (the next prompt token,
or the token the step just sampled or accepted) and writes its own KV at p, in the layer after the
model's, through the sequence's own block table; the last position of a sequence that samples
gives the draft of its next step's token after the next (argmax: one draft, a point mass, which
spec_decode's verification takes as an n-gram draft).

The MTP layer's KV is thus complete for every computed position, whatever computed it: a prompt, a
recomputation after preemption, a prefill replica (where the engine runs it too, and the layer's
KV moves with the others': `Engine.layer_hook` hears the layer). A draft only ever costs acceptance,
never correctness: a block from the prefix cache whose last position's MTP entry was computed before
a different next token (the hash covers the block's own tokens) only makes the guess worse.
"""

from array import array

import torch

from pdserve.engine.model_runner import Launched
from pdserve.engine.sequence import PENDING, Sequence
from pdserve.forward.forward_batch import ForwardBatch


def _long(xs: list[int], device: torch.device) -> torch.Tensor:
    host = torch.frombuffer(array("q", xs), dtype=torch.long) if xs else torch.empty(0, dtype=torch.long)
    return host.to(device, non_blocking=True)


class MTPDrafter:
    """One per engine whose model has its MTP layer built (`model.mtp`)."""

    def __init__(self, model, block_size: int, device: torch.device):
        self.model, self.block_size, self.device = model, block_size, device
        self.kv_layer: int = model.mtp.kv_layer
        # request id -> (the sequence's length the draft is for, the draft token): a draft follows
        # the sequence's last token, so it is stale once the sequence has moved on.
        self._drafts: dict[str, tuple[int, int]] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """The draft of the token after `seq`'s next one, where the last step left one ([] else)."""
        d = self._drafts.get(seq.request_id)
        return [d[1]] if k >= 1 and d is not None and d[0] == seq.num_tokens else []

    def forget(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

    @torch.inference_mode()
    def run(self, launched: Launched, drafts_wanted: bool) -> bool:
        """The MTP layer over `launched`'s positions that hold (its tokens placed, rejected drafts
        rolled back); with `drafts_wanted`, keeps the next draft of each sequence that sampled.
        False when no position ran (nothing to hand the layer's KV on for)."""
        batch, hidden = launched.batch, launched.hidden
        bs = self.block_size
        rows, ids, positions, slots, ctx, tables, drafting = [], [], [], [], [], [], []
        starts = [0]
        first = batch.host[0]  # the step's positions, on the host
        # A sequence's rows of the step: its num_new_tokens, from `at` (a verify step's sequence is
        # several batch entries of one row each, model_runner.prepare: count rows, not entries).
        at = 0
        for s in launched.scheduled:
            seq, at, row = s.seq, at + s.num_new_tokens, at
            lo, end = int(first[row]), seq.num_computed_tokens
            if not seq.block_ids or end <= lo or len(seq.token_ids) <= end or seq.token_ids[end] == PENDING:
                continue  # (freed, or its next token not known: nothing holds yet)
            rows += range(row, row + end - lo)
            ids += seq.token_ids[lo + 1:end + 1]
            positions += range(lo, end)
            slots += [seq.block_ids[p // bs] * bs + p % bs for p in range(lo, end)]
            starts.append(starts[-1] + end - lo)
            ctx.append(end)
            tables.append(seq.block_ids)
            if s.samples:
                drafting.append((seq, len(starts) - 2))
        if not ctx:
            return False
        width = max(len(t) for t in tables)
        table = [b for t in tables for b in t + [0] * (width - len(t))]
        lens = torch.tensor(ctx + starts, dtype=torch.int32).to(self.device, non_blocking=True)
        mtp_batch = ForwardBatch(
            input_ids=_long(ids, self.device), positions=_long(positions, self.device),
            slot_mapping=_long(slots, self.device), block_tables=_long(table, self.device).view(len(ctx), width),
            query_start=starts, context_lens=ctx, logits_indices=torch.empty(0), kv_cache=batch.kv_cache,
            context_lens_t=lens[:len(ctx)], query_start_t=lens[len(ctx):], kv_scales=batch.kv_scales)
        h = self.model.mtp_forward(mtp_batch, hidden[_long(rows, self.device)])
        if drafting and drafts_wanted:
            last = _long([starts[j + 1] - 1 for _, j in drafting], self.device)
            tokens = self.model.mtp.compute_logits(h[last]).argmax(-1).tolist()
            for (seq, _), t in zip(drafting, tokens):
                self._drafts[seq.request_id] = (seq.num_tokens, t)
        return True
