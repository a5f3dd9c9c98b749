"""Ray's console log (pdserve/control/ray_console.py) is bounded: past MAX_BYTES a command starts it
afresh and keeps the old lines once as FILE.1. Run in a child: divert repoints the process's stderr."""

import os
import subprocess
import sys

CHILD = r"""
import sys
from pdserve.control import ray_console
ray_console.MAX_BYTES = 1000
print(ray_console.divert("test"), flush=True)
sys.stderr.write("to the terminal\n")
"""


def test_the_log_starts_afresh_past_its_size_and_keeps_one_old_file(tmp_path):
    log = tmp_path / "ray-console.log"
    env = {**os.environ, "PDSERVE_RAY_LOG": str(log)}

    def command() -> None:
        r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == str(log), r.stderr
        assert "to the terminal" in r.stderr

    command()
    small = log.read_text()
    assert small.startswith("--- pdserve test") and not (tmp_path / "ray-console.log.1").exists()
    command()  # under the size: appended
    assert log.read_text().count("--- pdserve test") == 2
    log.write_text("x" * 2000)  # past it: the next command starts afresh
    command()
    assert (tmp_path / "ray-console.log.1").read_text() == "x" * 2000
    assert log.read_text().count("--- pdserve test") == 1 and "x" not in log.read_text()
