"""Which drafter guesses a decoding sequence's next tokens, and how many (the scheduler's
`drafter`): prompt lookup (engine/ngram.py) or DeepSeek-V3's MTP layer (engine/mtp_drafter.py), as
the engine's `speculative.method` says."""

from pdserve.engine.mtp_drafter import MTPDrafter
from pdserve.engine.ngram import NgramDrafter
from pdserve.engine.sequence import Sequence
from pdserve.speculative_config import SpeculativeConfig


class Drafting:
    def __init__(self, spec: SpeculativeConfig, max_model_len: int, mtp: MTPDrafter | None = None):
        self.spec, self.max_model_len, self.mtp = spec, max_model_len, mtp
        self._ngram = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, seq: Sequence, room: int) -> list[int]:
        """A decoding sequence's draft tokens for its next step: at most `room`, and never more than
        its max_tokens and the context leave after its next token."""
        if not seq.params.speculative:  # (the request opted out)
            return []
        if seq.params.grammar is not None:
            # A verify step samples a row per draft position: each would need its grammar's mask
            # there, its matcher advanced over the drafts before it (and rolled back on a
            # rejection). Not built: a constrained request decodes one token a step.
            return []
        k = min(self.spec.draft_tokens, room, seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1)
        if self.spec.mtp:  # (an engine built without the layer, then flipped to a role that asks for it: none)
            return self.mtp.propose(seq, k) if self.mtp is not None else []
        return self._ngram.propose(seq.request_id, seq.token_ids, k)

    def forget(self, request_id: str) -> None:
        self._ngram.forget(request_id)
        if self.mtp is not None:
            self.mtp.forget(request_id)
