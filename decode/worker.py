"""The decode worker (a Ray actor): the engine in its decode role. Requests arrive as
reservations, their KV through kvtransfer; new tokens go back to each router once per step.

A worker is a whole decode replica, or one rank of an expert-parallel one (decode/ep_group.py):
then it owns its requests and their KV, and steps in lockstep with the other ranks."""

from collections import defaultdict

import ray
import torch

from decode.ep_group import IDLE, RUNNING, WAITING_FOR_KV, EPGroup, EPRank
from decode.kv_intake import KVIntake
from pdserve.config import EngineConfig
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.messages import ReplicaStats, RequestDelta, ReserveResult
from pdserve.models import resolve_model_args
from pdserve.replica import Replica


IDLE_S = 0.1  # nap of an idle worker; a reservation wakes it at once
# An idle expert-parallel group naps less: a reservation wakes only its own rank, and the step
# waits for the others to wake on their own.
EP_IDLE_S = 0.02
KV_POLL_S = 0.002


class DecodeWorker(Replica):
    role = "decode"

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str, lease_s: float,
                 namespace: str, cpu_threads: int = 1, ep: EPRank | None = None):
        self.ep: EPGroup | None = None
        if ep is not None:  # returns once every rank of the group has joined
            num_experts = resolve_model_args(engine_config.model.path).num_experts
            self.ep = EPGroup(ep, num_experts, torch.device(engine_config.device))
        super().__init__(name, engine_config, kv_backend, cpu_threads, ep=self.ep.exchange if self.ep else None)
        self.namespace = namespace
        self._naps = {RUNNING: None, WAITING_FOR_KV: KV_POLL_S, IDLE: EP_IDLE_S if self.ep else IDLE_S}
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

    def stats(self) -> ReplicaStats:
        s = super().stats()
        if self.ep is not None:
            with self.loop.lock:  # not halfway through a step's counting
                s.expert_tokens, s.expert_tokens_step = self.ep.exchange.expert_load()
        return s

    def _step(self) -> float | None:
        if self.ep is None and not self.owner:
            return IDLE_S
        batches: dict[str, list[RequestDelta]] = defaultdict(list)
        # Only with reservations: an idle rank of a group still steps, but must not touch the
        # connector (NIXL's agent is not thread-safe, and a handshake may be running).
        for rid in self.intake.poll() if self.owner else []:  # their KV never came: the router hears it failed
            router = self.owner.pop(rid, None)
            if router:
                batches[router].append(RequestDelta(rid, "", [], "error", "the KV transfer from the prefill replica failed"))
        if self.ep is None:
            outputs = self.engine.step()
            busy = self._busy()
        else:  # every step of the group, whether this rank has requests or not
            outputs, busy = self.ep.step(self.engine, self._busy())
        for out in outputs:
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
        # No nap while requests run; a few milliseconds while reservations wait for their KV. An
        # expert-parallel rank naps as its busiest rank says, so that the group stays in step.
        return self._naps[busy]

    def _busy(self) -> int:
        return RUNNING if self.engine.has_unfinished() else WAITING_FOR_KV if self.owner else IDLE

    def _router(self, name: str):
        h = self._routers.get(name)
        if h is None:
            h = self._routers[name] = ray.get_actor(name, namespace=self.namespace)
        return h
