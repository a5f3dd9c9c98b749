"""Admission: whether a new request enters now, waits, or is refused — the router's one door.

A new request that no replica can take now (every decode replica's sequence slots or KV blocks
taken, every prefill or colocated replica holding router.max_queued_per_replica of this router's
requests) waits in the queue (router/admission_queue.py) rather than being refused; a 429 when the
queue is full or its wait ends. With router.refuse_over_slo, one whose forecast time to first token
(router/forecast.py) is over the SLO is refused at once. A moving request was admitted once: it
waits behind nobody. While the router drains, nothing new enters (503).
"""

import asyncio
import time
from dataclasses import dataclass

from pdserve.router.admission_queue import AdmissionQueue
from pdserve.router.attempt import Attempt
from pdserve.router.forecast import SlotHolder, TTFTForecast
from pdserve.router.replica_set import ReplicaSet
from pdserve.messages import Request
from pdserve.router.types import NoCapacityError, OverloadedError, ReplicaUnavailableError

MOVE_RETRY_S = 0.05  # how often a moving request whose decode replicas are all full asks again


@dataclass
class AdmissionPolicy:
    """The router's admission settings (cluster.yaml's router keys, slo.ttft_ms; router/server.py)."""

    max_queued: int = 1024  # router.max_queued: requests waiting in the queue, at most
    max_queued_per_replica: int = 256  # router.max_queued_per_replica: ours at a prefill/colocated replica before their first token
    queue_wait_s: float = 30.0  # router.queue_wait_s
    refuse_over_slo: bool = False  # router.refuse_over_slo
    ttft_slo_s: float = 1.0  # slo.ttft_ms / 1000
    prefill_step_tokens: int = 8192  # the prefill (or colocated) replicas' max_batch_tokens

    @classmethod
    def of(cls, cfg) -> "AdmissionPolicy":
        """From a ClusterConfig."""
        r = cfg.router
        # (A mixed cluster has both kinds of prompt replica: the smaller budget, the more steps foreseen.)
        step = {"colocated": cfg.colocated.max_batch_tokens, "disaggregated": cfg.prefill.max_batch_tokens,
                "mixed": min(cfg.colocated.max_batch_tokens, cfg.prefill.max_batch_tokens)}[cfg.topology]
        return cls(r.max_queued, r.max_queued_per_replica, r.queue_wait_s, r.refuse_over_slo,
                   cfg.slo.ttft_ms / 1000.0, step)


class AdmissionGate:
    def __init__(self, policy: AdmissionPolicy, replicas: ReplicaSet, metrics=None, replica_wait_s: float = 30.0):
        """replica_wait_s: router.replica_wait_s, how long a moving request asks for room."""
        self.policy = policy
        self.replicas = replicas
        self.metrics = metrics
        self.replica_wait_s = replica_wait_s
        self.queue = AdmissionQueue(policy.max_queued, policy.queue_wait_s, metrics)
        self.forecast = TTFTForecast(policy.prefill_step_tokens)
        self._draining = False  # shutting down: nothing new enters

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        if value:  # the queued hear it now (503), not at their deadline
            self.queue.wake_all()

    def closed_error(self) -> ReplicaUnavailableError:
        return ReplicaUnavailableError("the service is shutting down; retry on another instance")

    def has_room(self, replica: str) -> bool:
        """Whether a prefill (or colocated) replica holds fewer than router.max_queued_per_replica of
        our requests without a first token."""
        return self.replicas.prompts.get(replica, 0) < self.policy.max_queued_per_replica

    def wake(self) -> None:
        """Room may have come free: the first waiter tries again."""
        if self.queue:
            self.queue.wake()

    async def admit(self, request: Request, run: Attempt, place):
        """`place()` until it places the attempt (each call one try; None: no replica has room now).

        A new request that finds no room — or others waiting already — waits in the queue and tries
        again each time it is woken. A moving request asks again every MOVE_RETRY_S up to
        replica_wait_s (the blocks its lost attempt reserved are being freed by the abort sent as it
        ended, and that abort may reach the decode worker after this reservation does)."""
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
                    raise self.closed_error()
                if (placed := await place()) is not None:
                    self.queue.wake()  # there may be room for the next one too
                    return placed
        except OverloadedError as e:
            self.count_refused(e.reason)
            raise
        finally:
            if waiter is not None:
                self.queue.leave(waiter)
            if placed is not None and self.metrics:
                self.metrics.observe_queue_wait(time.monotonic() - since)

    def refuse_over_slo(self, request: Request, attempts) -> None:
        """Refuse (429) a new request whose forecast time to first token is over slo.ttft_ms
        (router.refuse_over_slo); nothing is refused before the replicas have measured their steps.
        attempts: this router's attempts under way."""
        if not self.policy.refuse_over_slo:
            return
        ttft = self.forecast_ttft(request, attempts)
        if ttft is None:
            return
        if self.metrics:
            self.metrics.observe_forecast(ttft)
        slo = self.policy.ttft_slo_s
        if ttft > slo:
            self.count_refused("predicted_ttft")
            raise OverloadedError(f"its first token would come in about {ttft * 1000:.0f} ms, over the service's "
                                  f"{slo * 1000:g} ms objective (slo.ttft_ms)", "predicted_ttft",
                                  retry_after_s=max(1.0, ttft - slo))

    def forecast_ttft(self, request: Request, attempts) -> float | None:
        """Seconds a new request would wait for its first token (router/forecast.py), or None
        without the measurements to tell."""
        rs = self.replicas
        if rs.mixed_cluster:  # it takes whichever path forecasts its first token sooner
            paths = [t for t in (self._path_ttft(request, attempts, c) for c in (True, False)) if t is not None]
            return min(paths) if paths else None
        return self._path_ttft(request, attempts, rs.colocated_cluster)

    def _path_ttft(self, request: Request, attempts, colocated: bool) -> float | None:
        """forecast_ttft over colocated replicas, or over prefill and decode ones; in a mixed cluster
        only the attempts holding (or reserving) a slot of that path's replicas count."""
        rs = self.replicas
        slot_replicas, prompt_replicas = (rs.colocated, rs.colocated) if colocated else (rs.decode, rs.prefill)
        mixed = rs.mixed_cluster
        holders, line = [], []
        for run in attempts:  # this router's requests: in a slot, or first in line for one
            if run.slot is None:
                continue
            if mixed and not (run.slot in slot_replicas or (run.slot == "" and not colocated)):
                continue
            r = run.request
            if colocated and not run.streaming:  # at its replica, but perhaps queued there for a slot
                line.append((r.params, len(r.prompt_ids)))
            else:
                holders.append(SlotHolder(r.params, len(r.prompt_ids), len(run.tokens), run.streaming))
        pool = self.forecast.pool([rs.stats[n] for n in rs.health.live(slot_replicas) if n in rs.stats], len(holders))
        prompt_at = min(rs.health.live(prompt_replicas), key=lambda n: rs.prompt_tokens.get(n, 0), default=None)
        if pool is None or prompt_at is None:
            return None
        line += [(w.request.params, len(w.request.prompt_ids)) for w in self.queue.ahead(request.priority)]
        wait = self.forecast.slot_wait(pool, holders, line, prompt_at, request.params)
        # Its prompt is computed behind those queued at the prefill replica now, if it gets a slot now;
        # later, that queue has moved on: alone.
        ahead = rs.prompt_tokens.get(prompt_at, 0) if wait == 0 else 0
        ttft = wait + self.forecast.prefill_s(prompt_at, ahead + len(request.prompt_ids))
        if not colocated:  # the KV's way to the decode replica, and the step that hands out the first token
            ttft += self.forecast.transfer_s.get(prompt_at, 0.0) + pool.step_s
        return ttft

    def replica_stats(self, name: str, s) -> None:
        """A replica's fresh stats (the replica set's poll): the forecast's fit of its step costs
        (refuse_over_slo's forecast reads it, and so does the adaptive prefill site's)."""
        self.forecast.refit(name, s)

    def count_refused(self, reason: str) -> None:
        if self.metrics:
            self.metrics.count_refused(reason)
