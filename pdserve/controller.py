"""The controller: a named, detached Ray actor that owns the cluster's desired state.

It starts the replicas and the router, introduces every prefill replica to every decode replica
(the KV handshake), reports status, and stops everything on `shutdown`.
"""

import os
import time

import ray

from pdserve.config import ClusterConfig

NAMESPACE = "pdserve"
CONTROLLER = "pdserve-controller"


class Controller:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.state = "starting"
        self.progress: list[str] = []
        self.endpoints: dict[str, str] = {}
        self.prefill: dict[str, ray.actor.ActorHandle] = {}
        self.decode: dict[str, ray.actor.ActorHandle] = {}
        self.router = None

    def start(self) -> dict[str, str]:
        """Start replicas and router; returns the endpoints once every replica is ready."""
        from decode.worker import DecodeWorker
        from prefill.worker import PrefillWorker
        from router.server import Router

        cfg = self.config
        n = cfg.prefill.replicas + cfg.decode.replicas
        threads = max(1, (os.cpu_count() or 1) // n)
        for i in range(cfg.prefill.replicas):
            name = f"pdserve-prefill-{i}"
            self.prefill[name] = ray.remote(PrefillWorker).options(
                name=name, num_cpus=0, num_gpus=cfg.prefill.gpus, max_concurrency=8).remote(
                name, cfg.engine_config("prefill"), cfg.kv_transfer.backend, threads)
        for i in range(cfg.decode.replicas):
            name = f"pdserve-decode-{i}"
            self.decode[name] = ray.remote(DecodeWorker).options(
                name=name, num_cpus=0, num_gpus=cfg.decode.gpus, max_concurrency=8).remote(
                name, cfg.engine_config("decode"), cfg.kv_transfer.backend, cfg.kv_transfer.lease_s,
                NAMESPACE, threads)
        self._note(f"loading {cfg.model.path} on {n} replicas")
        pending = {w.ready.remote(): name for name, w in [*self.prefill.items(), *self.decode.items()]}
        while pending:
            done, _ = ray.wait(list(pending), timeout=1.0)
            for ref in done:
                ray.get(ref)  # raises the replica's own error (bad model, out of memory, ...)
                self._note(f"{pending.pop(ref)} ready ({n - len(pending)}/{n})")
        metas = {name: ray.get(w.metadata.remote()) for name, w in [*self.prefill.items(), *self.decode.items()]}
        for p, pw in self.prefill.items():
            for d, dw in self.decode.items():
                ray.get([pw.add_peer.remote(metas[d]), dw.add_peer.remote(metas[p])])
        self._note(f"KV handshake done ({cfg.kv_transfer.backend})")
        self.router = ray.remote(Router).options(name="pdserve-router-0", num_cpus=0).remote(
            "pdserve-router-0", cfg, list(self.prefill), list(self.decode), NAMESPACE)
        self.endpoints = ray.get(self.router.start.remote())
        self.state = "running"
        self._note("router listening: " + ", ".join(f"{k} {v}" for k, v in self.endpoints.items()))
        return self.endpoints

    def status(self) -> dict:
        replicas = {}
        for name, w in [*self.prefill.items(), *self.decode.items()]:
            try:
                replicas[name] = ray.get(w.stats.remote(), timeout=5)
            except Exception as e:
                replicas[name] = f"unreachable: {type(e).__name__}"
        return {"state": self.state, "progress": list(self.progress), "endpoints": self.endpoints,
                "replicas": replicas}

    def shutdown(self) -> None:
        self.state = "stopping"
        if self.router is not None:
            try:
                ray.get(self.router.stop.remote(), timeout=10)
            except Exception:
                pass
        for h in [self.router, *self.prefill.values(), *self.decode.values()]:
            if h is not None:
                ray.kill(h)
        self.state = "stopped"

    def _note(self, line: str) -> None:
        self.progress.append(f"{time.strftime('%H:%M:%S')} {line}")
