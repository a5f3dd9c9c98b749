"""Whether the router streams anything now, for its periodic tasks. An idle router's loop would
otherwise wake ~30 times a second for work no one reads: the loop-lag sampler (20 a second) measures
what the loop's pauses cost tokens, and there are none; the stats poll (2 rounds a second, each a
Ray call or two per replica) keeps routing figures fresh for requests that are not there. Each
wake-up of the idle process is a few hundred µs of a 2-core VM's CPU (docs/benchmarks.md, "Router
CPU at idle"). So while nothing is in flight the sampler waits for a request and the poll slows to
IDLE_POLL_S; a request's start wakes both at once (the poll's round then waits for that request's
first token, out of its way). With requests in flight nothing changes, and the
poll's first round after the last request ends still comes at the busy period: it brings that
request's last KV events (the prefix index a next turn routes on) and counters as soon as before."""

import asyncio
from collections.abc import Callable

IDLE_POLL_S = 2.0  # stats poll period with nothing in flight (0.5 s otherwise): /metrics and /health are
                   # this fresh at idle, and a replica that hangs at idle counts down ~4.5 s later
# A poll woken by a request's start waits for a first token (or the request's end), at most this
# long: its Ray calls then reach the worker, whose Ray thread answers them under the GIL, once the
# request's first step is done, not as the engine's thread launches it (an H200's hop trace of a
# lone request had the call land ~0.8 ms after the step began) nor in its middle (a fixed 50 ms
# wait, the build before: a lone 4k prompt's step is ~63 ms, and its served first token came 11 ms
# later than the run before's, unexplained; docs/benchmarks.md). A prompt longer than this is polled
# mid-step.
FIRST_TOKEN_WAIT_S = 1.0


class Activity:
    """Requests in flight (`in_flight()`), and an event for those waiting on the next one to start."""

    def __init__(self, in_flight: Callable[[], int]):
        self.in_flight = in_flight
        self._started = asyncio.Event()
        self._answered = asyncio.Event()  # a request's first token came, or a request ended
        self._was_busy = False  # (pause's: its caller's last pause had requests in flight)

    def started(self) -> None:
        """A request (or an attempt of one) starts: wake whoever waits for one."""
        self._started.set()

    def answered(self) -> None:
        """A request's first token came, or a request ended: its first step is behind it."""
        self._answered.set()

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
        until one starts (at most idle_s), and then until a first token comes (at most
        FIRST_TOKEN_WAIT_S). For one caller (the stats poll): it keeps that one's state."""
        busy = self.in_flight() > 0
        if busy or self._was_busy:
            self._was_busy = busy
            await asyncio.sleep(busy_s)
            return
        self._answered.clear()
        await self.until_busy(idle_s)
        if self._started.is_set():  # woken by a request, not by the idle period's end
            try:
                await asyncio.wait_for(self._answered.wait(), FIRST_TOKEN_WAIT_S)
            except TimeoutError:
                pass
