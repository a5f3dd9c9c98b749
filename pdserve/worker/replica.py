"""What every worker (prefill, decode, colocated) shares: one engine in a role, its KV connector, its loop."""

import os
import sys
import time

import ray
import torch

from pdserve import heap
from pdserve.kvtransfer import make_connector
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.inbox import Abort, Reserve
from pdserve.messages import NewRequest, Refusal, ReplicaStats, ReserveResult, WorkerStartup
from pdserve.protocol import InvalidRequestError


EARLY_ABORTS = 1024  # aborts remembered for requests not come yet, before old ones are forgotten
EARLY_ABORT_S = 60.0  # a request handed over arrives within seconds of its abort: older ones never will

# Set (by the controller, for cuda_ipc) in a worker's environment: Ray leaves every GPU visible.
ALL_GPUS_VISIBLE = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def assigned_device(device: str) -> str:
    """The worker's device. Ray normally shows a worker only its own GPU ("cuda" is it); with every
    GPU visible the worker must pick the one Ray assigned it."""
    if device == "cuda" and os.environ.get(ALL_GPUS_VISIBLE):
        return f"cuda:{int(ray.get_gpu_ids()[0])}"
    return device


def _in_actor() -> bool:
    """Whether this process is a worker's own (a Ray actor), not a test or benchmark holding an engine."""
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


class Replica:
    role: str  # "prefill" | "decode" | "colocated", set by the subclass

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str | None, cpu_threads: int,
                 ep=None):
        """`kv_backend` None: no KV connector. A colocated worker does both phases in its own
        engine, so its KV never leaves it; a connector would only register memory and open ports.
        `ep`: an EPExchange when this worker is one rank of an expert-parallel decode replica."""
        self._began = (time.time(), time.perf_counter())  # for startup(): the process is up, its imports done
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
        """Called by the role's __init__ once it has built everything; the loop starts serving."""
        if _in_actor():  # (a worker built in a test's own process leaves that process's collector be)
            heap.settle()  # the engine, its KV cache and connector are built: no collection walks them (heap.py)
        self._early_aborts: dict[str, float] = {}  # request id -> when its abort came, before the request
        self.loop = EngineLoop(self._step, self._admit, f"{self.name}-engine", on_death=self._engine_died)
        self._ready_s = time.perf_counter() - self._began[1]

    def _admit(self, item) -> None:
        """Take one inbox item. Ray runs a worker's calls on many threads, so a request's abort (its
        client left while the request was being handed over) may reach the inbox before the
        request: it is remembered a while, and the request is dropped when it comes, instead of
        holding KV blocks for a client that is gone."""
        rid = item.request_id
        if isinstance(item, Abort):
            if rid not in self.engine.seqs:
                now = time.monotonic()
                self._early_aborts[rid] = now
                if len(self._early_aborts) > EARLY_ABORTS:  # forget the oldest: their requests never came
                    for old in [r for r, t in self._early_aborts.items() if now - t > EARLY_ABORT_S]:
                        del self._early_aborts[old]
        elif self._early_aborts.pop(rid, None) is not None:
            if isinstance(item, Reserve):
                item.answer.set_result(ReserveResult(None, Refusal("request_id", "aborted before it was taken")))
            return
        self._take(item)

    def _engine_died(self, error: BaseException) -> None:
        """A worker whose engine loop died takes no more work: its process exits, so that every
        caller (routers, the controller) finds it dead at once, and the controller replaces it. (A
        worker built outside a Ray actor, in a test, keeps its process: stats() raises instead.)"""
        if _in_actor():
            sys.stderr.flush()
            os._exit(70)

    def _held(self) -> int:
        """Requests the role holds outside the engine (streams to routers, KV in flight)."""
        return 0

    def _step(self) -> float | None:
        raise NotImplementedError

    def _take(self, item) -> None:
        """Apply one inbox item (pdserve/worker/inbox.py) on the loop's thread."""
        raise NotImplementedError

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests here (their clients left, or they failed elsewhere); returns at once."""
        for rid in request_ids:
            self.loop.submit(Abort(rid))

    def _refusal(self, r: NewRequest) -> Refusal | None:
        """A request this replica can never run (its prompt, with a resumed request's output_ids),
        as the router's 400; checked on the caller's thread, so that a call that brings work can
        answer at once."""
        try:
            self.engine.check_request(r.prompt_ids, r.params, r.output_ids)
        except InvalidRequestError as e:
            return Refusal.of(e)
        return None

    def ready(self) -> bool:
        return self.loop.alive()

    def startup(self) -> WorkerStartup:
        """What this worker's start took (weights, graphs, the whole engine), once ready."""
        w = self.engine.load_stats
        return WorkerStartup(self.name, self._began[0], w.source, w.files, w.bytes, w.weights_s, w.total_s,
                             self.engine.graphs_s, self._ready_s)

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
                            e.pool.num_free_blocks, e.pool.num_blocks, self.aborted, pid=os.getpid(),
                            held=len(e.seqs) + self.loop.queued() + self._held(), profile=e.profile.snapshot())
