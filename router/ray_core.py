"""The request lifecycle across replicas: reserve on a decode replica, prefill on a
prefill replica that streams the KV there, then relay the decode replica's per-step deltas. In a
colocated cluster one replica does both phases: hand it the request, relay its deltas.

The router owns a request's life: when a replica serving it is lost (its process died, its KV
never came, it was cut off at the end of a drain) the request *moves* — its prompt and every token
already streamed are prefilled again on a live replica (waiting for one, e.g. the replacement the
controller starts), and the stream goes on from the next token: no gap, no repeated token, and
greedy output as if nothing happened. Each move is an *attempt* with an id of its own, so nothing
left of an earlier one (a late delta, a settling reservation) can mix with it.

Admission control: a new request that no replica can take now waits in the router's queue
(router/admission.py) rather than being refused, and with router.refuse_over_slo one whose
forecast time to first token (router/forecast.py) is over the SLO is refused at once (429).
"""

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.router.admission import AdmissionPolicy, AdmissionQueue
from pdserve.router.decode_replica import DecodeReplica
from pdserve.router.forecast import SlotHolder, TTFTForecast
from pdserve.router.handoff import HandOff
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.replica_health import ReplicaHealth
from pdserve.router.types import (
    Delta,
    DirectWriter,
    GenerateRequest,
    NoCapacityError,
    OverloadedError,
    ReplicaUnavailableError,
    ServingError,
)
from ray.exceptions import RayActorError

from pdserve.engine.block_pool import block_hashes
from pdserve.messages import (
    KV_FAILED,
    LOST,
    NewRequest,
    Refusal,
    ReplicaChange,
    ReplicaStats,
    RequestDelta,
    Unpaired,
)
from pdserve.protocol import InvalidRequestError

log = logging.getLogger(__name__)
LIVE_POLL_S = 0.1  # how often a request waiting for a live replica looks
MOVE_RETRY_S = 0.05  # how often a moving request whose decode replicas are all full asks again
QUEUE_WEIGHT = 1.0  # prefix-aware: a token queued requests leave a replica to compute, against one of ours (_pick)
# prefix-aware: a replica with more than SLACK + RATIO x the least-loaded one's requests of ours
# takes no more, whatever it caches (_pick)
BALANCE_SLACK, BALANCE_RATIO = 8, 1.5
# prefix-aware decode: a replica's memory pressure counts from this share of its blocks in use (_order)
PRESSURE_FROM = 0.5
SESSIONS = 100_000  # conversations remembered for affinity, least recently used forgotten first


@dataclass
class _Attempt:
    """One try at serving a request on some replicas."""

    request_id: str  # the id the workers know it by: the request's, then "<id>~<n>" for the n-th move
    move: int = 0  # 0: the request's first attempt
    streaming: bool = False  # its first delta came (its prefill replica's part is done)
    lost: "_Lost | None" = None  # why the attempt before this one ended
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    placed: list[str] = field(default_factory=list)  # replicas whose count of our requests it raised
    holders: dict[str, str] = field(default_factory=dict)  # replica -> its worker holding it (aborted there if unfinished)
    # The front end's direct writer (generate's `direct`) and the request's tokens sent so far, once
    # it streams; `parked`: its stream awaits the queue, so nothing it took is still unwritten.
    direct: "DirectWriter | None" = None
    sent: list[int] | None = None
    parked: bool = False
    # What admission control counts (router/forecast.py): the request, its tokens streamed so far
    # (the list every attempt of it shares), the decode or colocated replica whose sequence slot it
    # holds ("" while it reserves one), and the prefill or colocated replica computing its prompt,
    # until its first token.
    request: GenerateRequest | None = None
    tokens: list[int] = field(default_factory=list)
    slot: str | None = None
    prompt_at: str | None = None
    # The prompt tokens it leaves that replica to compute (prefix-aware: less what its cache holds,
    # as the router saw it; other policies: all of them), counted in _prompt_tokens until its first token.
    to_compute: int | None = None
    prompt_work: int = 0
    # Prefix-aware routing: the prompt's block hashes (with the tokens a move prefills again).
    hashes: list[bytes] = field(default_factory=list)


class RayCore:
    def __init__(self, name: str, model_name: str, max_model_len: int, tokenizer, replicas: list[ReplicaChange],
                 policy: str, metrics=None, migration_limit: int = 3, replica_wait_s: float = 30.0,
                 admission: AdmissionPolicy | None = None, block_size: int = 16):
        """replicas: every replica as the controller last described it; later changes come by `apply`.
        block_size: the engines' KV block (the prefix cache's unit, which its hashes cover)."""
        self.name = name  # this router's actor name: where decode replicas send deltas
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.prefill: dict[str, object] = {}  # replica name -> actor handle
        self.decode: dict[str, DecodeReplica] = {}  # replica name -> its rank(s)
        self.colocated: dict[str, object] = {}  # replica name -> actor handle
        self._workers: dict[str, dict[str, object]] = {}  # replica -> its workers (actor name -> handle)
        self.policy = policy
        self.block_size = block_size
        self.index = PrefixIndex()  # what each worker's prefix cache holds (its KV events)
        self._reserved: dict[str, int] = {}  # decode replica -> blocks we reserved since its stats
        # session -> (its last turn's replicas, the blocks of that prompt, its last block's hash)
        self._sessions: OrderedDict[str, tuple[tuple[str, ...], int, bytes]] = OrderedDict()
        self.metrics = metrics
        self.migration_limit = migration_limit
        self.replica_wait_s = replica_wait_s
        self._draining = False  # shutting down: no new requests
        self.admission = admission or AdmissionPolicy()
        self.queue = AdmissionQueue(self.admission.max_queued, self.admission.queue_wait_s, metrics)
        self.forecast = TTFTForecast(self.admission.prefill_step_tokens)
        self._live: dict[str, _Attempt] = {}  # attempt id -> the attempt, from its start to its end
        # Prefill (or colocated) replica -> our requests there without a first token yet, and the
        # prompt tokens they leave it to compute: the hand-off's bound (router.max_queued_per_replica),
        # the forecast's queue and prefix-aware routing's.
        self._prompts: dict[str, int] = {}
        self._prompt_tokens: dict[str, int] = {}
        self.stats: dict[str, ReplicaStats] = {}
        # Round-robin's turn, per role: one counter stepped by both choices of a request would hand
        # every request the same pair where the roles have as many replicas (2 + 2: prefill-0, decode-1).
        self._rr: dict[str, itertools.count] = {}
        self._queues: dict[str, asyncio.Queue] = {}  # attempt id -> its deltas
        self._direct: dict[str, _Attempt] = {}  # attempt id -> the attempt, while its deltas may be written at once
        self.direct_writes = 0  # deltas `deliver` wrote at once (the rest went through a queue)
        self._loads: dict[str, int] = {}  # replica -> requests we placed there, in flight
        self._restarts: dict[str, int] = {}  # replica -> restarts counted in /metrics
        # One hand-off per worker and kind of call: a turn's requests go out in one Ray call.
        self._send: dict[str, HandOff] = {}  # worker -> its calls that bring work
        self._send_abort: dict[str, HandOff] = {}
        self.health = ReplicaHealth()
        for change in replicas:
            self.apply(change)

    # -- the replica set, as the controller says ---------------------------------------------------

    def apply(self, change: ReplicaChange) -> None:
        """A replica started, was replaced, drains or is gone (from the controller)."""
        name, role = change.replica, change.role
        if change.state == "gone":
            self._drop_workers(name)
            for d in (self.prefill, self.decode, self.colocated, self._workers, self.stats):
                d.pop(name, None)
            self.forecast.forget(name)
            self.health.leave(name)
            if self.metrics:
                self.metrics.forget_replica(role, name)
            return
        fresh = self._workers.get(name) != change.ranks
        if fresh:
            self._drop_workers(name)
            self._workers[name] = dict(change.ranks)
            self.stats.pop(name, None)  # a new incarnation counts from 0
            worker, handle = next(iter(change.ranks.items()))  # (prefill and colocated: one worker)
            if role == "prefill":
                self.prefill[name] = handle
                self._send[worker] = HandOff(handle.prefill.remote)
            elif role == "colocated":
                self.colocated[name] = handle
                self._send[worker] = HandOff(lambda items, w=handle: w.generate.remote(items, self.name))
            else:
                self.decode[name] = DecodeReplica(name, dict(change.ranks))
                for rank, w in change.ranks.items():
                    self._send[rank] = HandOff(lambda items, w=w: w.reserve.remote(items, self.name))
            for worker, w in change.ranks.items():
                self._send_abort[worker] = HandOff(w.abort.remote, answered=False)
            self._loads.setdefault(name, 0)
        self.health.join(name, role, fresh, draining=change.state == "draining")
        seen = self._restarts.get(name, 0)
        if self.metrics and change.restarts > seen:
            self.metrics.count_restarts(role, name, change.restarts - seen)
        self._restarts[name] = max(seen, change.restarts)

    def _drop_workers(self, replica: str) -> None:
        for worker in self._workers.get(replica, {}):
            self._send.pop(worker, None)
            self._send_abort.pop(worker, None)
            self.index.drop(worker)  # a new incarnation's cache starts empty

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value:  # the queued hear it now (503), not at their deadline
            self.queue.wake_all()

    def placed(self, replica: str) -> int:
        """Requests of this router on the replica now (a drain waits for 0)."""
        return self._loads.get(replica, 0)

    def restarts(self) -> dict[str, int]:
        """Replacements of each replica so far, as the controller told (the dashboard's view without it)."""
        return dict(self._restarts)

    # -- what the front ends ask ------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, **(template_kwargs or {}))

    def ready(self) -> bool:
        if self.draining:
            return False
        live = {s.role for s in self.stats.values()}
        return "colocated" in live or {"prefill", "decode"} <= live

    def degraded(self) -> dict[str, str]:
        out = {n: f"down: {why}" for n, why in self.health.down.items()}
        out |= {n: "draining" for n in self.health.draining}
        if self.draining:
            out["router"] = "draining: the service is shutting down"
        return out

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

    async def generate(self, request: GenerateRequest, direct: DirectWriter | None = None) -> AsyncIterator[Delta]:
        if len(request.prompt_ids) >= self.max_model_len:
            raise InvalidRequestError("prompt", f"is {len(request.prompt_ids)} tokens; the model's context is "
                                                f"{self.max_model_len} tokens")
        if self.draining:
            raise ReplicaUnavailableError("the service is shutting down; retry on another instance")
        run = _Attempt(request.request_id)
        sent: list[int] = []  # token ids the client has (a move prefills them again)
        finished = False
        try:
            if self.admission.refuse_over_slo:
                self._refuse_over_slo(request)  # at once: nothing placed, nothing to undo
            run = await self._start(request, run, sent)
            dispatched = time.perf_counter()
            while not finished:
                run.parked = True
                try:
                    d: RequestDelta = await run.queue.get()
                finally:
                    run.parked = False
                if d.finish_reason == LOST:
                    run = await self._move(request, run, sent, _Lost(d.error or "a replica serving the "
                                                                     "request was lost", self._lost_role(run)))
                    continue
                if d.finish_reason == KV_FAILED:  # both replicas live: the transfer failed, not a replica
                    run = await self._move(request, run, sent, _Lost(d.error or "its KV transfer failed",
                                                                     "decode", transfer="failed"))
                    continue
                if not run.streaming:
                    if run.move == 0:
                        self._phase("first_token", dispatched)
                    for name in self.prefill.keys() & run.holders.keys():  # its part is done
                        self.health.done_with(name, run.request_id)
                    self._prompt_done(run)
                    run.streaming = True
                    if direct is not None:  # from the next delta on, deliver may write it at once
                        run.direct, run.sent = direct, sent
                        self._direct[run.request_id] = run
                if d.finish_reason == "error":  # left unfinished: the live holders drop it too
                    raise ServingError(d.error or "the request failed")
                finished = d.finish_reason is not None
                sent.extend(d.token_ids)
                if finished:
                    self.forecast.finished(len(sent))
                yield Delta(d.text, d.token_ids, d.finish_reason, d.logprobs, more=not run.queue.empty())
        finally:
            self._end(run, finished)

    # -- attempts -----------------------------------------------------------------------------------

    async def _start(self, request: GenerateRequest, run: _Attempt, sent: list[int]) -> _Attempt:
        """Hand the attempt to replicas (once each role it needs has a live one); returns the
        attempt under way. A replica lost under the hand-off makes the request move."""
        self._queues[run.request_id] = run.queue
        self._live[run.request_id] = run
        run.request, run.tokens = request, sent
        try:
            await self._wait_live(run)
            start = self._start_colocated if self.colocated or not self.decode else self._start_disaggregated
            if self.policy == "prefix-aware":  # (~1 us a block: 4k tokens cost a quarter of a millisecond)
                run.hashes = block_hashes(request.prompt_ids + sent, self.block_size)
            await start(request, run, sent)
            return run
        except _Lost as lost:
            return await self._move(request, run, sent, lost)
        except BaseException:  # refused, no replica in time, the client left: this attempt ends here
            self._end(run, False)  # (the request's own `finally` holds an earlier attempt, if any)
            raise

    async def _move(self, request: GenerateRequest, run: _Attempt, sent: list[int], lost: "_Lost") -> _Attempt:
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
        return await self._start(request, _Attempt(f"{request.request_id}~{run.move + 1}", run.move + 1, lost=lost),
                                 sent)

    def _lost_role(self, run: _Attempt) -> str:
        """The role of the replica an attempt lost (one of its holders that is down)."""
        return next((self.health.roles[n] for n in run.holders if n in self.health.down), "decode")

    def _end(self, run: _Attempt, finished: bool) -> None:
        """The attempt is over: counts and waits dropped; unless it finished, every live holder stops it."""
        self._queues.pop(run.request_id, None)
        self._direct.pop(run.request_id, None)
        self._live.pop(run.request_id, None)
        self._prompt_done(run, wake=False)
        if run.slot is not None or run.placed:  # a slot, or room at a replica, came free
            run.slot = None
            self.queue.wake()
        for name in run.placed:
            if name in self._loads:
                self._loads[name] -= 1
        run.placed.clear()
        for name in run.holders:
            self.health.done_with(name, run.request_id)
        if not finished:  # the client left, it failed, or it moves: stop it everywhere
            for name, worker in run.holders.items():
                if name not in self.health.down and worker in self._send_abort:
                    self._send_abort[worker](run.request_id)
        run.holders.clear()

    async def _wait_live(self, run: _Attempt) -> None:
        """Until every role the request needs has a live replica (a replacement the controller
        starts), at most replica_wait_s; then a new request gets the 503 naming the role, a moving
        one an error naming what it lost."""
        roles = ["colocated"] if self.colocated or not self.decode else ["prefill", "decode"]
        deadline = time.monotonic() + self.replica_wait_s
        while missing := [r for r in roles if not self.health.live(self._replicas_of(r))]:
            if time.monotonic() >= deadline or self.draining:
                if run.lost is None or not run.tokens:  # nothing streamed yet: the 503 a new request gets
                    raise self.health.unavailable(missing[0])
                raise ServingError(f"{run.lost}; no live {missing[0]} replica took it over within "
                                   f"{self.replica_wait_s:g} s")
            await asyncio.sleep(LIVE_POLL_S)

    def _replicas_of(self, role: str) -> dict:
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]

    def _count_transfer_failure(self, reason: str, what: str) -> None:
        log.warning("a KV transfer failed (%s), the request moves to another pair: %s", reason, what)
        if self.metrics:
            self.metrics.count_transfer_failure(reason)

    def _count_migration(self, role: str) -> None:
        log.info("a request moves: its %s replica was lost", role)
        if self.metrics:
            self.metrics.count_migration(role)

    async def _start_disaggregated(self, request: GenerateRequest, run: _Attempt, sent: list[int]) -> None:
        """Reserve KV on a decode replica, then have a prefill replica stream the prompt's KV there."""
        p_name, p_worker, (d_name, d_rank, handle) = await self._admit(
            request, run, lambda: self._try_disaggregated(request, run, sent))
        t1 = time.perf_counter()
        self._count_placed(p_name)
        self._place(d_name, run.placed)
        run.holders |= {d_name: d_rank, p_name: p_worker}
        for name in (d_name, p_name):
            self.health.wait_on(name, run.request_id, run.queue)
        answer = await self._call(p_name, p_worker, self._send[p_worker](
            NewRequest(run.request_id, request.prompt_ids, request.params, handle=handle, output_ids=sent,
                       priority=request.priority)))
        if isinstance(answer, Unpaired):  # the pair lost its handshake since the stats said so
            raise _Lost(str(answer), "prefill", transfer="unpaired")
        _raise_refused(answer)
        self._phase("dispatch", t1)

    async def _try_disaggregated(self, request: GenerateRequest, run: _Attempt,
                                 sent: list[int]) -> tuple[str, str, tuple[str, str, bytes]] | None:
        """One try at placing the attempt: a prefill replica with room for it, KV blocks on a
        decode replica -> (prefill replica, its worker, the reservation); None when none has room."""
        prefill = {n: h for n, h in self.prefill.items() if self._paired(n)}  # only over a KV pair
        if not prefill and self.health.live(self.prefill):  # paired to none yet: handshakes under way
            return None
        p_name = self._pick(prefill or self.prefill, "prefill", moving=run.move > 0, room=run.move == 0, run=run,
                            request=request, sent=sent)
        if p_name is None:
            return None
        # Counted before the reservation's await, so that a burst spreads over the prefill replicas.
        self._loads[p_name] += 1
        run.placed.append(p_name)
        self._await_prompt(run, p_name, len(request.prompt_ids) + len(sent))
        p_worker = next(iter(self._workers[p_name]))
        t0 = time.perf_counter()
        run.slot = ""  # reserving one
        reserved = await self._reserve(request, run, sent, p_name, p_worker)
        if reserved is None:
            run.slot = None
            self._prompt_done(run, wake=False)
            run.placed.remove(p_name)
            self._loads[p_name] -= 1
            return None
        self._phase("reserve", t0)
        self.index.routed(p_worker, run.hashes)  # its cache holds the prompt once prefilled,
        self.index.routed(reserved[1], run.hashes)  # and so does the decode rank's once the KV is in
        self._remember(request, run, (p_name, reserved[0]))
        return p_name, p_worker, reserved

    async def _start_colocated(self, request: GenerateRequest, run: _Attempt, sent: list[int]) -> None:
        """Hand the whole request to the least-loaded colocated replica. Not by free KV blocks as
        for decode: a colocated replica never refuses (it queues), so a burst routed by stats up to
        0.5 s old would all land on one replica; the requests in flight from us are exact."""
        name = await self._admit(request, run, lambda: self._try_colocated(request, run, sent))
        worker = next(iter(self._workers[name]))
        run.holders[name] = worker  # before the call: a client leaving during it must still stop the request
        self.health.wait_on(name, run.request_id, run.queue)
        t0 = time.perf_counter()
        _raise_refused(await self._call(name, worker, self._send[worker](
            NewRequest(run.request_id, request.prompt_ids, request.params, output_ids=sent,
                       priority=request.priority))))
        self._phase("dispatch", t0)

    async def _try_colocated(self, request: GenerateRequest, run: _Attempt, sent: list[int]) -> str | None:
        """A colocated replica with room for the attempt (it is placed there), or None."""
        name = self._pick(self.colocated, "colocated", moving=run.move > 0, room=run.move == 0, run=run,
                          request=request, sent=sent)
        if name is not None:
            self.index.routed(next(iter(self._workers[name])), run.hashes)
            self._remember(request, run, (name,))
            self._place(name, run.placed)
            run.slot = name
            self._await_prompt(run, name, len(request.prompt_ids) + len(sent))
        return name

    async def _admit(self, request: GenerateRequest, run: _Attempt, place):
        """`place()` until it places the attempt (each call one try; None: no replica has room now).

        A new request that finds no room — or others waiting already — waits in the admission
        queue (router/admission.py) and tries again each time it is woken; a 429 when the queue is
        full or its wait ends. A moving request was admitted once: it waits behind nobody, asking
        again every MOVE_RETRY_S up to router.replica_wait_s (the blocks its lost attempt reserved
        are being freed by the abort sent as it ended, and that abort may reach the decode worker
        after this reservation does)."""
        if run.move > 0:
            deadline = time.monotonic() + self.replica_wait_s
            while (placed := await place()) is None:
                if time.monotonic() >= deadline or self.draining:
                    raise NoCapacityError("every decode replica is full; retry later")
                await asyncio.sleep(MOVE_RETRY_S)
            return placed
        since = time.monotonic()
        waiter = placed = None
        try:
            if not self.queue and (placed := await place()) is not None:
                return placed
            waiter = self.queue.join(request)
            while True:
                await self.queue.wait(waiter)
                if self.draining:
                    raise ReplicaUnavailableError("the service is shutting down; retry on another instance")
                if (placed := await place()) is not None:
                    self.queue.wake()  # there may be room for the next one too
                    return placed
        except OverloadedError as e:
            self._count_refused(e.reason)
            raise
        finally:
            if waiter is not None:
                self.queue.leave(waiter)
            if placed is not None and self.metrics:
                self.metrics.observe_queue_wait(time.monotonic() - since)

    def _await_prompt(self, run: _Attempt, replica: str, tokens: int) -> None:
        """The attempt's prompt (`tokens` long) is now the `replica`'s to compute: all of it, or what
        _pick found its cache lacks."""
        run.prompt_at = replica
        run.prompt_work = tokens if run.to_compute is None else run.to_compute
        self._prompts[replica] = self._prompts.get(replica, 0) + 1
        self._prompt_tokens[replica] = self._prompt_tokens.get(replica, 0) + run.prompt_work

    def _prompt_done(self, run: _Attempt, wake: bool = True) -> None:
        """The attempt's first token came (or it ended): its prefill replica has room for another."""
        replica, run.prompt_at = run.prompt_at, None
        if replica is None:
            return
        self._prompts[replica] -= 1
        self._prompt_tokens[replica] -= run.prompt_work
        if self._prompts[replica] == 0:
            self._prompt_tokens[replica] = 0
        if wake:
            self.queue.wake()

    async def _call(self, replica: str, worker: str, ref):
        """Await a call to a replica's worker; one whose process died meanwhile is counted down
        (unless a replacement took its place meanwhile), and the attempt is lost (it moves)."""
        try:
            return await ref
        except RayActorError as e:  # died, or unreachable (ActorUnavailableError: its node died)
            if worker in self._workers.get(replica, {}) and self.health.failed(replica, e):
                self._count_down(replica)
            role = self.health.roles.get(replica, "replica")
            raise _Lost(f"the {role} replica {replica} was lost ({self.health.down.get(replica, 'its process died')})",
                        role) from None

    def _phase(self, phase: str, since: float) -> float:
        """Record that a request spent the time from `since` until now in `phase`; returns now."""
        now = time.perf_counter()
        if self.metrics:
            self.metrics.observe_phase(phase, now - since)
        return now

    async def _reserve(self, request: GenerateRequest, run: _Attempt, sent: list[int],
                       p_name: str, p_worker: str) -> tuple[str, str, bytes] | None:
        """Reserve KV blocks on a decode replica's rank, best candidates first -> (replica, rank,
        handle); None when all are full; raises when none is live. The handle names the rank: the
        KV goes there."""
        for d_name, ranks in self._order(self.decode, run, request):
            for rank in ranks:
                if not self._paired(p_name, d_name, rank):  # its KV could not move there
                    continue
                # Held from the call on: a client that leaves while the reservation is answered
                # still has it aborted on the rank (not left to its lease).
                run.holders[d_name] = rank
                try:
                    res = await self._call(d_name, rank, self._send[rank](
                        NewRequest(run.request_id, request.prompt_ids, request.params, prefill_id=p_worker,
                                   output_ids=sent, priority=request.priority)))
                except _Lost:
                    run.holders.pop(d_name, None)
                    break  # this replica is down: try the next one
                _raise_refused(res.refused)
                if res.unpaired is not None:  # the stats we routed by were older than its handshakes
                    self._count_transfer_failure("unpaired", f"{request.request_id}: {res.unpaired}")
                if res.handle is not None:
                    run.slot = d_name
                    self._reserved[d_name] = self._reserved.get(d_name, 0) + self._blocks(request, sent)
                    return d_name, rank, res.handle
                run.holders.pop(d_name, None)
        if not self.health.live(self.decode):
            # (One died under this very reservation: the request waits for its replacement, as a
            # moving one does, rather than hear a 503 that a request a moment later would not.)
            raise _Lost("no live decode replica", "decode")
        return None

    # -- admission control --------------------------------------------------------------------------

    def _refuse_over_slo(self, request: GenerateRequest) -> None:
        """Refuse (429) a new request whose forecast time to first token is over slo.ttft_ms
        (router.refuse_over_slo); nothing is refused before the replicas have measured their steps."""
        ttft = self._forecast_ttft(request)
        if ttft is None:
            return
        if self.metrics:
            self.metrics.observe_forecast(ttft)
        slo = self.admission.ttft_slo_s
        if ttft > slo:
            self._count_refused("predicted_ttft")
            raise OverloadedError(f"its first token would come in about {ttft * 1000:.0f} ms, over the service's "
                                  f"{slo * 1000:g} ms objective (slo.ttft_ms)", "predicted_ttft",
                                  retry_after_s=max(1.0, ttft - slo))

    def _forecast_ttft(self, request: GenerateRequest) -> float | None:
        """Seconds a new request would wait for its first token (router/forecast.py), or None
        without the measurements to tell."""
        colocated = bool(self.colocated) or not self.decode
        slot_replicas, prompt_replicas = ((self.colocated, self.colocated) if colocated else (self.decode, self.prefill))
        holders, line = [], []
        for run in self._live.values():  # this router's requests: in a slot, or first in line for one
            if run.slot is None:
                continue
            r = run.request
            if colocated and not run.streaming:  # at its replica, but perhaps queued there for a slot
                line.append((r.params, len(r.prompt_ids)))
            else:
                holders.append(SlotHolder(r.params, len(r.prompt_ids), len(run.tokens), run.streaming))
        pool = self.forecast.pool([self.stats[n] for n in self.health.live(slot_replicas) if n in self.stats],
                                  len(holders))
        prompt_at = min(self.health.live(prompt_replicas), key=lambda n: self._prompt_tokens.get(n, 0), default=None)
        if pool is None or prompt_at is None:
            return None
        line += [(w.request.params, len(w.request.prompt_ids)) for w in self.queue.ahead(request.priority)]
        wait = self.forecast.slot_wait(pool, holders, line, prompt_at, request.params)
        # Its prompt is computed behind those queued at the prefill replica now, if it gets a slot now;
        # later, that queue has moved on: alone.
        ahead = self._prompt_tokens.get(prompt_at, 0) if wait == 0 else 0
        ttft = wait + self.forecast.prefill_s(prompt_at, ahead + len(request.prompt_ids))
        if not colocated:  # the KV's way to the decode replica, and the step that hands out the first token
            ttft += self.forecast.transfer_s.get(prompt_at, 0.0) + pool.step_s
        return ttft

    def _count_refused(self, reason: str) -> None:
        if self.metrics:
            self.metrics.count_refused(reason)

    def _place(self, name: str, placed: list[str]) -> None:
        self._loads[name] += 1
        placed.append(name)
        self._count_placed(name)

    def _count_placed(self, name: str) -> None:
        if self.metrics:
            self.metrics.count_placed(self.health.roles[name], name)

    def _pick(self, replicas: dict, role: str, moving: bool = False, room: bool = False, run: _Attempt | None = None,
              request: GenerateRequest | None = None, sent: list[int] = ()) -> str | None:
        """A live replica to compute a new attempt's prompt (prefill or colocated); with `room`, only
        among those holding fewer than router.max_queued_per_replica of our requests without a
        first token (None: none has room)."""
        names = self.health.live(replicas)
        if not names:
            if moving:  # a request already under way waits for a replacement; a new one hears 503 now
                raise _Lost(f"no live {role} replica", role)
            raise self.health.unavailable(role)
        if room:
            bound = self.admission.max_queued_per_replica
            if not (names := [n for n in names if self._prompts.get(n, 0) < bound]):
                return None
        if run is not None:
            run.to_compute = None
        if self.policy == "round-robin":
            return names[next(self._rr.setdefault(role, itertools.count())) % len(names)]
        if self.policy == "kv-aware" or run is None or not run.hashes:
            return min(names, key=lambda n: self._loads[n])  # fewest requests in flight from us
        # prefix-aware: the least work before this request's first token there, in prompt tokens to
        # compute: those its cache lacks, plus those the requests we sent it without a first token
        # yet leave it to compute (their prompts less what it held of them: a queue of cached turns
        # is short work; counted by whole prompts, a queue spilled sessions). Weighed at half, a
        # queue let a shared system prompt herd 80 of 96 requests onto one of two replicas (the
        # other idle, TTFT p90 1.8x kv-aware's); at one, a session moves only when the queue's
        # excess outweighs recomputing its history. The balance guard bounds what one replica takes.
        tokens = len(request.prompt_ids) + len(sent)
        worker = {n: next(iter(self._workers[n])) for n in names}
        held = self._cached(run, request, {w: n for n, w in worker.items()})
        cost = {n: tokens - held[worker[n]] * self.block_size + QUEUE_WEIGHT * self._prompt_tokens.get(n, 0)
                for n in names}
        name = self._balanced(min(names, key=lambda n: (cost[n], self._loads[n])), names)
        run.to_compute = max(1, tokens - held[worker[name]] * self.block_size)
        return name

    def _paired(self, p_name: str, d_name: str | None = None, rank: str | None = None) -> bool:
        """Whether a prefill replica has a KV pair with the decode rank (any rank of any live decode
        replica, where none is named): both ends list each other among their peers, as their latest
        stats said. A pair that is not (yet) handshaked takes no request: its KV could not move."""
        p = self.stats.get(p_name)
        if p is None:
            return False
        p_worker = next(iter(self._workers.get(p_name, {})), None)
        pairs = [(d_name, rank)] if rank is not None else \
            [(n, r) for n in self.health.live(self.decode) for r in self.decode[n].ranks]
        for n, r in pairs:
            d = self.decode[n].rank_stats.get(r) if n in self.decode else None
            if d is not None and r in p.kv_peers and p_worker in d.kv_peers:
                return True
        return False

    def _balanced(self, best: str, names: list[str]) -> str:
        """The prefix-aware costs count tokens, not requests: a replica whose every prompt is cached
        would take all of them, however many (each still a step, a slot, a KV transfer). Past a
        spread of requests, the least-loaded replica takes it instead (an operator who scales up
        sees the new replica used)."""
        least = min(names, key=lambda n: self._loads[n])
        return least if self._loads[best] > BALANCE_SLACK + BALANCE_RATIO * self._loads[least] else best

    def _order(self, replicas: dict, run: _Attempt, request: GenerateRequest) -> list[tuple[str, list[str]]]:
        """Live decode replicas to try for a reservation, best candidates first, each with its ranks
        in the order to try."""
        names = self.health.live(replicas)
        if self.policy == "round-robin" and names:
            k = next(self._rr.setdefault("decode", itertools.count())) % len(names)
            return [(n, self.decode[n].rank_order()) for n in names[k:] + names[:k]]
        if self.policy == "prefix-aware" and run.hashes:
            # Blocks the KV must move to it (its own cache keeps the rest: only new KV moves) plus its
            # pressure: nothing up to PRESSURE_FROM of its blocks in use, then the excess squared over
            # the rest (half the pool when full). A replica far from full decodes a few more sequences
            # at almost no cost, so there the cached history wins; one filling up must not take every
            # history it holds. (Counted from the first block, used² / total, one more 4-13k-token
            # sequence outweighed a session's history: on four H100s a quarter of the turns moved.)
            held = self._cached(run, request, {r: n for n in names for r in self.decode[n].ranks})
            order = []
            for n in names:
                mine = sorted(self.decode[n].rank_order(), key=lambda r: -held[r])  # (stable: free blocks next)
                s = self.stats.get(n)
                used = (s.total_blocks - s.free_blocks if s else 0) + self._reserved.get(n, 0)
                over = max(0.0, used - PRESSURE_FROM * s.total_blocks) if s and s.total_blocks else 0.0
                pressure = over * over / ((1 - PRESSURE_FROM) * s.total_blocks) if over else 0.0
                order.append((len(run.hashes) - held[mine[0]] + pressure, n, mine))
            ranked = [(n, mine) for _, n, mine in sorted(order, key=lambda o: (o[0], self._loads[o[1]]))]
            first = self._balanced(ranked[0][0], names)  # the same guard as the prompt's replica
            return sorted(ranked, key=lambda r: r[0] != first)
        # kv-aware: most free KV blocks first (as last reported), then fewest requests from us.
        names = sorted(names, key=lambda n: (-getattr(self.stats.get(n), "free_blocks", 0), self._loads[n]))
        return [(n, self.decode[n].rank_order()) for n in names]

    def _cached(self, run: _Attempt, request: GenerateRequest, workers: dict[str, str]) -> dict[str, int]:
        """Per worker (-> its replica), the leading blocks of the request's prompt its cache holds: as
        its KV events say, or, on the replicas that served the session's last turn, that turn's
        prompt where this one continues it (their events may not have come yet, or went to
        another router)."""
        held = self.index.match(run.hashes, workers)
        last = self._sessions.get(request.session) if request.session else None
        if last is not None:
            replicas, n, tail = last
            if 0 < n <= len(run.hashes) and run.hashes[n - 1] == tail:  # a chain: equal there, equal before
                for w, replica in workers.items():
                    if replica in replicas:
                        held[w] = max(held[w], n)
        return held

    def _remember(self, request: GenerateRequest, run: _Attempt, replicas: tuple[str, ...]) -> None:
        """A session's turn went to these replicas: its next turn is likely to continue its prompt."""
        if request.session is None or not run.hashes:
            return
        self._sessions[request.session] = (replicas, len(run.hashes), run.hashes[-1])
        self._sessions.move_to_end(request.session)
        if len(self._sessions) > SESSIONS:
            self._sessions.popitem(last=False)

    def _blocks(self, request: GenerateRequest, sent: list[int]) -> int:
        return -(-(len(request.prompt_ids) + len(sent) + 1) // self.block_size)

    # -- replica stats and health -----------------------------------------------------------------

    async def refresh_stats(self, interval_s: float = 0.5) -> None:
        """Keep replica stats (routing, /health, /metrics) and health fresh; runs for the router's life."""
        while True:
            for name in list(self._workers):
                workers = self._workers.get(name)
                if workers is None:  # gone meanwhile
                    continue
                try:
                    if name in self.decode:
                        s: ReplicaStats = await self.decode[name].fetch_stats(timeout_s=5)
                    else:
                        s = await asyncio.wait_for(next(iter(workers.values())).stats.remote(), timeout=5)
                except Exception as e:
                    if self._workers.get(name) is not workers:  # replaced or gone while we asked
                        continue
                    self.stats.pop(name, None)  # not live: not routed to, /health counts it out
                    if self.health.failed(name, e):
                        self._count_down(name)
                    continue
                if self._workers.get(name) is not workers:
                    continue
                s.name = name  # (a worker's own name carries its incarnation; /metrics labels the replica)
                if self.health.answered(name):
                    log.warning("%s replica %s answers again", s.role, name)
                self._record(s, self.stats.get(name))
                self.stats[name] = s
                self._reserved[name] = 0  # (its figures count what we reserved before it answered)
                if self.policy == "prefix-aware":
                    await self._follow_cache(workers)
                if self.admission.refuse_over_slo:
                    self.forecast.refit(name, s)
            if self.queue:
                self.queue.wake()  # room may have come free that this router did not hear of (other routers')
            await asyncio.sleep(interval_s)

    async def _follow_cache(self, workers: dict[str, object]) -> None:
        """The workers' KV events since we last asked, into the prefix index. A worker that does not
        answer is left as it was: the stats poll decides whether it is down."""
        for worker, handle in workers.items():
            try:
                ev = await asyncio.wait_for(handle.kv_events.remote(*self.index.cursor(worker)), timeout=5)
            except Exception as e:
                log.debug("no KV events from %s: %r", worker, e)
                continue
            if self._send.get(worker) is not None:  # still one of ours (not dropped meanwhile)
                self.index.apply(worker, ev)

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
        # Cumulative since the replica started; `before` is None for a fresh incarnation (apply drops
        # its predecessor's stats), so a replacement's counts are all new.
        was = before.profile if before else {}
        self.metrics.count_prefix_cache(s.name, s.profile.get("prefix_queries", 0) - was.get("prefix_queries", 0),
                                        s.profile.get("prefix_hits", 0) - was.get("prefix_hits", 0))
        self.metrics.count_kv_savings(s.name, s.profile.get("tokens_computed", 0) - was.get("tokens_computed", 0),
                                      s.kv_blocks_reused - (before.kv_blocks_reused if before else 0),
                                      s.kv_bytes_received - (before.kv_bytes_received if before else 0))

    def _count_down(self, name: str) -> None:
        """A replica went down: /metrics shows it down and drops its load figures (no stale gauges)."""
        log.warning("%s replica %s is down: %s", self.health.roles[name], name, self.health.down[name])
        self.stats.pop(name, None)
        if self.metrics:
            role = self.health.roles[name]
            self.metrics.set_replica_up(role, name, False)
            self.metrics.remove_replica(role, name)


class _Lost(ServingError):
    """An attempt cannot go on: a replica it needs was lost, or (`transfer`: why) its KV transfer
    failed between two live replicas. The request moves (or, past the migration limit or the wait,
    ends with this error)."""

    def __init__(self, message: str, role: str, transfer: str | None = None):
        super().__init__(message)
        self.role = role
        self.transfer = transfer


def _raise_refused(refused: Refusal | None) -> None:
    """A worker refused the request itself (e.g. too long for its KV cache): the client's 400."""
    if refused is not None:
        raise refused.error()
