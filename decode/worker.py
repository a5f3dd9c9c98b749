"""The decode worker (a Ray actor): the engine in its decode role. Requests arrive as
reservations, their KV through kvtransfer — or whole (`generate`), their prompt prefilled here
(local prefill: the router's choice, router/prefill_site.py); new tokens go back to each router
once per step.

A worker is a whole decode replica, or one rank of an expert-parallel one (decode/ep_group.py):
then it owns its requests and their KV, and steps in lockstep with the other ranks."""

import time

import torch

from pdserve.decode.ep_group import IDLE, RUNNING, WAITING_FOR_KV, EPGroup, EPRank
from pdserve.decode.kv_intake import KVIntake
from pdserve.config import EngineConfig
from pdserve.protocol import InvalidRequestError
from pdserve.worker.engine_loop import IDLE_S
from pdserve.messages import KV_FAILED, LOST, NewRequest, Refusal, ReplicaStats, ReserveResult, Unpaired
from pdserve.models import resolve_model_args
from pdserve.worker.inbox import Abort, Generate, Reserve
from pdserve.worker.engine_worker import EngineWorker, assigned_device
from pdserve.worker.router_streams import RouterStreams
from pdserve.worker.whole_requests import WholeRequests

# An idle expert-parallel group naps less: a reservation wakes only its own rank, and the step
# waits for the others to wake on their own.
EP_IDLE_S = 0.02
RESERVE_TIMEOUT_S = 60.0  # a loop that reaches no step boundary for this long is stuck
KV_POLL_S = 0.002
CUT_OFF_S = 5.0  # a flip's last deltas (the moves) reach routers that take them within this


class DecodeWorker(WholeRequests, EngineWorker):
    role = "decode"

    def __init__(self, name: str, engine_config: EngineConfig, kv_backend: str, lease_s: float,
                 namespace: str, cpu_threads: int = 1, ep: EPRank | None = None, cluster_token: str | None = None,
                 engine=None):
        """`engine`: a prefill worker's, taken over by a flip (EngineWorker)."""
        self.ep: EPGroup | None = None
        if ep is not None:  # returns once every rank of the group has joined
            num_experts = resolve_model_args(engine_config.model.path).num_experts
            self.ep = EPGroup(ep, num_experts, torch.device(assigned_device(engine_config.device)))
        super().__init__(name, engine_config, kv_backend, cpu_threads, ep=self.ep.exchange if self.ep else None,
                         cluster_token=cluster_token, engine=engine)
        self._naps = {RUNNING: None, WAITING_FOR_KV: KV_POLL_S, IDLE: EP_IDLE_S if self.ep else IDLE_S}
        self.intake = KVIntake(self.engine, self.connector, lease_s)
        # Every reservation, from reserve until finished; a dead router's are aborted here.
        self.streams = RouterStreams(namespace, orphaned=self.abort)
        self._start_loop()

    def reserve(self, requests: list[NewRequest], router: str) -> list[ReserveResult]:
        """Blocks for each prompt's KV under a lease; a handle None where this replica is full. The
        block pool answers at the next step boundary: the call waits for that, not for other calls."""
        items: list[Reserve | ReserveResult] = []
        for r in requests:
            refused = self._refusal(r)
            if refused is None and r.prefill_id and r.prefill_id not in self.connector.peers:
                # Its KV could never arrive (no handshake with that prefill worker): answered now, so
                # that the router reserves over another pair instead of waiting out a lease.
                items.append(ReserveResult(None, unpaired=Unpaired(self.name, r.prefill_id)))
                continue
            items.append(ReserveResult(None, refused) if refused else
                         Reserve(r.request, r.prefill_id, router))
            if isinstance(items[-1], Reserve):
                self.loop.submit(items[-1])
        deadline = time.monotonic() + RESERVE_TIMEOUT_S
        try:
            return [i.answer.result(timeout=max(0.0, deadline - time.monotonic())) if isinstance(i, Reserve) else i
                    for i in items]
        except TimeoutError:
            raise RuntimeError(f"{self.name}: the engine loop took no work for {RESERVE_TIMEOUT_S} s "
                               f"(alive: {self.loop.alive()})") from None

    def _take(self, item) -> None:
        match item:
            case Reserve():
                try:
                    handle = self.intake.reserve(item.request, item.prefill_id)
                except InvalidRequestError as e:  # what only the engine knows, e.g. an id in use
                    item.answer.set_result(ReserveResult(None, Refusal.of(e)))
                    return
                if handle is not None:
                    self.streams.add(item.request_id, item.router)
                item.answer.set_result(ReserveResult(handle.pack() if handle else None))
            case Generate():
                self._take_whole(item)
            case Abort() if self.streams.drop(item.request_id):
                self.intake.abort(item.request_id)  # (a local prefill's: the engine's abort)
                self.aborted += 1

    def stats(self) -> ReplicaStats:
        s = super().stats()
        s.kv_blocks_reused, s.kv_bytes_received = self.intake.blocks_reused, self.intake.bytes_received
        if self.ep is not None:
            with self.loop.lock:  # not halfway through a step's counting
                s.expert_tokens, s.expert_tokens_step = self.ep.exchange.expert_load()
        return s

    def _held(self) -> int:
        return len(self.streams) + int(self.intake.busy())

    def _cut_off(self, left: list) -> None:
        for item in left:
            match item:
                case Reserve():  # as if full: the router reserves elsewhere
                    item.answer.set_result(ReserveResult(None))
                case Generate():
                    self.streams.add(item.request_id, item.router)
        for rid in self.streams.requests():  # LOST: each router moves its request, tokens sent kept
            self.streams.fail(rid, f"the decode replica {self.name} changed role", LOST)
        deadline = time.monotonic() + CUT_OFF_S
        while self.streams.flush() and time.monotonic() < deadline:
            time.sleep(0.005)

    def _step(self) -> float | None:
        leases = bool(self.streams) or self.intake.busy()
        if self.ep is None and not leases:
            return self.streams.flush_nap(IDLE_S)  # the last tokens may still wait for a router
        # Only with leases: an idle rank of a group steps without touching the connector.
        for rid, why in self.intake.poll() if leases else []:  # their KV never came: the router hears why
            self.streams.fail(rid, why, KV_FAILED)
        if self.ep is None:
            outputs = self.engine.step()
            busy = self._busy()
        else:  # every step of the group, whether this rank has requests or not
            outputs, busy = self.ep.step(self.engine, self._busy())
        for out in outputs:
            self.streams.output(out)
        # No nap while requests run; a few milliseconds while reservations wait for their KV. An
        # expert-parallel rank naps as its busiest rank says, so that the group stays in step.
        return self.streams.flush_nap(self._naps[busy])

    def _busy(self) -> int:
        waiting = self.streams or self.intake.busy()
        return RUNNING if self.engine.has_unfinished() else WAITING_FOR_KV if waiting else IDLE
