"""`pdserve up FILE` driven from a program, as a user runs it: a subprocess in a session of its own
(Ray's processes join its group, so a kill reaches them), its output in a log file, healthy once
/health answers, stopped with Ctrl-C. The P:D benchmark and the serving tests run clusters this way."""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx


class ClusterStartError(RuntimeError):
    """The cluster exited, or did not answer /health in time."""


class UpProcess:
    def __init__(self, path: Path | None, log_path: Path, command: list[str] | None = None,
                 env: dict[str, str] | None = None):
        """`pdserve up PATH`, or `pdserve COMMAND...` (e.g. ["serve", "tiny-moe", "--port", "0"]);
        env: its environment (default: this process's)."""
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        words = command if command is not None else ["up", str(path)]
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *words],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)

    def output(self) -> str:
        """What `pdserve up` printed so far (also after stop)."""
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def ray_address(self) -> str | None:
        """The Ray cluster `pdserve up` started or joined, from its "Ray at HOST:PORT" line."""
        for line in self.output().splitlines():
            if line.startswith("[pdserve] Ray at "):
                return line.rsplit(" ", 1)[1]
        return None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    def endpoints(self) -> dict[str, str]:
        """What `pdserve up` printed once serving: {"http": URL, "grpc": HOST:PORT}; empty before.
        The way to learn the ports when cluster.yaml asks for any free one (port 0)."""
        out = {}
        for line in self.output().splitlines():
            for kind in ("http", "grpc"):
                if line.startswith(f"[pdserve] {kind}: "):
                    out[kind] = line.split(": ", 1)[1].strip()
        return out

    def wait_healthy(self, url: str | None, timeout_s: float, progress: Callable[[str], None] | None = None,
                     every_s: float = 15.0) -> str:
        """Until GET url/health answers 200 (url None: the HTTP endpoint `pdserve up` prints); returns
        the url. `progress` hears the wait and the log's last line now and then."""
        t0 = shown = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise ClusterStartError(f"`pdserve up` exited with {self.proc.returncode} before serving")
            url = url or self.endpoints().get("http")
            try:
                if url and httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise ClusterStartError(f"`pdserve up` did not answer {url or 'its HTTP endpoint'}/health "
                                        f"in {timeout_s:.0f} s")
            if progress and now - shown >= every_s:
                shown = now
                last = self.tail(1).strip()
                progress(f"waiting for {url or 'the router'}/health, {now - t0:.0f} s{f' — {last}' if last else ''}")
            time.sleep(0.5)

    def stop(self, timeout_s: float) -> tuple[int, str]:
        """Ctrl-C; a cluster that does not stop in time gets its stacks dumped, then is killed.
        Returns (exit code, "interrupted" | "killed")."""
        how = "interrupted"
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                how = "killed"
                self.proc.send_signal(signal.SIGUSR1)  # `pdserve up` writes every thread's stack to its log
                time.sleep(2)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()
        return self.proc.returncode, how
