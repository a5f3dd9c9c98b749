"""The request lifecycle across replicas (DESIGN §3): reserve on a decode replica, prefill on a
prefill replica that streams the KV there, then relay the decode replica's per-step deltas. In a
colocated cluster one replica does both phases: hand it the request, relay its deltas."""

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.messages import Refusal, ReplicaStats, RequestDelta

from router.decode_replica import DecodeReplica
from router.types import Delta, GenerateRequest, NoCapacityError, ServingError

log = logging.getLogger(__name__)


class RayCore:
    def __init__(self, name: str, model_name: str, max_model_len: int, tokenizer,
                 prefill: dict[str, object], decode: dict[str, DecodeReplica], colocated: dict[str, object],
                 policy: str, metrics=None):
        """Replicas by name: prefill and decode ones (disaggregated), or colocated ones only."""
        self.name = name  # this router's actor name: where decode replicas send deltas
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.prefill = prefill  # replica name -> actor handle
        self.decode = decode  # replica name -> its rank(s)
        self.colocated = colocated  # replica name -> actor handle
        self.policy = policy
        self.metrics = metrics
        self.stats: dict[str, ReplicaStats] = {}
        self._rr = itertools.count()
        self._queues: dict[str, asyncio.Queue] = {}
        self._loads: dict[str, int] = {n: 0 for n in [*prefill, *decode, *colocated]}  # requests we placed there

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages)

    def ready(self) -> bool:
        live = {s.role for s in self.stats.values()}
        return "colocated" in live or {"prefill", "decode"} <= live

    def deliver(self, deltas: list[RequestDelta]) -> None:
        """A decode (or colocated) replica's output of one step, for the requests this router streams."""
        for d in deltas:
            q = self._queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Delta]:
        rid = request.request_id
        if len(request.prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"is {len(request.prompt_ids)} tokens; the model's context is "
                                                f"{self.max_model_len} tokens")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        placed: list[str] = []  # replicas whose count of our requests in flight this one raised
        holders: list = []  # workers holding the request: told to abort it if it does not finish
        finished = False
        try:
            start = self._start_colocated if self.colocated else self._start_disaggregated
            await start(request, placed, holders)
            dispatched, first = time.perf_counter(), True
            while not finished:
                d: RequestDelta = await queue.get()
                if first:
                    self._phase("first_token", dispatched)
                    first = False
                if d.finish_reason == "error":
                    finished = True
                    raise ServingError(d.error or "the request failed")
                finished = d.finish_reason is not None
                yield Delta(d.text, d.token_ids, d.finish_reason, d.logprobs)
        finally:
            self._queues.pop(rid, None)
            for name in placed:
                self._loads[name] -= 1
            if not finished:  # the client left: stop it everywhere (the front end counts the router's abort)
                for worker in holders:
                    worker.abort.remote(rid)

    async def _start_disaggregated(self, request: GenerateRequest, placed: list[str], holders: list) -> None:
        """Reserve KV on a decode replica, then have a prefill replica stream the prompt's KV there."""
        p_name = self._pick(self.prefill)
        self._place(p_name, placed)
        t0 = time.perf_counter()
        d_name, d_rank, handle = await self._reserve(request, p_name)
        t1 = self._phase("reserve", t0)
        self._place(d_name, placed)
        holders += [self.decode[d_name].ranks[d_rank], self.prefill[p_name]]
        await self.prefill[p_name].prefill.remote(request.request_id, request.prompt_ids, request.params, handle)
        self._phase("dispatch", t1)

    async def _start_colocated(self, request: GenerateRequest, placed: list[str], holders: list) -> None:
        """Hand the whole request to the least-loaded colocated replica. Not by free KV blocks as
        for decode: a colocated replica never refuses (it queues), so a burst routed by stats up to
        0.5 s old would all land on one replica; the requests in flight from us are exact."""
        name = self._pick(self.colocated)
        self._place(name, placed)
        worker = self.colocated[name]
        holders.append(worker)  # before the call: a client leaving during it must still stop the request
        t0 = time.perf_counter()
        _raise_refused(await worker.generate.remote(request.request_id, request.prompt_ids, request.params,
                                                    self.name))
        self._phase("dispatch", t0)

    def _phase(self, phase: str, since: float) -> float:
        """Record that a request spent the time from `since` until now in `phase`; returns now."""
        now = time.perf_counter()
        if self.metrics:
            self.metrics.observe_phase(phase, now - since)
        return now

    async def _reserve(self, request: GenerateRequest, p_name: str) -> tuple[str, str, bytes]:
        """Reserve KV blocks on a decode replica's rank, best candidates first -> (replica, rank,
        handle); raises when all are full. The handle names the rank: the KV goes there."""
        for d_name in self._order(self.decode):
            replica = self.decode[d_name]
            for rank in replica.rank_order():
                res = await replica.ranks[rank].reserve.remote(request.request_id, request.prompt_ids,
                                                               request.params, p_name, self.name)
                _raise_refused(res.refused)
                if res.handle is not None:
                    return d_name, rank, res.handle
        raise NoCapacityError("every decode replica is full; retry later")

    def _place(self, name: str, placed: list[str]) -> None:
        self._loads[name] += 1
        placed.append(name)

    def _pick(self, replicas: dict) -> str:
        names = list(replicas)
        if self.policy == "round-robin":
            return names[next(self._rr) % len(names)]
        return min(names, key=lambda n: self._loads[n])  # fewest requests in flight from us

    def _order(self, replicas: dict) -> list[str]:
        """Decode replicas to try for a reservation, best candidates first."""
        names = list(replicas)
        if self.policy == "round-robin":
            k = next(self._rr) % len(names)
            return names[k:] + names[:k]
        # kv-aware: most free KV blocks first (as last reported), then fewest requests from us.
        return sorted(names, key=lambda n: (-getattr(self.stats.get(n), "free_blocks", 0), self._loads[n]))

    async def refresh_stats(self, interval_s: float = 0.5) -> None:
        """Keep replica stats (routing, /health, /metrics) fresh; runs for the router's life."""
        single = {**self.prefill, **self.colocated}  # replicas of one worker each
        while True:
            for name in [*single, *self.decode]:
                try:
                    if name in single:
                        s: ReplicaStats = await asyncio.wait_for(single[name].stats.remote(), timeout=5)
                    else:
                        s = await self.decode[name].fetch_stats(timeout_s=5)
                    before = self.stats.get(name)
                    self.stats[name] = s
                    if self.metrics:
                        self.metrics.set_replica_stats(s.role, s.name, s.running + s.waiting,
                                                       s.total_blocks - s.free_blocks, s.total_blocks)
                        for _ in range(s.aborted - (before.aborted if before else 0)):
                            self.metrics.count_abort(s.role)
                        new = s.transfers_total - (before.transfers_total if before else 0)
                        for nbytes, seconds in s.transfers[len(s.transfers) - min(new, len(s.transfers)):]:
                            self.metrics.observe_transfer(nbytes, seconds)
                        seen = before.expert_tokens if before else []
                        self.metrics.count_expert_tokens(s.name, [n - (seen[e] if e < len(seen) else 0)
                                                                  for e, n in enumerate(s.expert_tokens)])
                except Exception:
                    self.stats.pop(name, None)  # unreachable: not live
            await asyncio.sleep(interval_s)


def _raise_refused(refused: Refusal | None) -> None:
    """A worker refused the request itself (e.g. too long for its KV cache): the client's 400."""
    if refused is not None:
        raise refused.error()
