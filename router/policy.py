"""Where an attempt goes: one class per routing policy (cluster.yaml's router.policy).

A policy answers two questions, among the live replicas with room that the lifecycle hands it
(router/lifecycle.py): which prefill (or colocated) replica computes the prompt, and in which
order to try the decode replicas (and their ranks) for the KV reservation. It reads the replica
set's figures (router/replica_set.py) and decides nothing else: liveness, room, KV pairs and
retries are the lifecycle's.

- round-robin: in turn, per role.
- kv-aware: the prompt to the replica with the fewest of our requests in flight; the KV to the
  decode replica with the most free blocks.
- prefix-aware: the least work before the first token, counting what each worker's prefix cache
  holds (its KV events, router/prefix_index.py) and a session's last turn; kv-aware where the
  request has no block hashes.
"""

import itertools
from collections import OrderedDict
from typing import Protocol

from pdserve.engine.block_pool import HashChain, salt_root
from pdserve.router.attempt import Attempt
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.replica_set import ReplicaSet
from pdserve.messages import Request

# prefix-aware: a token queued requests leave a replica to compute, against one of ours
QUEUE_WEIGHT = 1.0
# prefix-aware: a replica with more than SLACK + RATIO x the least-loaded one's requests of ours
# takes no more, whatever it caches
BALANCE_SLACK, BALANCE_RATIO = 8, 1.5
# prefix-aware decode: a replica's memory pressure counts from this share of its blocks in use
PRESSURE_FROM = 0.5
SESSIONS = 100_000  # conversations remembered for affinity, least recently used forgotten first


class RoutingPolicy(Protocol):
    index: PrefixIndex | None  # the workers' cached blocks, where the policy reads them (else None)

    def prepare(self, run: Attempt, request: Request, sent: list[int]) -> None:
        """Before the attempt is placed (prefix-aware: its prompt's block hashes)."""

    def prompt_replica(self, names: list[str], role: str, run: Attempt, request: Request,
                       sent: list[int]) -> str:
        """Of `names` (live, with room; at least one), the replica to compute the attempt's prompt."""

    def decode_order(self, names: list[str], run: Attempt, request: Request) -> list[tuple[str, list[str]]]:
        """The live decode replicas `names`, best candidates first, each with its ranks in the order to try."""

    def routed(self, run: Attempt, request: Request, workers: dict[str, str]) -> None:
        """The attempt went to these replicas (-> the worker of each that holds it)."""


class KVAware:
    index = None

    def __init__(self, replicas: ReplicaSet):
        self.replicas = replicas

    def prepare(self, run: Attempt, request: Request, sent: list[int]) -> None:
        pass

    def prompt_replica(self, names, role, run, request, sent) -> str:
        loads = self.replicas.loads
        return min(names, key=lambda n: loads[n])  # fewest requests in flight from us

    def decode_order(self, names, run, request) -> list[tuple[str, list[str]]]:
        # Most free KV blocks first, then fewest requests from us. Free as last reported less what we
        # reserved or placed there since (`reserved`): stats up to a poll old would send a whole burst
        # to the one replica that had the most.
        rs = self.replicas
        stats, loads, decode, reserved = rs.stats, rs.loads, rs.decode, rs.reserved
        names = sorted(names, key=lambda n: (reserved.get(n, 0) - getattr(stats.get(n), "free_blocks", 0), loads[n]))
        return [(n, decode[n].rank_order()) for n in names]

    def routed(self, run, request, workers) -> None:
        pass


class RoundRobin(KVAware):
    def __init__(self, replicas: ReplicaSet):
        super().__init__(replicas)
        # A turn per role: one counter stepped by both choices of a request would hand every request
        # the same pair where the roles have as many replicas (2 + 2: prefill-0, decode-1).
        self._turn: dict[str, itertools.count] = {}

    def prompt_replica(self, names, role, run, request, sent) -> str:
        return names[next(self._turn.setdefault(role, itertools.count())) % len(names)]

    def decode_order(self, names, run, request) -> list[tuple[str, list[str]]]:
        k = next(self._turn.setdefault("decode", itertools.count())) % len(names)
        return [(n, self.replicas.decode[n].rank_order()) for n in names[k:] + names[:k]]


class PrefixAware(KVAware):
    def __init__(self, replicas: ReplicaSet, block_size: int):
        super().__init__(replicas)
        self.block_size = block_size  # the engines' KV block: the unit its hashes cover
        self.index = PrefixIndex()  # what each worker's prefix cache holds (the replica set feeds it)
        # session -> (its last turn's replicas, the blocks of that prompt, its last block's hash)
        self._sessions: OrderedDict[str, tuple[tuple[str, ...], int, bytes]] = OrderedDict()

    def prepare(self, run, request, sent) -> None:
        # Salted as the engines salt it (Engine._new_sequence): a key's prompt matches only its own
        # key's blocks here, as in the replicas' caches. Hashed as far as placing it reads (a fresh
        # prompt: its first block); the rest once it is on its way (PrefixIndex.routed).
        run.hashes = HashChain(request.prompt_ids + sent, self.block_size, salt_root(request.params.cache_salt))

    def prompt_replica(self, names, role, run, request, sent) -> str:
        """The least work before this request's first token there, in prompt tokens to compute: those
        its cache lacks, plus those the requests we sent it without a first token yet leave it to
        compute (their prompts less what it held of them: a queue of cached turns is short work; counted
        by whole prompts, a queue spilled sessions). A queued token weighs as one of ours: weighed
        lower, a shared system prompt herds requests onto one replica; at one, a session moves only
        when the queue's excess outweighs recomputing its history. The balance guard bounds what one
        replica takes."""
        if not run.hashes:
            return super().prompt_replica(names, role, run, request, sent)
        loads, queued = self.replicas.loads, self.replicas.prompt_tokens
        tokens = len(request.prompt_ids) + len(sent)
        worker = {n: self.replicas.worker(n) for n in names}
        held = self._cached(run, request, {w: n for n, w in worker.items()})
        cost = {n: tokens - held[worker[n]] * self.block_size + QUEUE_WEIGHT * queued.get(n, 0) for n in names}
        name = self._balanced(min(names, key=lambda n: (cost[n], loads[n])), names)
        run.to_compute = max(1, tokens - held[worker[name]] * self.block_size)
        return name

    def decode_order(self, names, run, request) -> list[tuple[str, list[str]]]:
        """Blocks the KV must move to it (its own cache keeps the rest: only new KV moves) plus its
        pressure: nothing up to PRESSURE_FROM of its blocks in use, then the excess squared over the
        rest (half the pool when full). A replica far from full decodes a few more sequences at almost
        no cost, so there the cached history wins; one filling up must not take every history it holds."""
        if not run.hashes:
            return super().decode_order(names, run, request)
        decode, stats, loads = self.replicas.decode, self.replicas.stats, self.replicas.loads
        held = self._cached(run, request, {r: n for n in names for r in decode[n].ranks})
        order = []
        for n in names:
            mine = sorted(decode[n].rank_order(), key=lambda r: -held[r])  # (stable: free blocks next)
            s = stats.get(n)
            used = (s.total_blocks - s.free_blocks if s else 0) + self.replicas.reserved.get(n, 0)
            over = max(0.0, used - PRESSURE_FROM * s.total_blocks) if s and s.total_blocks else 0.0
            pressure = over * over / ((1 - PRESSURE_FROM) * s.total_blocks) if over else 0.0
            order.append((len(run.hashes) - held[mine[0]] + pressure, n, mine))
        ranked = [(n, mine) for _, n, mine in sorted(order, key=lambda o: (o[0], loads[o[1]]))]
        first = self._balanced(ranked[0][0], names)  # the same guard as the prompt's replica
        return sorted(ranked, key=lambda r: r[0] != first)

    def routed(self, run, request, workers) -> None:
        """Their caches hold the prompt once it is prefilled there (or its KV is in); a session's next
        turn is likely to continue it."""
        for worker in workers.values():
            self.index.routed(worker, run.hashes)
        if request.session is None or not run.hashes:
            return
        self._sessions[request.session] = (tuple(workers), len(run.hashes), run.hashes[-1])  # (hashes it all)
        self._sessions.move_to_end(request.session)
        if len(self._sessions) > SESSIONS:
            self._sessions.popitem(last=False)

    def _balanced(self, best: str, names: list[str]) -> str:
        """The costs count tokens, not requests: a replica whose every prompt is cached would take all
        of them, however many (each still a step, a slot, a KV transfer). Past a spread of requests,
        the least-loaded replica takes it instead (an operator who scales up sees the new replica used)."""
        loads = self.replicas.loads
        least = min(names, key=lambda n: loads[n])
        return least if loads[best] > BALANCE_SLACK + BALANCE_RATIO * loads[least] else best

    def _cached(self, run: Attempt, request: Request, workers: dict[str, str]) -> dict[str, int]:
        """Per worker (-> its replica), the leading blocks of the request's prompt its cache holds: as
        its KV events say, or, on the replicas that served the session's last turn, that turn's prompt
        where this one continues it (their events may not have come yet, or went to another router)."""
        held = self.index.match(run.hashes, workers)
        last = self._sessions.get(request.session) if request.session else None
        if last is not None:
            replicas, n, tail = last
            if 0 < n <= len(run.hashes) and run.hashes[n - 1] == tail:  # a chain: equal there, equal before
                for w, replica in workers.items():
                    if replica in replicas:
                        held[w] = max(held[w], n)
        return held


def routing_policy(policy: str, replicas: ReplicaSet, block_size: int) -> RoutingPolicy:
    """The routing policy router.policy names."""
    if policy == "round-robin":
        return RoundRobin(replicas)
    if policy == "kv-aware":
        return KVAware(replicas)
    if policy == "prefix-aware":
        return PrefixAware(replicas, block_size)
    raise ValueError(f"router.policy: {policy!r} is not one of prefix-aware, kv-aware, round-robin")
