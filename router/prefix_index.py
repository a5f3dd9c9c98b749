"""The router's index of what every worker's prefix cache holds, by block hash.

Workers publish KV events (pdserve/engine/kv_events.py); the router follows each worker's log from
its own cursor and keeps, per block hash, the workers that hold it. A prompt hashed the way the
engines hash it (block_pool.block_hashes: a chain, so a block's hash stands for the whole prefix up
to it) then tells, per worker, how many of its leading blocks are cached there: walk the chain until
no candidate holds the next block. The cost is one dict lookup per matched block, whatever the
index holds.

Events arrive with the stats poll (every 0.5 s), after the prefill that stored the blocks. A burst
of requests sharing a prefix (a system prompt; a session's next turn sent right after the last
one) would miss what the router itself just placed, so a routed prompt's blocks count as held by
the worker it went to for ROUTED_TTL_S, until events confirm them (or the cache dropped them)."""

import asyncio
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from pdserve.messages import KVEvents

ROUTED_TTL_S = 5.0  # several stats polls: by then the worker's own events say it
ROUTED_MAX = 1 << 16  # routed blocks remembered per worker (a bound, should polls stop)


class PrefixIndex:
    def __init__(self):
        self._holders: dict[bytes, set[str]] = {}  # block hash -> workers whose cache holds it
        self._held: dict[str, set[bytes]] = {}  # worker -> its hashes (to drop a worker, or reset it)
        self._cursors: dict[str, tuple[str, int]] = {}  # worker -> (its log's epoch, the last event seen)
        self._routed: dict[str, OrderedDict[bytes, float]] = {}  # worker -> hash -> until (monotonic)
        # Routed prompts whose chains are not hashed through yet: (worker, chain, until); into
        # _routed after the turn that sent them, or before the next match.
        self._unsettled: list[tuple[str, Sequence[bytes], float]] = []

    def cursor(self, worker: str) -> tuple[str, int]:
        """Where to ask `worker`'s log from: ("", 0) for a worker not followed yet (a reset comes)."""
        return self._cursors.get(worker, ("", 0))

    def apply(self, worker: str, ev: KVEvents) -> None:
        held = self._held.setdefault(worker, set())
        if ev.reset:
            for h in held:
                self._discard(h, worker)
            held.clear()
        for stored, h in ev.events:
            if stored:
                held.add(h)
                self._holders.setdefault(h, set()).add(worker)
            elif h in held:
                held.discard(h)
                self._discard(h, worker)
        self._cursors[worker] = (ev.epoch, ev.cursor)

    def drop(self, worker: str) -> None:
        """Forget a worker (gone, or replaced: a new incarnation has a cache of its own)."""
        self._unsettled = [u for u in self._unsettled if u[0] != worker]
        for h in self._held.pop(worker, ()):
            self._discard(h, worker)
        self._cursors.pop(worker, None)
        self._routed.pop(worker, None)

    def routed(self, worker: str, hashes: Sequence[bytes]) -> None:
        """The router just sent a prompt with these block hashes to `worker`: count them as held
        there until the worker's events can say so. A chain not hashed through yet (HashChain) is
        hashed after the turn that sends the prompt, not before: its first token need not wait."""
        if not hashes:
            return
        until = time.monotonic() + ROUTED_TTL_S
        if getattr(hashes, "is_complete", True):
            self._hold(worker, hashes, until)
            return
        if not self._unsettled:
            try:  # two turns on: the hand-off this turn queued (router/handoff.py) is sent by then
                loop = asyncio.get_running_loop()
                loop.call_soon(loop.call_soon, self._settle)
            except RuntimeError:  # no loop (a test, a script): no send to let go first
                self._hold(worker, hashes, until)
                return
        self._unsettled.append((worker, hashes, until))

    def _settle(self) -> None:
        unsettled, self._unsettled = self._unsettled, []
        for worker, chain, until in unsettled:  # (a worker dropped meanwhile left none here)
            self._hold(worker, chain, until)

    def _hold(self, worker: str, hashes: Iterable[bytes], until: float) -> None:
        recent = self._routed.setdefault(worker, OrderedDict())
        for h in hashes:
            recent[h] = until
            recent.move_to_end(h)
        while len(recent) > ROUTED_MAX:
            recent.popitem(last=False)

    def match(self, hashes: Sequence[bytes], workers: Iterable[str]) -> dict[str, int]:
        """Per worker, how many leading blocks of this prompt's hash chain its cache holds."""
        if self._unsettled:  # a burst: what was routed a moment ago counts already
            self._settle()
        now = time.monotonic()
        out = {}
        for w in workers:
            recent = self._routed.get(w)
            if recent:
                while recent and next(iter(recent.values())) < now:  # oldest first: expire them
                    recent.popitem(last=False)
            n = 0
            for h in hashes:
                holders = self._holders.get(h)
                if (holders is None or w not in holders) and not (recent and h in recent):
                    break
                n += 1
            out[w] = n
        return out

    def size(self) -> int:
        """Distinct block hashes indexed (any worker)."""
        return len(self._holders)

    def _discard(self, h: bytes, worker: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]
