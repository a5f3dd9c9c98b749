"""The CPU priority of pdserve's serving processes: normal while they serve, lower while they start.

Ray starts every worker process at nice 15 (its `worker_niceness`, so that its own raylet and GCS stay
responsive) — pdserve's engine workers and routers included. At nice 15 a process gets about 1/28 of
the CPU a nice-0 one does when they contend: any ordinary process on the host (a monitoring agent,
a client, another job) then takes the cores from the engine loop that launches the GPU's kernels and
from the router loop that streams every token. On a 2-core host beside another test's processes,
requests stalled for seconds while a replacement replica started (tests/test_chaos_node.py, CI).
So a worker and a router serve at SERVING_NICE (0), where the process may raise itself to it (root,
or RLIMIT_NICE allows it; else it keeps what it was given).

A worker's start (its model, its KV connector: NIXL's import and UCX's context alone take much CPU)
runs beside the replicas that serve, on the same cores where the host has few: a scale-up of two NIXL
replicas on a small host lengthened the TTFT of requests served meanwhile (tests/test_chaos.py). So
a worker starts STARTING_NICE below its serving priority, or lower where it began lower (Ray's 15),
and moves to its serving priority once ready.

Within a process, threads take turns at the interpreter: a thread that waits for it gets it only when
the holder blocks or after the switch interval, 5 ms by default. A worker's channel thread (a request
in, a step's deltas out) waits so behind its engine loop's thread, which runs the next step's host
work right after handing over a step's tokens; a router's loop behind its preload and Ray's threads.
So a serving process hands the interpreter over every SWITCH_S (PDSERVE_SWITCH_INTERVAL_S overrides
it, for a same-run comparison): the wait a hop can add is then that, not 5 ms. (At light load on an
H200 the served TTFT did not move beyond noise, 13.8 against 14.1 ms p50: there the threads rarely
contend. It bounds the wait where they do.)

Linux keeps a priority per thread, and a thread inherits its creator's: moving means every thread
the start made (the KV posting thread, torch's pool, UCX's) as well as the main one. A start is only
lowered where the process may come back: a worker stuck at a low priority would be worse than a slow
start.
"""

import logging
import os
import resource
import sys

log = logging.getLogger(__name__)

SERVING_NICE = 0
STARTING_NICE = 10
SWITCH_S = float(os.environ.get("PDSERVE_SWITCH_INTERVAL_S", "0.0005"))


def serving_priority() -> int:
    """The priority this process serves at: SERVING_NICE where it may take it, else its own."""
    own = os.getpriority(os.PRIO_PROCESS, 0)
    return SERVING_NICE if own > SERVING_NICE and _may_take(SERVING_NICE) else own  # (an operator's lower nice stays)


def yield_while_starting() -> int | None:
    """Lower this process's priority for its start; returns the priority to serve at (`back_to`'s
    argument), or None where it may not come back (left as is)."""
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        serve = serving_priority()
        if not _may_take(serve):
            return None
        # Never above what the process started at: Ray's 15 is already lower than serve + 10, and
        # raising it for the start (as this did) took three times the CPU from the replicas serving.
        os.setpriority(os.PRIO_PROCESS, 0, max(own, min(19, serve + STARTING_NICE)))
        return serve
    except OSError as e:  # (not Linux, or not allowed: start as is)
        log.debug("starting at the usual priority: %s", e)
        return None


def serve_now() -> None:
    """A process that starts light (a router): at its serving priority from here on, every thread."""
    try:
        back_to(serving_priority())
    except OSError as e:
        log.debug("serving at the priority given: %s", e)


def back_to(priority: int | None) -> None:
    """Every thread of this process to `priority` (yield_while_starting's answer), taking turns at
    the interpreter every SWITCH_S."""
    sys.setswitchinterval(SWITCH_S)
    if priority is None:
        return
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = [0]  # (no /proc: this thread only)
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), priority)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass


def _may_take(priority: int) -> bool:
    """Whether this process may set itself to `priority` (a lower nice needs root or RLIMIT_NICE)."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)  # the lowest nice allowed is 20 - soft
    return soft == resource.RLIM_INFINITY or 20 - soft <= priority
