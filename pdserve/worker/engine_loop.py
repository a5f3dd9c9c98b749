"""Runs an engine's steps on a thread of its own inside a worker process.

The engine is not thread-safe: actor methods and the loop take turns through `lock`, a FIFO
(`TurnLock`): a busy loop takes it again right after each step, and with a plain Lock it would
win every time — an actor call (a new request, a reservation) then waited until the loop napped,
hundreds of milliseconds under load (docs/benchmarks-history.md, goodput). `step` returns None when it
has more to do right away, else how long the loop may nap (woken early by `wake()`): short while
transfers are in flight, long when idle — an idle worker must not burn a core polling.
"""

import logging
import threading
from collections.abc import Callable

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
    def __init__(self, step: Callable[[], float | None], name: str):
        self.lock = TurnLock()
        self._step = step
        self._wake = threading.Event()
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        try:
            while not self._stopped:
                with self.lock:
                    nap = self._step()
                if nap is not None:
                    self._wake.wait(nap)
                    self._wake.clear()
        except BaseException as e:  # the worker's stats() raises from now on: routers count it down
            log.exception("engine loop died")
            self.error = e
