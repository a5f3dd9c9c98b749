"""Serving processes run at normal priority though Ray starts them at nice 15; a starting worker
yields the CPU (never taking more than it was started with) and moves every thread it made to its
serving priority once ready (pdserve/priority.py). Run in child processes started at nice 15, as Ray
starts its workers, or at 0: the test's own priority stays as it is."""

import os
import subprocess
import sys

import pytest

CHILD = r"""
import os, threading, time
from pdserve.priority import SERVING_NICE, STARTING_NICE, back_to, serving_priority, yield_while_starting
began = os.getpriority(os.PRIO_PROCESS, 0)
p = yield_while_starting()
if p is None:
    print("SKIP")
    raise SystemExit
assert p == serving_priority() == SERVING_NICE, p  # (this child may: see the test)
starting = max(began, SERVING_NICE + STARTING_NICE)  # (Ray's 15 stays: not raised for the start)
assert os.getpriority(os.PRIO_PROCESS, 0) == starting, (began, os.getpriority(os.PRIO_PROCESS, 0))
started = threading.Event()
t = threading.Thread(target=lambda: (started.set(), time.sleep(2)), daemon=True)  # made during the start
t.start(); started.wait()
assert os.getpriority(os.PRIO_PROCESS, t.native_id) == starting  # inherited
back_to(p)
import sys
from pdserve.priority import SWITCH_S
assert sys.getswitchinterval() == SWITCH_S < 0.005, sys.getswitchinterval()  # turns at the interpreter
print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, t.native_id))
"""

ROUTER = r"""
import os, threading, time
from pdserve.priority import serve_now
t = threading.Thread(target=time.sleep, args=(2,), daemon=True)
t.start()
serve_now()
import sys
from pdserve.priority import SWITCH_S
assert sys.getswitchinterval() == SWITCH_S < 0.005, sys.getswitchinterval()
print(os.getpriority(os.PRIO_PROCESS, 0), os.getpriority(os.PRIO_PROCESS, t.native_id))
"""


def _at_nice(code: str, nice: int = 15) -> str:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, nice))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


needs_privilege = pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority needs root here")


@needs_privilege
@pytest.mark.parametrize("nice", [15, 0])
def test_a_worker_starts_niced_then_serves_at_normal_priority_every_thread(nice):
    assert _at_nice(CHILD, nice).split() == ["0", "0"]


@needs_privilege
def test_a_router_serves_at_normal_priority():
    assert _at_nice(ROUTER).split() == ["0", "0"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may always raise a priority")
def test_without_privilege_a_start_is_left_as_it_is():
    """Where the process may not come back, it is not lowered at all (a worker stuck low would be
    worse than a slow start)."""
    code = r"""
import os, resource
resource.setrlimit(resource.RLIMIT_NICE, (0, resource.getrlimit(resource.RLIMIT_NICE)[1]))
from pdserve.priority import serving_priority, yield_while_starting
print(serving_priority(), yield_while_starting(), os.getpriority(os.PRIO_PROCESS, 0))
"""
    assert _at_nice(code).split() == ["15", "None", "15"]
