"""What a replica's prefix cache gained and lost, for routers to index (routing by cached prefix).

The block pool appends an event whenever a full block enters its prefix cache (stored) or leaves it
(removed: evicted, or the cache reset), keyed by the same hash chain its lookups use
(block_pool.block_hashes), so a router that hashes a prompt the same way knows which replica holds
how much of it. The engine's thread appends; routers read from other threads (Ray calls), each from
its own cursor, so any number of routers follow one log and none of them drains it for the others.

The log keeps the latest MAX_EVENTS events. A reader whose cursor fell out of it (a new router, one
that was away, or a log restarted by a new incarnation: another `epoch`) gets the whole cache
instead, marked `reset`: it replaces what it knew of this replica."""

import itertools
import os
from collections import deque

from pdserve.messages import KVEvents

MAX_EVENTS = 1 << 16  # ~2.5 MB of 32-byte hashes; about a minute of a busy GPU replica's stores

_epochs = itertools.count()


class KVEventLog:
    def __init__(self, cached: dict, max_events: int = MAX_EVENTS):
        """`cached`: the pool's own hash -> block dict, read whole for a reset."""
        self._cached = cached
        # (sequence number, stored?, hash); deque appends and a list() copy of it are atomic under
        # the GIL, which is all the locking one writer thread and several reader threads need.
        self._events: deque[tuple[int, bool, bytes]] = deque(maxlen=max_events)
        self._seq = 0  # of the latest event
        # Tells this log from a predecessor's (a replaced replica's cursor values mean nothing here).
        self.epoch = f"{os.getpid()}-{next(_epochs)}"

    def stored(self, block_hash: bytes) -> None:
        self._seq += 1
        self._events.append((self._seq, True, block_hash))

    def removed(self, block_hash: bytes) -> None:
        self._seq += 1
        self._events.append((self._seq, False, block_hash))

    def _after(self, cursor: int) -> list[tuple[int, bool, bytes]] | None:
        """The events after `cursor`, oldest first, read from the log's newest end back to the cursor
        (only those: a poll after a busy spell no longer copies a full log of ~65k events, ~1 ms held
        under the GIL beside the engine's thread); None when the log no longer reaches back to it."""
        while True:
            newest = []
            try:
                for event in reversed(self._events):
                    if event[0] <= cursor:
                        break
                    newest.append(event)
                break
            except RuntimeError:  # the engine thread appended meanwhile: read again
                continue
        # Sequence numbers are consecutive: the oldest one read must follow the cursor (none read:
        # nothing new since it, which this log's own cursors always allow).
        if newest and newest[-1][0] != cursor + 1:
            return None
        return newest[::-1]

    def since(self, epoch: str, cursor: int) -> KVEvents:
        """The events after `cursor` of this log (`epoch`), or the whole cache when those are not
        all here any more (or the epoch is another log's)."""
        if epoch == self.epoch and (tail := self._after(cursor)) is not None:
            return KVEvents(self.epoch, tail[-1][0] if tail else cursor, False, [(stored, h) for _, stored, h in tail])
        events = list(self._events)  # one consistent copy; the engine thread appends meanwhile
        # The cursor the reset answers to: no event after it may be missing from the snapshot, so
        # take it before copying the cache (an event between the two is then sent again: harmless).
        last = events[-1][0] if events else self._seq
        snapshot = list(self._cached)  # a dict's keys copied under the GIL, whole
        return KVEvents(self.epoch, last, True, [(True, h) for h in snapshot])
