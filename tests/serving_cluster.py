"""Start `pdserve up FILE` as a user would (a subprocess), wait until it serves, stop it with Ctrl-C."""

import socket
import time

import httpx
import yaml

from pdserve.benchmarks.up_process import ClusterStartError, UpProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    def __init__(self, tmp_path, **sections):
        self.http_port, self.grpc_port = free_port(), free_port()
        cfg = {"router": {"host": "127.0.0.1", "http_port": self.http_port, "grpc_port": self.grpc_port}}
        if "colocated" not in sections:  # a colocated cluster has no prefill or decode replicas to size
            cfg |= {"prefill": {"num_kv_blocks": 512}, "decode": {"num_kv_blocks": 512}}
        for key, value in sections.items():
            cfg.setdefault(key, {}).update(value)
        self.path = tmp_path / "cluster.yaml"
        self.path.write_text(yaml.safe_dump(cfg))
        self.up = UpProcess(self.path, tmp_path / "pdserve-up.log")
        self.proc = self.up.proc
        self.url = f"http://127.0.0.1:{self.http_port}"

    def wait_ready(self, timeout: float = 240) -> None:
        try:
            self.up.wait_healthy(self.url, timeout)
        except ClusterStartError as e:
            raise RuntimeError(f"{e}:\n{self.output()}") from e

    def output(self) -> str:
        """What `pdserve up` printed so far (also after stop)."""
        return self.up.output()

    def stop(self, timeout: float = 60) -> int:
        """Ctrl-C, as a user stops it; returns the exit code."""
        return self.up.stop(timeout)[0]

    def replica_stats(self) -> dict[str, dict]:
        """Per-replica KV block usage, as /metrics reports it."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
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
