"""Start (or join) Ray, surviving a busy host.

Ray gives a new local node a fixed 30 s to register its raylet with the GCS and then raises. On a
loaded host (two cores running a model's tests beside it, a node still tearing down) that budget
can pass before the raylet even runs, and the processes it started stay behind. Starting a local
node is therefore tried a few times, each failed attempt's processes stopped first. Joining a
running cluster is tried once: there the failure means something else.
"""

import os
import sys
import time

import psutil

START_TRIES = 3
_TIMED_OUT = "timed out during startup"  # Ray's message when the raylet did not register in time


def init(address: str | None = None, log=None, **kwargs) -> None:
    """`ray.init(address, **kwargs)`; a local start (`address` None) is tried `START_TRIES` times."""
    import ray

    for attempt in range(1, START_TRIES + 1):
        try:
            ray.init(address=address, **kwargs)
            return
        except Exception as e:  # Ray raises a bare Exception here
            if address is not None or _TIMED_OUT not in str(e) or attempt == START_TRIES:
                raise
            stopped = _stop_ray_children(os.path.dirname(ray.__file__))
            (log or _stderr)(f"Ray's local node did not register within Ray's 30 s (a busy host?); stopped its "
                             f"{stopped} processes, starting again ({attempt + 1}/{START_TRIES})")
            time.sleep(1.0 * attempt)


def _stop_ray_children(ray_dir: str, grace_s: float = 10.0) -> int:
    """SIGKILL this process's descendants that run Ray's own programs (GCS, raylet, monitors) for a
    session this process started: Ray names a session's directory session_<date>_<pid of its
    starter>, and every such program is given it. A cluster another child started (a `pdserve up`
    this process spawned) has that child's pid there, and is left alone."""
    mine = f"_{os.getpid()}"
    procs = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmdline = p.cmdline()
        except psutil.Error:
            continue
        ours = any("session_" in part and (mine + "/" in part or part.endswith(mine)) for part in cmdline)
        if ours and any(ray_dir in part for part in cmdline):
            procs.append(p)
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=grace_s)
    return len(procs)


def _stderr(msg: str) -> None:
    print(f"[pdserve] {msg}", file=sys.stderr, flush=True)
