"""The decode worker (a Ray actor): the engine in its decode role. Requests arrive as
reservations, their KV through kvtransfer; new tokens go back to each router once per step."""

from collections import defaultdict

import ray
import torch

from decode.kv_intake import KVIntake
from kvtransfer import make_connector
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine_loop import EngineLoop
from pdserve.messages import ReplicaStats, RequestDelta, ReserveResult


IDLE_S = 0.1  # nap of an idle worker; a reservation wakes it at once
KV_POLL_S = 0.002


class DecodeWorker:
    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str, lease_s: float,
                 namespace: str, cpu_threads: int = 1):
        if engine_config.device == "cpu":
            torch.set_num_threads(cpu_threads)
        self.name = name
        self.namespace = namespace
        self.engine = Engine(engine_config)
        self.connector = make_connector("decode", kv_backend, name, self.engine.kv_cache, self.engine.layout,
                                        self.engine.fingerprint)
        self.intake = KVIntake(self.engine, self.connector, lease_s)
        self.owner: dict[str, str] = {}  # request id -> the router streaming it
        self._routers: dict[str, ray.actor.ActorHandle] = {}
        self.aborted = 0
        self.loop = EngineLoop(self._step, f"{name}-engine")

    def ready(self) -> bool:
        return self.loop.alive()

    def metadata(self) -> bytes:
        return self.connector.metadata()

    def add_peer(self, meta: bytes) -> str:
        return self.connector.add_peer(meta)

    def reserve(self, request_id: str, prompt_ids: list[int], params: SamplingParams, prefill_id: str,
                router: str) -> ReserveResult:
        """Blocks for the prompt's KV under a lease; handle None when this replica is full."""
        with self.loop.lock:
            try:
                handle = self.intake.reserve(request_id, prompt_ids, params, prefill_id)
            except InvalidRequestError as e:
                return ReserveResult(None, str(e), e.param)
            if handle is not None:
                self.owner[request_id] = router
        self.loop.wake()
        return ReserveResult(handle.pack() if handle else None)

    def abort(self, request_id: str) -> None:
        with self.loop.lock:
            if self.owner.pop(request_id, None) is not None:
                self.intake.abort(request_id)
                self.aborted += 1

    def stats(self) -> ReplicaStats:
        e = self.engine
        return ReplicaStats(self.name, "decode", len(e.scheduler.running), len(e.scheduler.waiting),
                            e.pool.num_free_blocks, e.pool.num_blocks, self.aborted)

    def _step(self) -> float | None:
        if not self.owner:
            return IDLE_S
        batches: dict[str, list[RequestDelta]] = defaultdict(list)
        for rid in self.intake.poll():  # their KV never came: the router hears it failed
            router = self.owner.pop(rid, None)
            if router:
                batches[router].append(RequestDelta(rid, "", [], "error", "the KV transfer from the prefill replica failed"))
        for out in self.engine.step():
            router = self.owner.get(out.request_id)
            if router is None:
                continue
            reason = out.finish_reason.value if out.finish_reason else None
            batches[router].append(RequestDelta(out.request_id, out.text, out.token_ids, reason,
                                                logprobs=out.logprobs))
            if out.finished:
                del self.owner[out.request_id]
        # One message per router per step, never one per token.
        for router, deltas in batches.items():
            self._router(router).deliver.remote(deltas)
        # Only reservations waiting for their KV: poll the connector every few milliseconds.
        return None if self.engine.has_unfinished() else KV_POLL_S

    def _router(self, name: str):
        h = self._routers.get(name)
        if h is None:
            h = self._routers[name] = ray.get_actor(name, namespace=self.namespace)
        return h
