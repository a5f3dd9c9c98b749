"""The replicas a router routes to, as the controller describes them and as their stats say.

It owns: the replica set and its changes (`apply`: started, replaced, draining, gone), the calls
that reach each worker (one batched hand-off per worker and kind of call, over the worker's direct
channel — pdserve/channel/ — or, with `router.channel: ray`, Ray calls), the stats poll and the
replicas' health (router/replica_health.py), the KV pairs a request may go over, what this
router's requests hold at each replica (the counts routing and admission read), and the /metrics
those figures feed. It decides nothing about a request: the lifecycle (router/lifecycle.py) does.
"""

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from ray.exceptions import RayActorError

from pdserve.channel.router_end import WorkerLink
from pdserve.channel.wire import ABORT, GENERATE, PREFILL, RESERVE
from pdserve.messages import ReplicaChange, ReplicaStats, RequestDelta
from pdserve.router.attempt import Attempt, Lost
from pdserve.router.decode_replica import DecodeReplica
from pdserve.router.handoff import HandOff
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.replica_health import ReplicaHealth

log = logging.getLogger(__name__)
STATS_TIMEOUT_S = 5.0  # a stats or KV-events call unanswered this long counts as a missed poll


@dataclass
class Channel:
    """How this router reaches workers over the direct channel: the cluster's token it proves, and
    its host's address (workers there are reached over their Unix socket; None: every worker over
    TCP, `router.channel_transport: tcp`)."""

    token: str | None
    node: str | None


class ReplicaSet:
    def __init__(self, router: str, metrics=None, channel: Channel | None = None):
        """router: this router's actor name (where decode and colocated workers send deltas).
        channel: requests, aborts and deltas over a direct channel per worker; None: Ray calls."""
        self.router = router
        self.metrics = metrics
        self.channel = channel
        self.links: dict[str, WorkerLink] = {}  # worker -> its channel (channel set)
        self.deliver: Callable[[list[RequestDelta]], None] = lambda deltas: None  # deltas from the channel
        self.index: PrefixIndex | None = None
        self._on_stats = lambda name, s: None
        self._on_gone = lambda name: None
        self.prefill: dict[str, object] = {}  # replica name -> actor handle
        self.decode: dict[str, DecodeReplica] = {}  # replica name -> its rank(s)
        self.colocated: dict[str, object] = {}  # replica name -> actor handle
        self.workers: dict[str, dict[str, object]] = {}  # replica -> its workers (actor name -> handle)
        self.health = ReplicaHealth()
        self.stats: dict[str, ReplicaStats] = {}
        self._restarts: dict[str, int] = {}  # replica -> restarts counted in /metrics
        # One hand-off per worker and kind of call: a turn's requests go out in one Ray call.
        self.send: dict[str, HandOff] = {}  # worker -> its calls that bring work
        self.send_abort: dict[str, HandOff] = {}
        self.send_whole: dict[str, HandOff] = {}  # decode worker -> its whole requests (local prefill)
        # What this router's requests hold at each replica: requests placed there in flight (a drain
        # waits for 0); at a prefill (or colocated) replica, those without a first token yet and the
        # prompt tokens they leave it to compute; at a decode replica, the blocks reserved since its
        # last stats.
        self.loads: dict[str, int] = {}
        self.prompts: dict[str, int] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.reserved: dict[str, int] = {}

    # -- the set, as the controller says -----------------------------------------------------------

    def apply(self, change: ReplicaChange) -> None:
        """A replica started, was replaced, drains or is gone (from the controller)."""
        name, role = change.replica, change.role
        if change.state == "gone":
            self._drop_workers(name)
            for d in (self.prefill, self.decode, self.colocated, self.workers, self.stats):
                d.pop(name, None)
            self._on_gone(name)
            self.health.leave(name)
            if self.metrics:
                self.metrics.forget_replica(role, name)
            return
        fresh = self.workers.get(name) != change.ranks
        if fresh:
            self._drop_workers(name)
            self.workers[name] = dict(change.ranks)
            self.stats.pop(name, None)  # a new incarnation counts from 0
            worker, handle = next(iter(change.ranks.items()))  # (prefill and colocated: one worker)
            if role == "prefill":
                self.prefill[name] = handle
            elif role == "colocated":
                self.colocated[name] = handle
            else:
                self.decode[name] = DecodeReplica(name, dict(change.ranks))
            for worker, w in change.ranks.items():
                self._hand_offs(role, worker, w)
            self.loads.setdefault(name, 0)
        self.health.join(name, role, fresh, draining=change.state == "draining")
        seen = self._restarts.get(name, 0)
        if self.metrics and change.restarts > seen:
            self.metrics.count_restarts(role, name, change.restarts - seen)
        self._restarts[name] = max(seen, change.restarts)

    def _hand_offs(self, role: str, worker: str, w) -> None:
        """The worker's batched calls: over its channel, or Ray calls."""
        if self.channel is None:
            sends = {PREFILL: lambda items: w.prefill.remote(items),
                     RESERVE: lambda items: w.reserve.remote(items, self.router),
                     GENERATE: lambda items: w.generate.remote(items, self.router),
                     ABORT: lambda items: w.abort.remote(items)}
        else:
            async def locate():
                return await w.channel_address.remote()

            link = self.links[worker] = WorkerLink(self.router, worker, self.channel.token, self.channel.node,
                                                   locate, self._delivered, self._link_lost)
            sends = {kind: lambda items, kind=kind: link.call(kind, items) for kind in (PREFILL, RESERVE, GENERATE,
                                                                                           ABORT)}
        if role == "prefill":
            self.send[worker] = HandOff(sends[PREFILL])
        elif role == "colocated":
            self.send[worker] = HandOff(sends[GENERATE])
        else:
            self.send[worker] = HandOff(sends[RESERVE])
            self.send_whole[worker] = HandOff(sends[GENERATE])
        self.send_abort[worker] = HandOff(sends[ABORT], answered=False)

    def _delivered(self, deltas: list[RequestDelta]) -> None:
        self.deliver(deltas)

    def _link_lost(self, worker: str, error: BaseException) -> None:
        """A worker's channel closed (its process died, its host is cut off): its replica is down, and
        the requests waiting on it move at once."""
        for replica, workers in self.workers.items():
            if worker in workers:
                if self.health.failed(replica, error):
                    self.count_down(replica)
                return

    async def connect(self, workers: list[str], timeout_s: float) -> None:
        """Open the channels to these workers now (at most `timeout_s`): else the first request to
        each paid for the address lookup and the connection."""
        opening = [self.links[w].open() for w in workers if w in self.links]
        if opening:
            await asyncio.wait(opening, timeout=timeout_s)

    def follow(self, index: PrefixIndex | None, on_stats, on_gone) -> None:
        """What else follows each replica. index: the prefix index to keep fed with the workers' KV
        events (prefix-aware routing), or None; on_stats(name, stats), on_gone(name): admission's
        forecast."""
        self.index, self._on_stats, self._on_gone = index, on_stats, on_gone

    def _drop_workers(self, replica: str) -> None:
        for worker in self.workers.get(replica, {}):
            if (link := self.links.pop(worker, None)) is not None:
                link.close()
            self.send.pop(worker, None)
            self.send_abort.pop(worker, None)
            self.send_whole.pop(worker, None)
            if self.index is not None:
                self.index.drop(worker)  # a new incarnation's cache starts empty

    def of_role(self, role: str) -> dict:
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]

    def worker(self, replica: str) -> str:
        """The replica's (first) worker: a prefill or colocated replica has one."""
        return next(iter(self.workers[replica]))

    @property
    def colocated_cluster(self) -> bool:
        """Whether every request is served whole by one replica (no decode replicas: colocated)."""
        return not self.decode

    @property
    def mixed_cluster(self) -> bool:
        """Whether an attempt may go whole to a colocated replica or down the disaggregated path."""
        return bool(self.colocated) and bool(self.decode)

    def placed(self, replica: str) -> int:
        """Requests of this router on the replica now (a drain waits for 0)."""
        return self.loads.get(replica, 0)

    def restarts(self) -> dict[str, int]:
        """Replacements of each replica so far, as the controller told (the dashboard's view without it)."""
        return dict(self._restarts)

    def ready(self) -> bool:
        live = {s.role for s in self.stats.values()}
        return "colocated" in live or {"prefill", "decode"} <= live

    def degraded(self) -> dict[str, str]:
        out = {n: f"down: {why}" for n, why in self.health.down.items()}
        return out | {n: "draining" for n in self.health.draining}

    def paired(self, p_name: str, d_name: str | None = None, rank: str | None = None) -> bool:
        """Whether a prefill replica has a KV pair with the decode rank (any rank of any live decode
        replica, where none is named): both ends list each other among their peers, as their latest
        stats said. A pair that is not (yet) handshaked takes no request: its KV could not move."""
        p = self.stats.get(p_name)
        if p is None:
            return False
        p_worker = next(iter(self.workers.get(p_name, {})), None)
        pairs = [(d_name, rank)] if rank is not None else \
            [(n, r) for n in self.health.live(self.decode) for r in self.decode[n].ranks]
        for n, r in pairs:
            d = self.decode[n].rank_stats.get(r) if n in self.decode else None
            if d is not None and r in p.kv_peers and p_worker in d.kv_peers:
                return True
        return False

    # -- what this router's requests hold ----------------------------------------------------------

    def place(self, name: str, run: Attempt) -> None:
        """The attempt is placed at the replica (counted in its load until the attempt ends)."""
        self.loads[name] += 1
        run.placed.append(name)

    def unplace(self, run: Attempt, name: str | None = None) -> None:
        """The attempt leaves the replica `name` (a try there that did not take it), or every one."""
        for n in run.placed if name is None else [name]:
            if n in self.loads:
                self.loads[n] -= 1
        if name is None:
            run.placed.clear()
        else:
            run.placed.remove(name)

    def await_prompt(self, run: Attempt, replica: str, tokens: int) -> None:
        """The attempt's prompt (`tokens` long) is now the `replica`'s to compute: all of it, or what
        the routing policy found its cache lacks."""
        run.prompt_at = replica
        run.prompt_work = tokens if run.to_compute is None else run.to_compute
        self.prompts[replica] = self.prompts.get(replica, 0) + 1
        self.prompt_tokens[replica] = self.prompt_tokens.get(replica, 0) + run.prompt_work

    def prompt_done(self, run: Attempt) -> bool:
        """The attempt's first token came (or it ended); True if its prefill replica has room again."""
        replica, run.prompt_at = run.prompt_at, None
        if replica is None:
            return False
        self.prompts[replica] -= 1
        self.prompt_tokens[replica] -= run.prompt_work
        if self.prompts[replica] == 0:
            self.prompt_tokens[replica] = 0
        return True

    # -- calls -------------------------------------------------------------------------------------

    async def call(self, replica: str, worker: str, ref):
        """Await a call to a replica's worker; one whose process died meanwhile is counted down
        (unless a replacement took its place meanwhile), and the attempt is lost (it moves)."""
        try:
            return await ref
        except (RayActorError, ConnectionError) as e:  # died, or unreachable (its node died; its channel closed)
            if worker in self.workers.get(replica, {}) and self.health.failed(replica, e):
                self.count_down(replica)
            role = self.health.roles.get(replica, "replica")
            raise Lost(f"the {role} replica {replica} was lost ({self.health.down.get(replica, 'its process died')})",
                       role) from None

    def count_placed(self, name: str) -> None:
        if self.metrics:
            self.metrics.count_placed(self.health.roles[name], name)

    def count_down(self, name: str) -> None:
        """A replica went down: /metrics shows it down and drops its load figures (no stale gauges)."""
        log.warning("%s replica %s is down: %s", self.health.roles[name], name, self.health.down[name])
        self.stats.pop(name, None)
        if self.metrics:
            role = self.health.roles[name]
            self.metrics.set_replica_up(role, name, False)
            self.metrics.remove_replica(role, name)

    # -- stats and health --------------------------------------------------------------------------

    async def refresh_stats(self, interval_s: float = 0.5, after=lambda: None, pause=asyncio.sleep) -> None:
        """Keep replica stats (routing, /health, /metrics) and health fresh; runs for the router's
        life. `after()` runs after each round (admission wakes its queue: other routers' requests
        finish too). `pause(interval_s)` between rounds (RouterCore's: longer while idle, router/idle.py)."""
        while True:
            for name in list(self.workers):
                await self._poll(name)
            after()
            await pause(interval_s)

    async def _poll(self, name: str) -> None:
        workers = self.workers.get(name)
        if workers is None:  # gone meanwhile
            return
        try:
            if name in self.decode:
                s: ReplicaStats = await self.decode[name].fetch_stats(timeout_s=STATS_TIMEOUT_S)
            else:
                s = await asyncio.wait_for(next(iter(workers.values())).stats.remote(), timeout=STATS_TIMEOUT_S)
        except Exception as e:
            if self.workers.get(name) is not workers:  # replaced or gone while we asked
                return
            self.stats.pop(name, None)  # not live: not routed to, /health counts it out
            if self.health.failed(name, e):
                self.count_down(name)
            return
        if self.workers.get(name) is not workers:
            return
        s.name = name  # (a worker's own name carries its incarnation; /metrics labels the replica)
        if self.health.answered(name):
            log.warning("%s replica %s answers again", s.role, name)
        self.record(s, self.stats.get(name))
        self.stats[name] = s
        self.reserved[name] = 0  # (its figures count what we reserved before it answered)
        if self.index is not None:
            await self._follow_cache(workers)
        self._on_stats(name, s)

    async def _follow_cache(self, workers: dict[str, object]) -> None:
        """The workers' KV events since we last asked, into the prefix index. A worker that does not
        answer is left as it was: the stats poll decides whether it is down."""
        for worker, handle in workers.items():
            try:
                ev = await asyncio.wait_for(handle.kv_events.remote(*self.index.cursor(worker)), timeout=STATS_TIMEOUT_S)
            except Exception as e:
                log.debug("no KV events from %s: %r", worker, e)
                continue
            if self.send.get(worker) is not None:  # still one of ours (not dropped meanwhile)
                self.index.apply(worker, ev)

    def record(self, s: ReplicaStats, before: ReplicaStats | None) -> None:
        """A replica's latest stats into /metrics."""
        if not self.metrics:
            return
        self.metrics.set_replica_up(s.role, s.name, True)
        self.metrics.set_replica_stats(s.role, s.name, s.running, s.waiting, s.total_blocks - s.free_blocks,
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
        self.metrics.count_internal_refusals(s.name, s.refusals, before.refusals if before else {})
        self.metrics.count_spec_decode(s.profile.get("spec_draft_tokens", 0) - was.get("spec_draft_tokens", 0),
                                       s.profile.get("spec_accepted_tokens", 0) - was.get("spec_accepted_tokens", 0))
