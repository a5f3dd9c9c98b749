"""A Ray cluster of several nodes on this machine, for tests: a head and worker nodes started with
`ray start`, each on a loopback address of its own (127.0.0.2, 127.0.0.3, ...: to Ray and to the
KV backends they are different hosts), with custom resources and labels of its own.

Everything runs under a temporary directory of this cluster's (`--temp-dir`), and `stop()` ends
exactly the processes started here — those whose command line names that directory, and their
children — never a global `ray stop`, which would end every other Ray cluster on the machine.
Ports: the head's GCS takes any free one (`--port 0`), and every other port Ray opens is 0 or
retried by Ray itself (the dashboard).

Authentication as the README's recipe: token mode, the token in a secret file of this cluster's
(`RAY_AUTH_TOKEN_PATH`), the same for every node and for a driver (`env()`); `token=False` starts
a cluster without it (RAY_AUTH_MODE=disabled), for the tests of what refuses one.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

START_S = 120  # `ray start` of one node: seconds on an idle machine, more on 2 busy cores


@dataclass
class Node:
    name: str  # what its label pd-node says
    ip: str
    resources: dict[str, float]


@dataclass
class LocalRayCluster:
    nodes: list[Node]
    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pdrn-", dir="/tmp")))
    address: str = ""
    # How soon the head gives up a node whose heartbeats stop: period x threshold (Ray's default:
    # 3 s x 5); until then a call to an actor on it waits, unanswered.
    health_check_period_ms: int = 500
    health_check_failure_threshold: int = 4
    token: bool = True  # Ray's token authentication, as the README starts it

    def start(self) -> "LocalRayCluster":
        head, *workers = self.nodes
        try:
            self._ray_start(head, ["--head", "--port", "0", "--include-dashboard", "false", "--system-config",
                                   json.dumps({"health_check_period_ms": self.health_check_period_ms,
                                              "health_check_failure_threshold": self.health_check_failure_threshold})])
            self.address = (self.temp_dir / "ray_current_cluster").read_text().strip()
            for node in workers:
                self._ray_start(node, ["--address", self.address])
        except BaseException:
            self.stop()
            raise
        return self

    def env(self) -> dict[str, str]:
        """The environment a driver (`pdserve up`) joining this cluster runs in: token auth, as the
        nodes were started with, and this checkout on the path of every process."""
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
        env["RAY_AUTH_MODE"] = "token" if self.token else "disabled"
        if self.token:
            env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path())
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        return env

    def token_path(self) -> Path:
        """The cluster's secret: made once, readable by this user alone (the README's `umask 077`)."""
        path = self.temp_dir / "ray-token"
        if not path.exists():
            path.touch(mode=0o600)
            path.write_text(secrets.token_hex(32) + "\n")
        return path

    def _ray_start(self, node: Node, args: list[str]) -> None:
        cmd = [str(Path(sys.executable).parent / "ray"), "start", *args, "--node-ip-address", node.ip,
               "--temp-dir", str(self.temp_dir), "--num-cpus", "1", "--resources", json.dumps(node.resources),
               "--labels", f"pd-node={node.name}", "--dashboard-agent-listen-port", "0",
               "--disable-usage-stats"]
        r = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=START_S)
        if r.returncode:
            raise RuntimeError(f"ray start ({node.name}, {node.ip}) failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")

    def processes(self) -> list[psutil.Process]:
        """This cluster's processes: those naming its temp dir, and all their descendants (workers
        rename themselves `ray::...`, but stay the raylet's children)."""
        me = psutil.Process()
        spared = {me.pid, *(p.pid for p in me.parents())}  # (a test's own command line may name the dir)
        mine: dict[int, psutil.Process] = {}
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.pid not in spared and any(str(self.temp_dir) in part for part in p.info["cmdline"] or []):
                    mine[p.pid] = p
                    mine |= {c.pid: c for c in p.children(recursive=True) if c.pid not in spared}
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return list(mine.values())

    def kill_node(self, ip: str) -> None:
        """A node dies: SIGKILL to its raylet and everything under it (its workers, its agents)."""
        victims = [p for p in self.processes()
                   if any(f"node_ip_address={ip}" in part or f"node-ip-address={ip}" in part
                          for part in _cmdline(p))]
        for p in {q.pid: q for v in victims for q in [v, *v.children(recursive=True)]}.values():
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self, timeout_s: float = 5) -> None:
        """End this cluster's processes: SIGTERM, then SIGKILL to what is left after timeout_s."""
        procs = self.processes()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, procs = psutil.wait_procs(procs, timeout=timeout_s)
            if not procs:
                break
        deadline = time.monotonic() + timeout_s
        while self.processes() and time.monotonic() < deadline:  # children started meanwhile
            for p in self.processes():
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
