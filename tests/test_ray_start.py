"""A local Ray node that missed Ray's registration deadline is stopped before the next try."""

import subprocess
import sys

import psutil

from pdserve.control.ray_start import _stop_ray_children


def test_only_the_children_running_rays_programs_are_stopped(tmp_path):
    ray_dir = tmp_path / "site-packages" / "ray"
    ray_dir.mkdir(parents=True)
    program = ray_dir / "raylet.py"
    program.write_text("import time\ntime.sleep(120)\n")
    other = tmp_path / "mine.py"
    other.write_text("import time\ntime.sleep(120)\n")
    ray_like = subprocess.Popen([sys.executable, str(program)])
    mine = subprocess.Popen([sys.executable, str(other)])
    try:
        assert _stop_ray_children(str(ray_dir)) == 1
        assert not psutil.pid_exists(ray_like.pid)  # killed and reaped by the wait
        assert mine.poll() is None and psutil.pid_exists(mine.pid)
    finally:
        for p in (ray_like, mine):
            p.kill()
            p.wait(timeout=10)
