"""Whether the router streams anything now, for its periodic tasks. An idle router's loop would
otherwise wake ~30 times a second for work no one reads: the loop-lag sampler (20 a second) measures
what the loop's pauses cost tokens, and there are none; the stats poll (2 rounds a second, each a
Ray call or two per replica) keeps routing figures fresh for requests that are not there. Each
wake-up of the idle process is a few hundred µs of a 2-core VM's CPU (docs/benchmarks.md, "Router
CPU at idle"). So while nothing is in flight the sampler waits for a request and the poll slows to
IDLE_POLL_S; a request's start wakes both at once (the poll's round then waits WAKE_DELAY_S, out of
the request's way). With requests in flight nothing changes, and the
poll's first round after the last request ends still comes at the busy period: it brings that
request's last KV events (the prefix index a next turn routes on) and counters as soon as before."""

import asyncio
from collections.abc import Callable

IDLE_POLL_S = 2.0  # stats poll period with nothing in flight (0.5 s otherwise): /metrics and /health are
                   # this fresh at idle, and a replica that hangs at idle counts down ~4.5 s later
# A poll woken by a request's start waits this long first: its Ray calls then leave the router's loop
# after the request's hand-off, and reach the worker (whose Ray thread answers them under the GIL)
# after the engine's thread has launched the request's first step, not while it does (the hop trace
# of a lone request on an H200 had the stats call land in the worker ~0.8 ms after the step began).
WAKE_DELAY_S = 0.05


class Activity:
    """Requests in flight (`in_flight()`), and an event for those waiting on the next one to start."""

    def __init__(self, in_flight: Callable[[], int]):
        self.in_flight = in_flight
        self._started = asyncio.Event()
        self._was_busy = False  # (pause's: its caller's last pause had requests in flight)

    def started(self) -> None:
        """A request (or an attempt of one) starts: wake whoever waits for one."""
        self._started.set()

    async def until_busy(self, at_most_s: float | None = None) -> None:
        """Return at once while requests are in flight; else when one starts, or after at_most_s
        (None: no limit)."""
        if self.in_flight():
            return
        self._started.clear()
        try:
            await asyncio.wait_for(self._started.wait(), at_most_s)
        except TimeoutError:
            pass

    async def pause(self, busy_s: float, idle_s: float) -> None:
        """Sleep busy_s while requests are in flight, and once more after the last one ends; else
        until one starts (then WAKE_DELAY_S more), at most idle_s. For one caller (the stats poll):
        it keeps that one's state."""
        busy = self.in_flight() > 0
        if busy or self._was_busy:
            self._was_busy = busy
            await asyncio.sleep(busy_s)
            return
        await self.until_busy(idle_s)
        if self._started.is_set():  # woken by a request, not by the idle period's end
            await asyncio.sleep(WAKE_DELAY_S)
