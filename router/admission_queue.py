"""The router's admission queue: new requests that no replica can take now (every decode replica's
sequence slots or KV blocks taken, every prefill or colocated replica holding its share of this
router's requests) wait here, in order of priority (the lower first, as vLLM's `priority`) and then
of arrival, instead of being refused at once.

Bounded in number and in time: at most router.max_queued wait, each at most router.queue_wait_s.
A new request that finds the queue full takes the place of the last sleeping one of a lower
priority, if any — that one gets the 429 (`displaced`): the queue then holds what matters most, and
the request refused is one that would have been served after the newcomer anyway — else it gets
the 429 itself (`queue_full`). A request whose client leaves is simply dropped (its coroutine is
cancelled where it sleeps).

Waiters sleep; nothing polls. The router wakes them when room may have appeared — one of its
requests gave back a slot or got its first token (its prefill replica has room), or fresh replica
stats came in (other routers' requests finish too) — one at a time, the first sleeping one in
order first. A woken waiter tries to place its request; when that fails it sleeps again, keeping
its place, and when it succeeds the next is woken (there may be room for more)."""

import asyncio
import bisect
import itertools
import time
from dataclasses import dataclass

from pdserve.messages import Request
from pdserve.router.types import OverloadedError


@dataclass(eq=False)
class Waiter:
    request: Request
    number: int  # arrival order at this router
    deadline: float  # time.monotonic() by which it is placed, or refused
    wake: asyncio.Future | None = None  # while it sleeps
    refused: OverloadedError | None = None  # displaced by a request of a higher priority

    @property
    def order(self) -> tuple[int, int]:
        return self.request.priority, self.number

    @property
    def sleeping(self) -> bool:
        return self.wake is not None and not self.wake.done()


class AdmissionQueue:
    def __init__(self, limit: int, wait_s: float, metrics=None):
        self.limit = limit  # router.max_queued
        self.wait_s = wait_s  # router.queue_wait_s
        self.metrics = metrics
        self.waiters: list[Waiter] = []  # in order: priority, then arrival
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self.waiters)

    def ahead(self, priority: int) -> list[Waiter]:
        """Those a new request of `priority` would wait behind: every waiter of its priority or a lower value."""
        return self.waiters[:bisect.bisect_right(self.waiters, (priority, float("inf")), key=lambda w: w.order)]

    def join(self, request: Request, retry_after_s: float = 1.0) -> Waiter:
        """Queue a request; raises OverloadedError when the queue is full of requests that go first."""
        if len(self.waiters) >= self.limit:
            victim = next((w for w in reversed(self.waiters) if w.sleeping and w.request.priority > request.priority),
                          None)
            if victim is None:
                raise OverloadedError(f"the router's queue is full: {len(self.waiters)} requests wait "
                                      f"(router.max_queued), none of a lower priority", "queue_full", retry_after_s)
            self._refuse(victim, OverloadedError(
                f"a request of a higher priority took this one's place in the router's full queue "
                f"(router.max_queued {self.limit})", "displaced", retry_after_s))
        w = Waiter(request, next(self._numbers), time.monotonic() + self.wait_s)
        bisect.insort(self.waiters, w, key=lambda q: q.order)
        self._depth()
        return w

    def leave(self, w: Waiter) -> None:
        """The waiter's request is placed, refused or gone."""
        i = bisect.bisect_left(self.waiters, w.order, key=lambda q: q.order)
        if i < len(self.waiters) and self.waiters[i] is w:
            del self.waiters[i]
            self._depth()

    async def wait(self, w: Waiter) -> None:
        """Sleep until woken (room may have appeared); raises OverloadedError at the waiter's
        deadline or when it was displaced."""
        if w.refused is not None:
            raise w.refused
        loop = asyncio.get_running_loop()
        w.wake = loop.create_future()
        try:
            async with asyncio.timeout(max(0.0, w.deadline - time.monotonic())):
                await w.wake
        except TimeoutError:
            raise OverloadedError(f"no replica had room for the request within router.queue_wait_s "
                                  f"({self.wait_s:g} s)", "queue_timeout") from None
        finally:
            w.wake = None
        if w.refused is not None:
            raise w.refused

    def wake(self, n: int = 1) -> None:
        """Wake the first `n` sleeping waiters, in order."""
        for w in self.waiters:
            if n <= 0:
                break
            if w.sleeping:
                w.wake.set_result(None)
                n -= 1

    def wake_all(self) -> None:
        self.wake(len(self.waiters))

    def _refuse(self, w: Waiter, error: OverloadedError) -> None:
        self.leave(w)
        w.refused = error
        w.wake.set_result(None)  # (it sleeps: only a sleeping waiter is displaced)

    def _depth(self) -> None:
        if self.metrics:
            self.metrics.set_queue_depth(len(self.waiters))
