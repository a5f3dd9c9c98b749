"""A starting worker yields the CPU and gives every thread its priority back once ready
(pdserve/worker/start_priority.py). Run in a child process: the test's own stays as it is."""

import subprocess
import sys

CHILD = r"""
import os, threading, time
from pdserve.worker.start_priority import STARTING_NICE, back_to, yield_while_starting
before = os.getpriority(os.PRIO_PROCESS, 0)
p = yield_while_starting()
if p is None:
    print("SKIP")
    raise SystemExit
assert p == before and os.getpriority(os.PRIO_PROCESS, 0) == min(19, before + STARTING_NICE)
started = threading.Event()
t = threading.Thread(target=lambda: (started.set(), time.sleep(2)), daemon=True)  # made during the start
t.start(); started.wait()
assert os.getpriority(os.PRIO_PROCESS, t.native_id) == min(19, before + STARTING_NICE)  # inherited
back_to(p)
print(os.getpriority(os.PRIO_PROCESS, 0) == before, os.getpriority(os.PRIO_PROCESS, t.native_id) == before)
"""


def test_a_start_runs_niced_and_every_thread_it_made_returns():
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if r.stdout.strip() == "SKIP":  # not allowed to return here: the start was left as it is
        assert "True" not in r.stdout
        return
    assert r.stdout.split() == ["True", "True"], r.stdout
