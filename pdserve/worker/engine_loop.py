"""Runs an engine's steps on a thread of its own inside a worker process, and takes the work that
actor calls bring through an inbox.

Admission never waits for a step: an actor call that brings work (a request, a reservation, an
abort) puts a typed item into the inbox and returns; the loop takes every item between two steps,
in the order they came. A call that needs an answer from the engine (a reservation's block ids)
waits for that boundary only, never behind other calls. The engine is not thread-safe, so only the
loop's thread touches it; the few calls that must reach it otherwise (a KV handshake) take turns
with the steps through `lock`, a FIFO (`TurnLock`). `step` returns None when it has more to do
right away, else how long the loop may nap (cut short by new work): short while transfers are in
flight, long when idle — an idle worker must not burn a core polling.
"""

import logging
import threading
from collections import deque
from collections.abc import Callable

from pdserve.hop_trace import hop

log = logging.getLogger(__name__)

IDLE_S = 0.1  # the nap of a worker with nothing to do; new work wakes it at once


class TurnLock:
    """A lock granted in the order it was asked for (a ticket lock): the loop, between two steps,
    lets in whoever asked during the step."""

    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket whose holder has the lock

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while ticket != self._serving:
                self._cond.wait()

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> "TurnLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class EngineLoop:
    def __init__(self, step: Callable[[], float | None], take: Callable[[object], None], name: str,
                 on_death: Callable[[BaseException], None] = lambda error: None):
        """step(): one engine step -> nap; take(item): apply one inbox item, on the loop's thread;
        on_death(error): the loop died of `error` (called on its thread, after logging it)."""
        self._on_death = on_death
        self.lock = TurnLock()
        self._step = step
        self._take = take
        self._inbox: deque = deque()  # appends and pops are atomic: no lock between callers and the loop
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: object) -> None:
        """Hand work to the loop; it is taken before the next step. Returns at once."""
        hop("inbox")
        self._inbox.append(item)
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def queued(self) -> int:
        """Items in the inbox, not taken yet."""
        return len(self._inbox)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> list:
        """Stop after the current step; returns the inbox's items not taken (a flip answers them)."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)
        left = list(self._inbox)
        self._inbox.clear()
        return left

    def _run(self) -> None:
        try:
            while not self._stopped:
                with self.lock:
                    while self._inbox:
                        hop("taken")
                        self._take(self._inbox.popleft())
                    hop("step")
                    nap = self._step()
                    hop("stepped")
                if nap is not None:
                    self._wake.clear()
                    if not self._inbox:  # (checked after the clear: a submit in between still wakes us)
                        self._wake.wait(nap)
        except BaseException as e:  # the worker's stats() raises from now on: routers count it down
            log.exception("engine loop died")
            self.error = e
            self._on_death(e)
