"""Which replicas a router may use, and which of its requests wait on each. A replica found down
(its process died, its engine loop stopped, or it stopped answering) takes no new work, and the
requests waiting on it hear at once that it is lost (the router then moves them to a live replica:
lifecycle.py) instead of waiting forever. A draining replica takes no new work but keeps what it
holds. Bringing a replica back is the controller's job: it tells the router (`join`)."""

import asyncio

from pdserve.actors import down_reason
from pdserve.messages import LOST, RequestDelta
from pdserve.router.types import ReplicaUnavailableError

MISSED_LIMIT = 3  # stats polls in a row a replica may leave unanswered (timeouts) before it counts as down


class ReplicaHealth:
    def __init__(self):
        self.roles: dict[str, str] = {}  # replica name -> its role ("prefill", "decode", "colocated")
        self.down: dict[str, str] = {}  # replica -> why it is down
        self.draining: set[str] = set()
        self._missed: dict[str, int] = {}
        self._waiting: dict[str, dict[str, asyncio.Queue]] = {}  # replica -> its requests' queues

    def join(self, replica: str, role: str, fresh: bool, draining: bool = False) -> None:
        """The controller says the replica serves (or drains). fresh: a new incarnation, whose
        predecessor's requests are lost if nobody said so yet (the controller may see a death first)."""
        if fresh and self._waiting.get(replica):
            self._fail_waiting(replica, "it was replaced")
        self.roles[replica] = role
        self._waiting.setdefault(replica, {})
        if fresh:
            self.down.pop(replica, None)
            self._missed[replica] = 0
        (self.draining.add if draining else self.draining.discard)(replica)

    def leave(self, replica: str) -> None:
        """A drained replica is gone; a request still on it is lost (and moves)."""
        if self._waiting.get(replica):
            self._fail_waiting(replica, "it was stopped")
        for d in (self.roles, self.down, self._missed, self._waiting):
            d.pop(replica, None)
        self.draining.discard(replica)

    def live(self, names) -> list[str]:
        """Those of `names` that take new work: not down, not draining."""
        return [n for n in names if n not in self.down and n not in self.draining]

    def unavailable(self, role: str) -> ReplicaUnavailableError:
        """The error for a request that no replica of `role` can take."""
        gone = [f"{n} ({why})" for n, why in self.down.items() if self.roles[n] == role]
        detail = f": {', '.join(gone)}" if gone else ""
        return ReplicaUnavailableError(f"no live {role} replica{detail}")

    def wait_on(self, replica: str, request_id: str, queue: asyncio.Queue) -> None:
        """The request cannot go on without `replica`: it hears at once if the replica goes down."""
        self._waiting[replica][request_id] = queue

    def done_with(self, replica: str, request_id: str) -> None:
        self._waiting.get(replica, {}).pop(request_id, None)

    def answered(self, replica: str) -> bool:
        """The replica answered a stats poll; True if it had been counted down (it is back)."""
        self._missed[replica] = 0
        return self.down.pop(replica, None) is not None

    def failed(self, replica: str, error: BaseException) -> str | None:
        """A call to the replica failed; returns why it is down if this made it so (newly)."""
        if replica not in self.roles:  # removed meanwhile (scaled down)
            return None
        why = down_reason(error)
        if why is None:
            self._missed[replica] += 1
            if self._missed[replica] < MISSED_LIMIT:
                return None
            why = f"no answer to {MISSED_LIMIT} status polls in a row"
        if replica in self.down:
            return None
        self.down[replica] = why
        self._fail_waiting(replica, why)
        return why

    def _fail_waiting(self, replica: str, why: str) -> None:
        message = f"the {self.roles[replica]} replica {replica} was lost ({why})"
        for rid, queue in self._waiting[replica].items():
            queue.put_nowait(RequestDelta(rid, "", [], LOST, message))
        self._waiting[replica].clear()
