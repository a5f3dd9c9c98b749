"""Start `pdserve up FILE` as a user would (a subprocess), wait until it serves, stop it with Ctrl-C."""

import os
import re
import subprocess
import sys
import time

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.benchmarks.up_process import ClusterStartError, UpProcess


class Cluster:
    def __init__(self, tmp_path, admin_key: str | None = None, env: dict[str, str] | None = None, **sections):
        """admin_key: an admin API key of the cluster's keys file, sent to read /metrics (with keys on,
        /metrics is an admin's); env: variables added to `pdserve up`'s environment (Ray's processes
        inherit them)."""
        self.headers = {"authorization": f"Bearer {admin_key}"} if admin_key else {}
        # Port 0: the router binds any free port and `pdserve up` prints it (no port picked here
        # that another test could take first).
        cfg = {"router": {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0}}
        # PDSERVE_TEST_ROUTERS=3 runs every serving test through three routers on one port.
        if routers := os.environ.get("PDSERVE_TEST_ROUTERS"):
            cfg["router"]["replicas"] = int(routers)
        if "colocated" not in sections:  # a colocated cluster has no prefill or decode replicas to size
            cfg |= {"prefill": {"num_kv_blocks": 512}, "decode": {"num_kv_blocks": 512}}
        for key, value in sections.items():
            cfg.setdefault(key, {}).update(value)
        self.path = tmp_path / "cluster.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.up = UpProcess(self.path, tmp_path / "pdserve-up.log", env=os.environ | env if env else None)
        self.proc = self.up.proc
        self.url: str | None = None  # known once it serves
        self.grpc_address: str | None = None

    def wait_ready(self, timeout: float = 240) -> None:
        try:
            self.url = self.up.wait_healthy(None, timeout)
        except ClusterStartError as e:
            raise RuntimeError(f"{e}:\n{self.output()}") from e
        self.grpc_address = self.up.endpoints().get("grpc")

    def router_urls(self) -> dict[str, str]:
        """Each router's own HTTP address (router.replicas > 1), from `pdserve up`'s output."""
        out = {}
        for line in self.output().splitlines():
            if ": own http " in line:
                name, rest = line.split(": own http ", 1)
                out[name.rsplit(" ", 1)[1]] = rest.split()[0]
        return out

    def status(self) -> str:
        """`pdserve status` of this cluster, as an operator reads it."""
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--address", self.up.ray_address()],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    def pid(self, name: str) -> int:
        """The process of a replica (or router) as `pdserve status` shows it: `name (pid N)`."""
        text = self.status()
        for line in text.splitlines():
            if line.startswith(f"{name} (pid "):
                return int(line.split("(pid ", 1)[1].split(")", 1)[0])
        raise AssertionError(f"{name} not in `pdserve status`:\n{text}")

    def cli(self, *args: str, timeout: float = 300, nice: int = 10) -> subprocess.CompletedProcess:
        """`pdserve ARGS --address <this cluster>`, at nice 10: an operator's command joins Ray (~1.4 s of
        CPU), which on the test's 2 cores the serving replicas would feel (the chaos cases' TTFT bound
        missed by 6–40 ms, twice); an operator's terminal is not the serving host's cores. (Where the
        cores are saturated that share is ~3 %: the join then takes 45 s. `nice=0` where that matters.)"""
        return subprocess.run([sys.executable, "-m", "pdserve.cli", *args, "--address", self.up.ray_address()],
                              capture_output=True, text=True, timeout=timeout, preexec_fn=lambda: os.nice(nice))

    def output(self) -> str:
        """What `pdserve up` printed so far (also after stop)."""
        return self.up.output()

    def noted(self, text: str) -> bool:
        """Whether `pdserve up` printed `text`: the cheap first condition of a poll of `pdserve status`,
        whose every call is a process joining Ray (2 s, 1.4 s of CPU on 2 cores, taken from the
        replacement being waited for)."""
        return text in self.output()

    def replacements(self, name: str) -> int:
        """How many times `pdserve up` printed a replica or router replaced ("pdserve-decode-0 replaced
        (...)", "pdserve-router-1@2 replaced ..."): one a restart, printed once it serves again."""
        return len(re.findall(rf"(?m)^\[pdserve\] \S+ {re.escape(name)}(?:@\d+)? replaced\b", self.output()))

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C, as a user stops it; returns the exit code."""
        return self.up.stop(timeout)[0]

    def metrics(self) -> str:
        """The cluster's /metrics text. With several routers each counts what it served: their
        counters and histograms add up; a gauge (a replica's load, as every router polls it) is the
        highest of theirs. A dead router's figures are gone with it."""
        urls = list(self.router_urls().values()) or [self.url]
        if len(urls) == 1:
            return httpx.get(f"{urls[0]}/metrics", headers=self.headers, timeout=10).text
        values: dict[str, float] = {}
        for url in urls:
            try:
                text = httpx.get(f"{url}/metrics", headers=self.headers, timeout=10).text
            except httpx.ConnectError:  # a router that was killed (test_routers)
                continue
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
                    key = f"{sample.name}{{{labels}}}" if labels else sample.name
                    before = values.get(key)
                    if before is None:
                        values[key] = sample.value
                    else:
                        values[key] = max(before, sample.value) if family.type == "gauge" else before + sample.value
        return "\n".join(f"{k} {v}" for k, v in values.items()) + "\n"

    def replica_stats(self) -> dict[str, dict]:
        """Per-replica KV block usage, as /metrics reports it."""
        text = self.metrics()
        out: dict[str, dict] = {}
        for line in text.splitlines():
            for name in ("pdserve_kv_blocks_used", "pdserve_kv_blocks_total"):
                if line.startswith(name + "{"):
                    replica = line.split('replica="', 1)[1].split('"', 1)[0]
                    out.setdefault(replica, {})[name.rsplit("_", 1)[1]] = float(line.rsplit(" ", 1)[1])
        return out

    def wait_idle(self, timeout: float = 30) -> dict[str, dict]:
        """Until every replica's KV blocks are back to idle (used == 0); returns the last stats."""
        deadline = time.time() + timeout
        while True:
            stats = self.replica_stats()
            if stats and all(s.get("used") == 0 for s in stats.values()) or time.time() > deadline:
                return stats
            time.sleep(0.3)


def until(check, timeout_s: float = 20, what: str = "the condition"):
    """Poll `check` until it returns something true (returned), at most timeout_s."""
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.3)
    return result
