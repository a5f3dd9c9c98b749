"""A local Ray node that missed Ray's registration deadline is stopped before the next try."""

import os
import subprocess
import sys

import psutil

from pdserve.control.ray_start import _stop_ray_children


def test_only_rays_programs_of_a_session_this_process_started_are_stopped(tmp_path):
    ray_dir = tmp_path / "site-packages" / "ray"
    ray_dir.mkdir(parents=True)
    program = ray_dir / "raylet.py"
    program.write_text("import time\ntime.sleep(120)\n")
    other = tmp_path / "mine.py"
    other.write_text("import time\ntime.sleep(120)\n")
    session = f"--session-dir=/tmp/ray/session_2026-11-27_20-54-00_449534_{os.getpid()}"
    someone_elses = f"--session-dir=/tmp/ray/session_2026-11-27_20-54-00_449534_{os.getpid() + 1}"
    procs = {"ours": subprocess.Popen([sys.executable, str(program), session]),
             "another session": subprocess.Popen([sys.executable, str(program), someone_elses]),
             "not Ray's": subprocess.Popen([sys.executable, str(other), session])}
    try:
        assert _stop_ray_children(str(ray_dir)) == 1
        assert not psutil.pid_exists(procs["ours"].pid)  # killed and reaped by the wait
        for name in ("another session", "not Ray's"):
            assert procs[name].poll() is None, name
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)
