"""What every worker (prefill, decode, colocated) shares: one engine in a role, its KV connector, its loop."""

import os

import ray
import torch

from pdserve.kvtransfer import make_connector
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.inbox import Abort
from pdserve.messages import Refusal, ReplicaStats
from pdserve.protocol import InvalidRequestError


# Set (by the controller, for cuda_ipc) in a worker's environment: Ray leaves every GPU visible.
ALL_GPUS_VISIBLE = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def assigned_device(device: str) -> str:
    """The worker's device. Ray normally shows a worker only its own GPU ("cuda" is it); with every
    GPU visible the worker must pick the one Ray assigned it."""
    if device == "cuda" and os.environ.get(ALL_GPUS_VISIBLE):
        return f"cuda:{int(ray.get_gpu_ids()[0])}"
    return device


class Replica:
    role: str  # "prefill" | "decode" | "colocated", set by the subclass

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str | None, cpu_threads: int,
                 ep=None):
        """`kv_backend` None: no KV connector. A colocated worker does both phases in its own
        engine, so its KV never leaves it; a connector would only register memory and open ports.
        `ep`: an EPExchange when this worker is one rank of an expert-parallel decode replica."""
        if engine_config.device == "cpu":
            torch.set_num_threads(cpu_threads)  # several workers share the host's cores
        engine_config = engine_config.model_copy(update={"device": assigned_device(engine_config.device)})
        self.name = name
        self.engine = Engine(engine_config, ep=ep)
        self.connector = None
        if kv_backend is not None:
            # Socket-based backends listen on this node's address, not loopback: peers may be elsewhere.
            kw = {"host": ray.util.get_node_ip_address()} if kv_backend == "tcp" else {}
            self.connector = make_connector(self.role, kv_backend, name, self.engine.kv_cache, self.engine.layout,
                                            self.engine.fingerprint, **kw)
        self.aborted = 0

    def _start_loop(self) -> None:
        self.loop = EngineLoop(self._step, self._take, f"{self.name}-engine")

    def _step(self) -> float | None:
        raise NotImplementedError

    def _take(self, item) -> None:
        """Apply one inbox item (pdserve/worker/inbox.py) on the loop's thread."""
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests here (their clients left, or they failed elsewhere); returns at once."""
        for rid in request_ids:
            self.loop.submit(Abort(rid))

    def _refusal(self, prompt_ids: list[int]) -> Refusal | None:
        """A prompt this replica can never run, as the router's 400; checked on the caller's
        thread, so that a call that brings work can answer at once."""
        try:
            self.engine.check_request(prompt_ids)
        except InvalidRequestError as e:
            return Refusal.of(e)
        return None

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
        if self.connector is not None and self.connector.error is not None:  # down too: no KV moves
            raise RuntimeError(f"{self.name}: the KV connector failed: {self.connector.error!r}")
        e = self.engine
        return ReplicaStats(self.name, self.role, len(e.scheduler.running), len(e.scheduler.waiting),
                            e.pool.num_free_blocks, e.pool.num_blocks, self.aborted, pid=os.getpid())
