"""The controller's book of KV pairs: which prefill worker has a handshake with which decode worker
(both ways), which pairings failed, why, and when each is tried again.

Every prefill worker pairs with every decode worker (rank, for an expert-parallel replica) of the
cluster. A pair is made decode end first (it then takes reservations naming that prefill worker),
prefill end second (it then sends KV there); routers route a request only over a pair whose two
ends list each other (their stats' `kv_peers`), so a pair half made, failed or not yet tried takes
no traffic. A failed pairing is logged with its reason, counted by reason (routers export the
count), shown by `pdserve status`, and tried again with a doubling backoff.
"""

import time
from collections import Counter
from dataclasses import dataclass

RETRY_S = (2.0, 60.0)  # a failed pairing is tried again after this, doubling to the max


@dataclass
class PairFailure:
    reason: str  # "timeout" | "refused" (the handshake named a mismatch) | "died" (an end's process)
    why: str
    attempts: int
    retry_at: float  # monotonic
    backoff: float


class PairBook:
    def __init__(self):
        # (worker, peer) -> that worker's handshake record of the peer: backend chosen, why, hosts.
        self.records: dict[tuple[str, str], dict] = {}
        self.failing: dict[tuple[str, str], PairFailure] = {}  # (prefill worker, decode worker) -> its last failure
        self.failures: Counter = Counter()  # every failed pairing so far, by reason

    def paired(self, prefill: str, decode: str, prefill_rec: dict, decode_rec: dict) -> None:
        self.records[(prefill, decode)] = prefill_rec
        self.records[(decode, prefill)] = decode_rec
        self.failing.pop((prefill, decode), None)

    def half(self, decode: str, prefill: str, decode_rec: dict) -> None:
        """The decode end took the prefill worker (the prefill end's answer is next)."""
        self.records[(decode, prefill)] = decode_rec

    def failed(self, prefill: str, decode: str, reason: str, why: str) -> PairFailure:
        self.records.pop((prefill, decode), None)
        before = self.failing.get((prefill, decode))
        backoff = RETRY_S[0] if before is None else min(RETRY_S[1], before.backoff * 2)
        f = PairFailure(reason, why, (before.attempts if before else 0) + 1, time.monotonic() + backoff, backoff)
        self.failing[(prefill, decode)] = f
        self.failures[reason] += 1
        return f

    def due(self) -> list[tuple[str, str]]:
        """Failed pairs whose next try is due."""
        now = time.monotonic()
        return [k for k, f in self.failing.items() if f.retry_at <= now]

    def forget(self, workers) -> None:
        """Every pair of these (stopped) workers."""
        gone = set(workers)
        for key in [k for k in self.records if set(k) & gone]:
            del self.records[key]
        for key in [k for k in self.failing if set(k) & gone]:
            del self.failing[key]

    def complete(self, prefill: list[str], decode: list[str]) -> bool:
        """Whether every prefill worker is paired with every decode worker, both ways."""
        return all((p, d) in self.records and (d, p) in self.records for p in prefill for d in decode)

    def status(self, live: set[str]) -> list[dict]:
        """What `pdserve status` lists: each live worker's record of each live peer, and each
        failing pair (state "failed": its reason, attempts and when it is tried again)."""
        now = time.monotonic()
        out = [{"worker": a, "state": "paired", **rec} for (a, b), rec in list(self.records.items())
               if a in live and b in live]
        for (p, d), f in list(self.failing.items()):
            if p in live and d in live:
                out.append({"worker": p, "peer": d, "state": "failed", "backend": None, "reason": f.reason,
                            "why": f.why, "attempts": f.attempts, "retry_in_s": max(0.0, f.retry_at - now)})
        return out
