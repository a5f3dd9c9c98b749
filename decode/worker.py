"""The decode worker (a Ray actor): the engine in its decode role. Requests arrive as
reservations, their KV through kvtransfer; new tokens go back to each router once per step."""

from collections import defaultdict

import ray

from decode.kv_intake import KVIntake
from pdserve.config import EngineConfig
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.messages import RequestDelta, ReserveResult
from pdserve.replica import Replica


IDLE_S = 0.1  # nap of an idle worker; a reservation wakes it at once
KV_POLL_S = 0.002


class DecodeWorker(Replica):
    role = "decode"

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str, lease_s: float,
                 namespace: str, cpu_threads: int = 1):
        super().__init__(name, engine_config, kv_backend, cpu_threads)
        self.namespace = namespace
        self.intake = KVIntake(self.engine, self.connector, lease_s)
        self.owner: dict[str, str] = {}  # request id -> the router streaming it
        self._routers: dict[str, ray.actor.ActorHandle] = {}
        self._start_loop()

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
