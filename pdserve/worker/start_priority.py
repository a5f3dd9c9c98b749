"""A starting worker yields the CPU to the serving ones.

A worker's start (its model, its KV connector: NIXL's import and UCX's context alone take much
CPU) runs beside the replicas that serve, on the same cores where the host has few: a scale-up of
two NIXL replicas on a small host lengthened the TTFT of requests served meanwhile
(tests/test_chaos.py; docs/benchmarks-history.md, the chaos suite).
So a worker starts at a lower priority (nice +STARTING_NICE) and returns to its own once ready.

Linux keeps a priority per thread, and a thread inherits its creator's: returning means every
thread the start made (the KV posting thread, torch's pool, UCX's) as well as the main one. Only
done where the process may return (root, or RLIMIT_NICE allows it): a worker stuck at a low
priority would be worse than a slow start.
"""

import logging
import os
import resource

log = logging.getLogger(__name__)

STARTING_NICE = 10


def yield_while_starting() -> int | None:
    """Lower this process's priority for its start; returns the priority to return to (None: left as is)."""
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        if not _may_return(before):
            return None
        os.setpriority(os.PRIO_PROCESS, 0, min(19, before + STARTING_NICE))
        return before
    except OSError as e:  # (not Linux, or not allowed: start as is)
        log.debug("starting at the usual priority: %s", e)
        return None


def back_to(priority: int | None) -> None:
    """Every thread of this process back to `priority` (yield_while_starting's answer)."""
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


def _may_return(priority: int) -> bool:
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)  # the lowest nice allowed is 20 - soft
    return soft == resource.RLIM_INFINITY or 20 - soft <= priority
