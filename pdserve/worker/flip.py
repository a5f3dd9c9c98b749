"""FlipWorker: the Ray actor of every worker — prefill, decode (a whole replica or one expert-parallel
rank), colocated — and, for a disaggregated replica of one worker, able to change role in place (a
flip: `pdserve scale --role`, `pdserve tune --apply`).

This module imports no torch, and neither does anything it imports: Ray loads an actor's class
wherever a handle to it is used, so the routers, which hold a handle to every worker for their
control calls (stats, KV events, the channel's address), would otherwise import the engine.

A role's code is its worker class (prefill/worker.py PrefillWorker, decode/worker.py DecodeWorker);
this actor holds one of them and hands it every call. A flip (asked by the controller, once the
replica is drained of its role's work) stops that worker's loop, closes its KV connector and hands
its engine, with the weights and the KV cache memory, to a worker of the other role built around it:
a new connector of the other side, a new loop. The process, its weights and its cache stay, so a
flip takes a fraction of a second where a stop and a start load the model anew.

The role classes and their arguments come from the launcher (pdserve/control/launcher.py), which
knows both; this layer imports neither. A Ray handle knows its actor's methods by the class it was
made from, so this class has every method of both roles: the one of the role it is not in answers
as a replica not paired with the caller's (the router places the request elsewhere).
"""

import threading
import time

from pdserve.messages import KVEvents, NewRequest, Refusal, ReplicaStats, ReserveResult, Unpaired, WorkerStartup


class FlipWorker:
    def __init__(self, role: str, name: str, roles: dict[str, tuple[type, dict]]):
        """roles: per role ('prefill', 'decode'), its worker class and the keyword arguments it is
        built with (besides its name and, on a flip, the engine)."""
        self._roles = roles
        self._switch = threading.Lock()  # held through a flip: calls wait for the new role's worker
        cls, kw = roles[role]
        self._worker = cls(name, **kw)
        self.flips = 0

    def _now(self):
        with self._switch:
            return self._worker

    # -- the flip ------------------------------------------------------------------------------------

    def flip(self, role: str, name: str) -> dict:
        """Serve in `role` under the worker name `name` from now on (the controller drained the old
        role first; what is left is cut off and moves). Returns what it took, in seconds."""
        with self._switch:
            old = self._worker
            if role == old.role:
                raise ValueError(f"{old.name} is a {role} worker already")
            t0 = time.perf_counter()
            engine = old.leave_role()
            t1 = time.perf_counter()
            cls, kw = self._roles[role]
            self._worker = cls(name, **kw, engine=engine)
            self.flips += 1
            t2 = time.perf_counter()
        return {"left_s": t1 - t0, "joined_s": t2 - t1, "total_s": t2 - t0, "free_blocks": engine.pool.num_free_blocks,
                "total_blocks": engine.pool.num_blocks}

    def role(self) -> tuple[str, str]:
        """(role, worker name) now."""
        w = self._now()
        return w.role, w.name

    # -- a prefill worker's calls ----------------------------------------------------------------------

    def prefill(self, requests: list[NewRequest]) -> list[Refusal | Unpaired | None]:
        w = self._now()
        if w.role != "prefill":
            return [Unpaired(w.name, "") for _ in requests]
        return w.prefill(requests)

    # -- a decode worker's calls ------------------------------------------------------------------------

    def reserve(self, requests: list[NewRequest], router: str) -> list[ReserveResult]:
        w = self._now()
        if w.role != "decode":
            return [ReserveResult(None, unpaired=Unpaired(w.name, r.prefill_id or "")) for r in requests]
        return w.reserve(requests, router)

    def generate(self, requests: list[NewRequest], router: str) -> list[Refusal | None]:
        w = self._now()
        if w.role not in ("decode", "colocated"):  # (routers send whole requests to decode and colocated replicas)
            raise RuntimeError(f"{w.name} is a {w.role} worker now: it takes no whole requests")
        return w.generate(requests, router)

    def meet_router(self, router: str) -> None:
        w = self._now()
        if w.role in ("decode", "colocated"):
            w.meet_router(router)

    def channel_address(self) -> dict:
        return self._now().channel_address()

    # -- every worker's --------------------------------------------------------------------------------

    def abort(self, request_ids: list[str]) -> None:
        self._now().abort(request_ids)

    def ready(self) -> bool:
        return self._now().ready()

    def kv_events(self, epoch: str, cursor: int) -> KVEvents:
        return self._now().kv_events(epoch, cursor)

    def startup(self) -> WorkerStartup:
        return self._now().startup()

    def metadata(self) -> bytes:
        return self._now().metadata()

    def add_peer(self, meta: bytes) -> dict:
        return self._now().add_peer(meta)

    def kv_pairs(self) -> dict[str, dict]:
        return self._now().kv_pairs()

    def node(self) -> dict:
        return self._now().node()

    def stats(self) -> ReplicaStats:
        return self._now().stats()
