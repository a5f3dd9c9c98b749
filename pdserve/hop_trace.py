"""Where a lone request's time goes, hop by hop, across the processes it crosses: an opt-in trace.

With PDSERVE_HOP_TRACE=DIR in the environment of `pdserve up` (Ray's processes inherit it) and of
`pdserve bench`, every process appends a line per hop it sees — `<CLOCK_MONOTONIC ns> <hop>
<request id or ->` — to DIR/<pid>.hops. One host's processes share that clock, so the lines of
all of them sort into one timeline; `python -m pdserve.benchmarks.hop_trace DIR` cuts it at each
request the bench sent and prints the median time from each hop to the next. Meant for requests
sent one at a time (a light load's TTFT split into its hops, issue 40): a hop that knows no request
id (the router's HTTP door, an engine step) belongs to the request whose segment it falls in.

Off (the default) a hop costs a call and one global read.
"""

import os
import threading
import time

_DIR = os.environ.get("PDSERVE_HOP_TRACE")
_file = None
_opening = threading.Lock()


def hop(name: str, request_id: str = "-") -> None:
    """Record that a request (or this process, for `-`) passed `name` now."""
    if _DIR is not None:
        _write(name, request_id)


def on() -> bool:
    return _DIR is not None


def _collected(phase: str, info: dict) -> None:
    # A collection is a pause of whichever thread allocated: where one lands in a request's hops shows.
    hop(f"gc{info['generation']}" if phase == "start" else "gc_done")


if _DIR is not None:
    import gc

    gc.callbacks.append(_collected)


def _write(name: str, request_id: str) -> None:
    global _file
    t = time.monotonic_ns()
    if _file is None:
        with _opening:
            if _file is None:
                os.makedirs(_DIR, exist_ok=True)
                # Line-buffered: a process killed at the end of a run keeps every hop it wrote.
                _file = open(os.path.join(_DIR, f"{os.getpid()}.hops"), "a", buffering=1)
    _file.write(f"{t} {name} {request_id}\n")
