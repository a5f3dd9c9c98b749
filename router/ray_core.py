"""The request lifecycle across replicas: reserve on a decode replica, prefill on a
prefill replica that streams the KV there, then relay the decode replica's per-step deltas. In a
colocated cluster one replica does both phases: hand it the request, relay its deltas."""

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator

from ray.exceptions import ActorDiedError

from pdserve.protocol import InvalidRequestError
from pdserve.messages import NewRequest, Refusal, ReplicaStats, RequestDelta

from pdserve.router.decode_replica import DecodeReplica
from pdserve.router.handoff import HandOff
from pdserve.router.replica_health import ReplicaHealth
from pdserve.router.types import Delta, GenerateRequest, NoCapacityError, ReplicaUnavailableError, ServingError

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
        # One hand-off per worker and kind of call: a turn's requests go out in one Ray call.
        self._send_prefill = {n: HandOff(w.prefill.remote) for n, w in prefill.items()}
        self._send_generate = {n: HandOff(lambda items, w=w: w.generate.remote(items, name))
                               for n, w in colocated.items()}
        self._send_reserve = {rank: HandOff(lambda items, w=w: w.reserve.remote(items, name))
                         for d in decode.values() for rank, w in d.ranks.items()}
        self._send_abort = {n: HandOff(w.abort.remote, answered=False)
                       for n, w in [*prefill.items(), *colocated.items(),
                                    *((r, w) for d in decode.values() for r, w in d.ranks.items())]}
        self.health = ReplicaHealth({**{n: "prefill" for n in prefill}, **{n: "decode" for n in decode},
                                     **{n: "colocated" for n in colocated}})

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, **(template_kwargs or {}))

    def ready(self) -> bool:
        live = {s.role for s in self.stats.values()}
        return "colocated" in live or {"prefill", "decode"} <= live

    def in_flight(self) -> int:
        """Requests this router streams now."""
        return len(self._queues)

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
        holders: dict[str, str] = {}  # replica -> its worker (rank) holding the request: aborted there if unfinished
        finished = False
        try:
            start = self._start_colocated if self.colocated else self._start_disaggregated
            await start(request, queue, placed, holders)
            dispatched, first = time.perf_counter(), True
            while not finished:
                d: RequestDelta = await queue.get()
                if first:
                    self._phase("first_token", dispatched)
                    for name in self.prefill.keys() & holders.keys():  # its part is done
                        self.health.done_with(name, rid)
                    first = False
                if d.finish_reason == "error":  # left unfinished: the live holders drop it too
                    raise ServingError(d.error or "the request failed")
                finished = d.finish_reason is not None
                yield Delta(d.text, d.token_ids, d.finish_reason, d.logprobs, more=not queue.empty())
        finally:
            self._queues.pop(rid, None)
            for name in placed:
                self._loads[name] -= 1
            for name in holders:
                self.health.done_with(name, rid)
            if not finished:  # the client left, or it failed: stop it everywhere
                for worker in (w for n, w in holders.items() if n not in self.health.down):
                    self._send_abort[worker](rid)

    async def _start_disaggregated(self, request: GenerateRequest, queue: asyncio.Queue, placed: list[str],
                                   holders: dict[str, str]) -> None:
        """Reserve KV on a decode replica, then have a prefill replica stream the prompt's KV there."""
        p_name = self._pick(self.prefill, "prefill")
        self._place(p_name, placed)
        t0 = time.perf_counter()
        d_name, d_rank, handle = await self._reserve(request, p_name)
        t1 = self._phase("reserve", t0)
        self._place(d_name, placed)
        holders |= {d_name: d_rank, p_name: p_name}
        for name in (d_name, p_name):
            self.health.wait_on(name, request.request_id, queue)
        _raise_refused(await self._call(p_name, self._send_prefill[p_name](
            NewRequest(request.request_id, request.prompt_ids, request.params, handle=handle))))
        self._phase("dispatch", t1)

    async def _start_colocated(self, request: GenerateRequest, queue: asyncio.Queue, placed: list[str],
                               holders: dict[str, str]) -> None:
        """Hand the whole request to the least-loaded colocated replica. Not by free KV blocks as
        for decode: a colocated replica never refuses (it queues), so a burst routed by stats up to
        0.5 s old would all land on one replica; the requests in flight from us are exact."""
        name = self._pick(self.colocated, "colocated")
        self._place(name, placed)
        holders[name] = name  # before the call: a client leaving during it must still stop the request
        self.health.wait_on(name, request.request_id, queue)
        t0 = time.perf_counter()
        _raise_refused(await self._call(name, self._send_generate[name](
            NewRequest(request.request_id, request.prompt_ids, request.params))))
        self._phase("dispatch", t0)

    async def _call(self, replica: str, ref):
        """Await a call to a replica; one whose process died meanwhile is counted down, and the
        request gets the 503 naming its role (ReplicaUnavailableError)."""
        try:
            return await ref
        except ActorDiedError as e:
            if self.health.failed(replica, e):
                self._count_down(replica)
            raise self.health.unavailable(self.health.roles[replica]) from None

    def _phase(self, phase: str, since: float) -> float:
        """Record that a request spent the time from `since` until now in `phase`; returns now."""
        now = time.perf_counter()
        if self.metrics:
            self.metrics.observe_phase(phase, now - since)
        return now

    async def _reserve(self, request: GenerateRequest, p_name: str) -> tuple[str, str, bytes]:
        """Reserve KV blocks on a decode replica's rank, best candidates first -> (replica, rank,
        handle); raises when all are full or down. The handle names the rank: the KV goes there."""
        for d_name in self._order(self.decode):
            replica = self.decode[d_name]
            for rank in replica.rank_order():
                try:
                    res = await self._call(d_name, self._send_reserve[rank](
                        NewRequest(request.request_id, request.prompt_ids, request.params, prefill_id=p_name)))
                except ReplicaUnavailableError:
                    break  # this replica is down: try the next one
                _raise_refused(res.refused)
                if res.handle is not None:
                    return d_name, rank, res.handle
        if not self.health.live(self.decode):
            raise self.health.unavailable("decode")
        raise NoCapacityError("every decode replica is full; retry later")

    def _place(self, name: str, placed: list[str]) -> None:
        self._loads[name] += 1
        placed.append(name)

    def _pick(self, replicas: dict, role: str) -> str:
        names = self.health.live(replicas)
        if not names:
            raise self.health.unavailable(role)
        if self.policy == "round-robin":
            return names[next(self._rr) % len(names)]
        return min(names, key=lambda n: self._loads[n])  # fewest requests in flight from us

    def _order(self, replicas: dict) -> list[str]:
        """Live decode replicas to try for a reservation, best candidates first."""
        names = self.health.live(replicas)
        if self.policy == "round-robin" and names:
            k = next(self._rr) % len(names)
            return names[k:] + names[:k]
        # kv-aware: most free KV blocks first (as last reported), then fewest requests from us.
        return sorted(names, key=lambda n: (-getattr(self.stats.get(n), "free_blocks", 0), self._loads[n]))

    async def refresh_stats(self, interval_s: float = 0.5) -> None:
        """Keep replica stats (routing, /health, /metrics) and health fresh; runs for the router's life."""
        single = {**self.prefill, **self.colocated}  # replicas of one worker each
        while True:
            for name in [*single, *self.decode]:
                try:
                    if name in single:
                        s: ReplicaStats = await asyncio.wait_for(single[name].stats.remote(), timeout=5)
                    else:
                        s = await self.decode[name].fetch_stats(timeout_s=5)
                except Exception as e:
                    self.stats.pop(name, None)  # not live: not routed to, /health counts it out
                    if self.health.failed(name, e):
                        self._count_down(name)
                    continue
                if self.health.answered(name):
                    log.warning("%s replica %s answers again", s.role, name)
                self._record(s, self.stats.get(name))
                self.stats[name] = s
            await asyncio.sleep(interval_s)

    def _record(self, s: ReplicaStats, before: ReplicaStats | None) -> None:
        """A replica's latest stats into /metrics."""
        if not self.metrics:
            return
        self.metrics.set_replica_up(s.role, s.name, True)
        self.metrics.set_replica_stats(s.role, s.name, s.running + s.waiting, s.total_blocks - s.free_blocks,
                                       s.total_blocks)
        for _ in range(s.aborted - (before.aborted if before else 0)):
            self.metrics.count_abort(s.role)
        new = s.transfers_total - (before.transfers_total if before else 0)
        for nbytes, seconds in s.transfers[len(s.transfers) - min(new, len(s.transfers)):]:
            self.metrics.observe_transfer(nbytes, seconds)
        seen = before.expert_tokens if before else []
        self.metrics.count_expert_tokens(s.name, [n - (seen[e] if e < len(seen) else 0)
                                                  for e, n in enumerate(s.expert_tokens)])

    def _count_down(self, name: str) -> None:
        """A replica went down: /metrics shows it down and drops its load figures (no stale gauges)."""
        log.warning("%s replica %s is down: %s", self.health.roles[name], name, self.health.down[name])
        self.stats.pop(name, None)
        if self.metrics:
            role = self.health.roles[name]
            self.metrics.set_replica_up(role, name, False)
            self.metrics.remove_replica(role, name)


def _raise_refused(refused: Refusal | None) -> None:
    """A worker refused the request itself (e.g. too long for its KV cache): the client's 400."""
    if refused is not None:
        raise refused.error()
