"""What every worker (prefill, decode, colocated) shares: one engine in a role, its KV connector, its loop."""

import ray
import torch

from kvtransfer import make_connector
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine_loop import EngineLoop
from pdserve.messages import ReplicaStats


class Replica:
    role: str  # "prefill" | "decode" | "colocated", set by the subclass

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str | None, cpu_threads: int,
                 ep=None):
        """`kv_backend` None: no KV connector. A colocated worker does both phases in its own
        engine, so its KV never leaves it; a connector would only register memory and open ports.
        `ep`: an EPExchange when this worker is one rank of an expert-parallel decode replica."""
        if engine_config.device == "cpu":
            torch.set_num_threads(cpu_threads)  # several workers share the host's cores
        self.name = name
        self.engine = Engine(engine_config, ep=ep)
        self.connector = None
        if kv_backend is not None:
            # Socket-based backends listen on this node's address, not loopback: peers may be elsewhere.
            kw = {"host": ray.util.get_node_ip_address()} if kv_backend in ("tcp", "cuda_ipc") else {}
            self.connector = make_connector(self.role, kv_backend, name, self.engine.kv_cache, self.engine.layout,
                                            self.engine.fingerprint, **kw)
        self.aborted = 0

    def _start_loop(self) -> None:
        self.loop = EngineLoop(self._step, f"{self.name}-engine")

    def _step(self) -> float | None:
        raise NotImplementedError

    def ready(self) -> bool:
        return self.loop.alive()

    def metadata(self) -> bytes:
        """The KV handshake this replica publishes."""
        return self.connector.metadata()

    def add_peer(self, meta: bytes) -> str:
        """Handshake with a replica of the other role; raises HandshakeError on a mismatch."""
        with self.loop.lock:  # the loop's step polls the connector, and NIXL's agent is not thread-safe
            return self.connector.add_peer(meta)

    def stats(self) -> ReplicaStats:
        if not self.loop.alive():  # the router then counts this replica as down (/health 503)
            raise RuntimeError(f"{self.name}: the engine loop stopped: {self.loop.error!r}")
        e = self.engine
        return ReplicaStats(self.name, self.role, len(e.scheduler.running), len(e.scheduler.waiting),
                            e.pool.num_free_blocks, e.pool.num_blocks, self.aborted)
