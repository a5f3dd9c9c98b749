"""What an engine's steps cost, by size: the measurements the planner (`pdserve tune`) sizes prefill
and decode pools from.

Every step is counted in one bucket of its size (powers of two): a step that computes prompt
tokens under "prefill" by its number of new tokens, a step of generation only under "decode" by
its batch (sequences); a step of both is also counted under "mixed" by its prompt tokens, with its
decoders. A speculative verify step (one with draft tokens) is in none of them: it computes 1 + k
tokens per decoder, and a drafter's forward may follow it, so it would inflate the decode fit the
planner and the TPOT guard read; it is counted apart, under "verify" by its decoders, with its
draft tokens. Each bucket holds [steps, size summed, seconds summed]: cumulative, so a
reader differences two snapshots to get a window, and nothing is ever drained. Also counted: the
prompt tokens looked up in the prefix cache and those found there (vLLM's prefix_cache_queries and
prefix_cache_hits), and every token run through the model (on a prefill replica: the prompt tokens
it computed, prefix-cache hits left out; the one-token step of a prompt cached but for its last
token counts there too, though its bucket is decode's)."""

import threading
import time

PREFILL, DECODE, MIXED, VERIFY = "prefill", "decode", "mixed", "verify"


def bucket(n: int) -> int:
    """The power of two at or above n (n >= 1)."""
    return 1 << max(0, n - 1).bit_length()


class StepProfile:
    def __init__(self) -> None:
        self.phases: dict[str, dict[int, list[float]]] = {PREFILL: {}, DECODE: {}}
        # Steps that carried prompt tokens and decoders both, by prompt tokens: [steps, prompt
        # tokens, decoders, seconds] (the TPOT guard's and the adaptive site's mixed-step cost).
        self.mixed: dict[int, list[float]] = {}
        # Verify steps, by decoders: [steps, decoders, draft tokens, seconds].
        self.verify: dict[int, list[float]] = {}
        self.busy_s = 0.0  # seconds spent in steps
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found there
        self.tokens_computed = 0  # tokens run through the model, every phase
        # Speculative decoding: draft tokens proposed and of those accepted (vLLM's
        # spec_decode_num_draft_tokens / _num_accepted_tokens).
        self.spec_draft_tokens = self.spec_accepted_tokens = 0
        # The engine's thread records while a stats call (another thread) snapshots: a bucket added
        # mid-copy would break the copy, and a failed stats call reads as a dead worker.
        self._lock = threading.Lock()

    def record(self, prefill_tokens: int, decode_seqs: int, seconds: float, draft_tokens: int = 0) -> None:
        """One step that computed `prefill_tokens` prompt tokens and one token for `decode_seqs`
        generating sequences (and `draft_tokens` after theirs: a verify step), in `seconds`."""
        if draft_tokens:
            with self._lock:
                row = self.verify.setdefault(bucket(max(decode_seqs, 1)), [0, 0, 0, 0.0])
                row[0] += 1
                row[1] += decode_seqs
                row[2] += draft_tokens
                row[3] += seconds
                self.busy_s += seconds
                self.tokens_computed += prefill_tokens + decode_seqs + draft_tokens
            return
        if prefill_tokens:  # a mixed step (colocated) counts as prefill: its prompt tokens dominate it
            phase, size = PREFILL, prefill_tokens + decode_seqs
        elif decode_seqs:
            phase, size = DECODE, decode_seqs
        else:
            return
        with self._lock:
            row = self.phases[phase].setdefault(bucket(size), [0, 0, 0.0])
            row[0] += 1
            row[1] += size
            row[2] += seconds
            self.busy_s += seconds
            self.tokens_computed += prefill_tokens + decode_seqs
            if prefill_tokens and decode_seqs:
                row = self.mixed.setdefault(bucket(prefill_tokens), [0, 0, 0, 0.0])
                row[0] += 1
                row[1] += prefill_tokens
                row[2] += decode_seqs
                row[3] += seconds

    def reset(self) -> None:
        """Back to nothing counted (after a replica's warm-up: its steps are not traffic)."""
        with self._lock:
            self.phases = {PREFILL: {}, DECODE: {}}
            self.mixed, self.verify = {}, {}
            self.busy_s = 0.0
            self.prefix_queries = self.prefix_hits = self.tokens_computed = 0
            self.spec_draft_tokens = self.spec_accepted_tokens = 0

    def spec_verified(self, drafted: int, accepted: int) -> None:
        """A sequence's draft tokens checked in a step, and how many of them held."""
        with self._lock:
            self.spec_draft_tokens += drafted
            self.spec_accepted_tokens += accepted

    def timer(self) -> "_StepTimer":
        return _StepTimer(self)

    def snapshot(self) -> dict:
        """A plain copy (pickles and JSON-encodes): {"prefill": {bucket: [steps, size, seconds]},
        "decode": {...}, "mixed": {...}, "verify": {...}, "busy_s", "prefix_queries", "prefix_hits", "tokens_computed", "spec_draft_tokens",
        "spec_accepted_tokens"}."""
        with self._lock:
            return {**{p: {b: list(row) for b, row in rows.items()} for p, rows in self.phases.items()},
                    MIXED: {b: list(row) for b, row in self.mixed.items()},
                    VERIFY: {b: list(row) for b, row in self.verify.items()},
                    "busy_s": self.busy_s, "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                    "tokens_computed": self.tokens_computed, "spec_draft_tokens": self.spec_draft_tokens,
                    "spec_accepted_tokens": self.spec_accepted_tokens}


class _StepTimer:
    def __init__(self, profile: StepProfile) -> None:
        self.profile = profile
        self.t0 = time.perf_counter()

    def done(self, prefill_tokens: int, decode_seqs: int, draft_tokens: int = 0) -> None:
        self.profile.record(prefill_tokens, decode_seqs, time.perf_counter() - self.t0, draft_tokens)
