"""Runs an engine's steps on a thread of its own inside a worker process.

The engine is not thread-safe: actor methods and the loop take turns through `lock`. `step`
returns whether it has more to do right away; when not, the loop naps (`idle_s`, so transfers
still get polled) or until `wake()`.
"""

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, step: Callable[[], bool], name: str, idle_s: float = 0.002):
        self.lock = threading.Lock()
        self._step = step
        self._idle_s = idle_s
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
                    busy = self._step()
                if not busy:
                    self._wake.wait(self._idle_s)
                    self._wake.clear()
        except BaseException as e:  # the worker reports itself unhealthy; the controller replaces it
            log.exception("engine loop died")
            self.error = e
