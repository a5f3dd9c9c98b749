"""A request's life across replicas: reserve on a decode replica, prefill on a prefill replica that
streams the KV there, then relay the decode replica's per-step deltas. In a colocated cluster one
replica does both phases: hand it the request, relay its deltas. In a mixed cluster each attempt
takes one of the two paths (router/prefill_site.py decides which).

The router owns a request's life: when a replica serving it is lost (its process died, its KV
never came, it was cut off at the end of a drain) the request *moves* — its prompt and every token
already streamed are prefilled again on a live replica (waiting for one, e.g. the replacement the
controller starts), and the stream goes on from the next token: no gap, no repeated token, and
greedy output as if nothing happened. Each move is an attempt of its own (router/attempt.py).

Where each decision lives: which replicas — the routing policy (router/policy.py); whether now —
admission (router/admission.py); which replicas exist and are live, and what we hold at each — the
replica set (router/replica_set.py); how an attempt is placed and handed to workers —
router/paths.py. This file strings them together for one request.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from pdserve.hop_trace import hop
from pdserve.messages import KV_FAILED, LOST, Request, RequestDelta
from pdserve.protocol import InvalidRequestError
from pdserve.router.admission import AdmissionGate
from pdserve.router.attempt import Attempt, Lost
from pdserve.router.idle import Activity
from pdserve.router.paths import Paths
from pdserve.router.prefill_site import PrefillSite
from pdserve.router.policy import RoutingPolicy
from pdserve.router.replica_set import ReplicaSet
from pdserve.router.types import DirectWriter, ServingError

log = logging.getLogger(__name__)
LIVE_POLL_S = 0.1  # how often a request waiting for a live replica looks


class Lifecycle(Paths):
    """A request's attempts, from the first to the one that finishes (placing each: router/paths.py)."""

    def __init__(self, replicas: ReplicaSet, routing: RoutingPolicy, gate: AdmissionGate, max_model_len: int,
                 block_size: int, metrics=None, migration_limit: int = 3, replica_wait_s: float = 30.0,
                 prefill_site: PrefillSite | None = None):
        self.replicas = replicas
        self.prefill_site = prefill_site or PrefillSite()
        self.routing = routing
        self.gate = gate
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.metrics = metrics
        self.migration_limit = migration_limit
        self.replica_wait_s = replica_wait_s
        self.live: dict[str, Attempt] = {}  # attempt id -> the attempt, from its start to its end
        self._queues: dict[str, asyncio.Queue] = {}  # attempt id -> its deltas
        self._direct: dict[str, Attempt] = {}  # attempt id -> the attempt, while its deltas may be written at once
        self.direct_writes = 0  # deltas `deliver` wrote at once (the rest went through a queue)
        self.activity = Activity(self.in_flight)  # what the periodic tasks wait on while idle (router/idle.py)

    def in_flight(self) -> int:
        """Requests this router streams now."""
        return len(self._queues)

    def deliver(self, deltas: list[RequestDelta]) -> None:
        """A decode (or colocated) replica's output of one step, for the requests this router streams.
        A streaming request's ordinary delta (not its first, not its last, nothing lost) whose stream
        waits with nothing in hand goes straight to the front end's writer, here, in this call: no
        queue, no wake of the stream's coroutine — what each token costs the router is mostly that
        wake. Anything else, or a writer that cannot write now, goes through the queue, in order."""
        queues, direct = self._queues, self._direct
        written = 0
        for d in deltas:
            run = direct.get(d.request_id)
            if (run is not None and run.parked and d.finish_reason is None and run.queue.empty()
                    and run.direct.write(d)):
                run.sent.extend(d.token_ids)
                written += 1
                continue
            q = queues.get(d.request_id)
            if q is not None:
                q.put_nowait(d)
        self.direct_writes += written

    async def generate(self, request: Request, direct: DirectWriter | None = None) -> AsyncIterator[RequestDelta]:
        if len(request.prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"is {len(request.prompt_ids)} tokens; the model's context is "
                                                f"{self.max_model_len} tokens")
        if self.gate.draining:
            raise self.gate.closed_error()
        run = Attempt(request.request_id, began=time.perf_counter())
        hop("began", request.request_id)
        sent: list[int] = []  # token ids the client has (a move prefills them again)
        finished = False
        try:
            if self.gate.policy.refuse_over_slo:
                self.gate.refuse_over_slo(request, self.live.values())  # at once: nothing placed, nothing to undo
            run = await self._start(request, run, sent)
            dispatched = time.perf_counter()
            while not finished:
                run.parked = True
                try:
                    d: RequestDelta = await run.queue.get()
                finally:
                    run.parked = False
                if d.finish_reason == LOST:
                    run = await self._move(request, run, sent, Lost(d.error or "a replica serving the "
                                                                    "request was lost", self._lost_role(run)))
                    continue
                if d.finish_reason == KV_FAILED:  # both replicas live: the transfer failed, not a replica
                    run = await self._move(request, run, sent, Lost(d.error or "its KV transfer failed",
                                                                    "decode", transfer="failed"))
                    continue
                if not run.streaming:
                    self._first_delta(run, dispatched, direct, sent)
                if d.finish_reason == "error":  # left unfinished: the live holders drop it too
                    raise ServingError(d.error or "the request failed")
                finished = d.finish_reason is not None
                sent.extend(d.token_ids)
                if finished:
                    self.gate.forecast.finished(len(sent))
                yield d if run.queue.empty() else d._replace(more=True)
        finally:
            self._end(run, finished)

    def _first_delta(self, run: Attempt, dispatched: float, direct: DirectWriter | None, sent: list[int]) -> None:
        """The attempt's first token came: its prefill replica's part is done."""
        if run.move == 0:
            self._phase("first_token", dispatched)
        self.activity.answered()
        health = self.replicas.health
        for name in self.replicas.prefill.keys() & run.holders.keys():
            health.done_with(name, run.request_id)
        if self.replicas.prompt_done(run):
            self.gate.wake()
        run.streaming = True
        if direct is not None:  # from the next delta on, deliver may write it at once
            run.direct, run.sent = direct, sent
            self._direct[run.request_id] = run

    # -- attempts -----------------------------------------------------------------------------------

    async def _start(self, request: Request, run: Attempt, sent: list[int]) -> Attempt:
        """Hand the attempt to replicas (once each role it needs has a live one); returns the
        attempt under way. A replica lost under the hand-off makes the request move."""
        self._queues[run.request_id] = run.queue
        self.live[run.request_id] = run
        self.activity.started()
        run.request, run.tokens = request, sent
        try:
            await self._wait_live(run)
            self.routing.prepare(run, request, sent)
            if self.replicas.mixed_cluster:
                await self._start_mixed(request, run, sent)
            elif self.replicas.colocated_cluster:
                await self._start_colocated(request, run, sent)
            else:
                await self._start_disaggregated(request, run, sent)
            return run
        except Lost as lost:
            return await self._move(request, run, sent, lost)
        except BaseException:  # refused, no replica in time, the client left: this attempt ends here
            self._end(run, False)  # (the request's own `finally` holds an earlier attempt, if any)
            raise

    async def _move(self, request: Request, run: Attempt, sent: list[int], lost: Lost) -> Attempt:
        """The attempt's replica was lost: another attempt from the tokens streamed so far, once
        a replica of each role it needs is live; at most migration_limit of them."""
        self._end(run, False)
        if run.move >= self.migration_limit:
            raise ServingError(f"{lost}; the request moved {run.move} times and is given up" if run.move
                               else f"{lost}; the request was cut short (router.migration_limit is 0)")
        if lost.transfer is not None:  # a lost transfer is not a lost replica: counted as what it is
            self._count_transfer_failure(lost.transfer, f"{request.request_id}: {lost}")
        else:
            self._count_migration(lost.role)
        return await self._start(request, Attempt(f"{request.request_id}~{run.move + 1}", run.move + 1, lost=lost),
                                 sent)

    def _lost_role(self, run: Attempt) -> str:
        """The role of the replica an attempt lost (one of its holders that is down)."""
        health = self.replicas.health
        return next((health.roles[n] for n in run.holders if n in health.down), "decode")

    def _end(self, run: Attempt, finished: bool) -> None:
        """The attempt is over: counts and waits dropped; unless it finished, every live holder stops it."""
        rs = self.replicas
        self._queues.pop(run.request_id, None)
        self._direct.pop(run.request_id, None)
        self.live.pop(run.request_id, None)
        self.activity.answered()
        rs.prompt_done(run)
        if run.slot is not None or run.placed:  # a slot, or room at a replica, came free
            run.slot = None
            self.gate.wake()
        rs.unplace(run)
        for name in run.holders:
            rs.health.done_with(name, run.request_id)
        if not finished:  # the client left, it failed, or it moves: stop it everywhere
            for name, worker in run.holders.items():
                if name not in rs.health.down and worker in rs.send_abort:
                    rs.send_abort[worker](run.request_id)
        run.holders.clear()

    async def _wait_live(self, run: Attempt) -> None:
        """Until every role the request needs has a live replica (a replacement the controller
        starts), at most replica_wait_s; then a new request gets the 503 naming the role, a moving
        one an error naming what it lost."""
        rs = self.replicas
        deadline = time.monotonic() + self.replica_wait_s
        while missing := self._missing_roles():
            if time.monotonic() >= deadline or self.gate.draining:
                if run.lost is None or not run.tokens:  # nothing streamed yet: the 503 a new request gets
                    raise rs.health.unavailable(missing[0])
                raise ServingError(f"{run.lost}; no live {missing[0]} replica took it over within "
                                   f"{self.replica_wait_s:g} s")
            await asyncio.sleep(LIVE_POLL_S)

    def _missing_roles(self) -> list[str]:
        """The roles with no live replica that keep an attempt from starting now ([]: none): in a
        mixed cluster, either path will do."""
        rs = self.replicas
        # (A disaggregated attempt needs no prefill replica where a decode replica can prefill it.)
        split = ["decode"] if self._local_replicas() else ["prefill", "decode"]
        paths = [["colocated"], split] if rs.mixed_cluster else [["colocated"]] if rs.colocated_cluster else [split]
        missing: list[str] = []
        for roles in paths:
            if not (missing := [r for r in roles if not rs.health.live(rs.of_role(r))]):
                return []
        return missing

    def _count_transfer_failure(self, reason: str, what: str) -> None:
        log.warning("a KV transfer failed (%s), the request moves to another pair: %s", reason, what)
        if self.metrics:
            self.metrics.count_transfer_failure(reason)

    def _count_migration(self, role: str) -> None:
        log.info("a request moves: its %s replica was lost", role)
        if self.metrics:
            self.metrics.count_migration(role)

    def _admitted(self, run: Attempt) -> None:
        """The attempt is handed to a worker now (a reservation, or the request itself): its request's
        `admit` phase ends — admission, the placing policy, a wait for room (once per request)."""
        hop("admitted", run.request_id)
        if run.began:
            self._phase("admit", run.began)
            run.began = 0.0

    def _phase(self, phase: str, since: float) -> float:
        """Record that a request spent the time from `since` until now in `phase`; returns now."""
        now = time.perf_counter()
        if self.metrics:
            self.metrics.observe_phase(phase, now - since)
        return now
