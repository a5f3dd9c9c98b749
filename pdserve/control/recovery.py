"""A controller that Ray restarted takes the running cluster back (the Controller's part for it).

The controller is made with `max_restarts=-1`; every replica's workers, their placement groups and
the routers are detached actors of their own, so its death ends none of them, and requests go on
(their path never crosses it). The new process's `__init__` finds it was restarted and calls
`_recover`.
"""

import re
import threading
import time

import ray

from pdserve.actors import NAMESPACE
from pdserve.control.launcher import Incarnation, worker_name
from pdserve.control.placement import Demand


class Recovery:
    def _recover(self) -> None:
        """Take the running cluster back after this actor's process died and Ray restarted it: the
        replicas and routers are detached actors of their own, and go on serving meanwhile (the
        requests' path never crosses the controller). Each replica's newest incarnation is found by
        its workers' names, its KV pairs from its workers' own handshake records (the missing ones
        are made now), the routers by theirs; every router is told every replica again. Nothing
        healthy is restarted; the watch resumes."""
        t0 = time.monotonic()
        self._note("the controller restarted: taking the running cluster back")
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a.get("namespace") == NAMESPACE]
        found: dict[tuple[str, str], dict[int, list[str]]] = {}  # (role, replica) -> generation -> its actors
        for name in names:
            if m := _ACTOR.match(name):
                found.setdefault((m["role"], m["replica"]), {}).setdefault(int(m["gen"] or 0), []).append(name)
        for (role, replica), gens in sorted(found.items()):
            gen = max(gens)
            for old in [n for g, ns in gens.items() if g != gen for n in ns]:  # a replacement's leftovers
                _kill(old)
            if role == "router":
                self._adopt_router(replica, gen)
            else:
                self._adopt_replica(role, replica, gen, gens[gen])
        for inc in list(self.replicas.values()):  # their KV pairs as the workers recorded them
            for w, h in inc.ranks.items():
                if inc.role in ("prefill", "decode"):
                    try:
                        for peer, rec in ray.get(h.kv_pairs.remote(), timeout=30).items():
                            self.pairs.records[(w, peer)] = rec
                    except Exception as e:
                        self._restarting.setdefault(inc.replica, f"it did not answer the controller ({_cause(e)})")
        kv = [i for i in self.replicas.values() if i.role in ("prefill", "decode") and i.replica not in self._restarting]
        self._pair([(p, pw, d, dw) for p in kv if p.role == "prefill" for d in kv if d.role == "decode"
                    for pw in p.ranks for dw in d.ranks
                    if (pw, dw) not in self.pairs.records or (dw, pw) not in self.pairs.records])
        for inc in self.replicas.values():
            self._tell(inc.change())
        self.state = "running"
        self._note(f"recovered {len(self.replicas)} replicas and {len(self.routers)} routers in "
                   f"{time.monotonic() - t0:.2f} s; none restarted")
        self._watching.set()
        threading.Thread(target=self._watch, name="pdserve-watch", daemon=True).start()

    def _adopt_replica(self, role: str, replica: str, gen: int, actors: list[str]) -> None:
        name = worker_name(replica, gen)
        ranks = {n: ray.get_actor(n, namespace=NAMESPACE) for n in sorted(actors) if not _TP_FOLLOWER.search(n)}
        followers = {n: ray.get_actor(n, namespace=NAMESPACE) for n in sorted(actors) if _TP_FOLLOWER.search(n)}
        born_as = None
        if (now := _flipped(ranks)) is not None:  # its actor's name says its first role, not its role now
            born_as, (role, name) = name, now
            replica, _, g = name.partition("@")
            gen = int(g or 0)
            ranks = {name: next(iter(ranks.values()))}
        demand = Demand.of(self.config, role)
        try:
            pg = ray.util.get_placement_group(born_as or name)
        except ValueError:  # (none by that name: its workers are all that is left of it)
            pg = None
        inc = Incarnation(role, replica, gen, ranks, placement_group=pg, followers=followers, restarts=gen,
                          held={k: v * demand.ranks for k, v in demand.bundle.items()}, born_as=born_as)
        self.replicas[replica] = inc
        try:
            self._wait_ready([inc])
        except Exception as e:  # the watch replaces it
            self._restarting.setdefault(replica, f"it was not ready when the controller restarted ({_cause(e)})")
            return
        self._note(f"{replica}: taken back ({', '.join(ranks)})")

    def _adopt_router(self, slot: str, gen: int) -> None:
        name = worker_name(slot, gen)
        handle = ray.get_actor(name, namespace=NAMESPACE)
        try:
            ends = ray.get(handle.info.remote(), timeout=30)["endpoints"]
        except Exception as e:
            self.routers[slot] = {"generation": gen, "name": name, "handle": handle, "ends": {}, "restarts": gen}
            self._restarting.setdefault(slot, f"it did not answer the controller ({_cause(e)})")
            return
        self.routers[slot] = {"generation": gen, "name": name, "handle": handle, "ends": ends, "restarts": gen}
        if not self.endpoints or slot == "pdserve-router-0":
            self.endpoints = {k: v for k, v in ends.items() if k != "own"}
            self._ports = {k: int(v.rsplit(":", 1)[1]) for k, v in self.endpoints.items() if k in ("http", "grpc")}
        self._note(f"{name}: taken back")


# The actors of a cluster, by name (launcher.py): pdserve-<role>-<i>[@<generation>][-rank<r> | -tp<r>].
_ACTOR = re.compile(r"^(?P<replica>pdserve-(?P<role>prefill|decode|colocated|router)-\d+)(?:@(?P<gen>\d+))?"
                    r"(?:-rank\d+|-tp\d+)?$")
_TP_FOLLOWER = re.compile(r"-tp\d+$")


def _flipped(ranks: dict) -> tuple[str, str] | None:
    """A flipped worker's (role, worker name) now, where they differ from its actor's name; else None."""
    if len(ranks) != 1:
        return None
    (actor, handle), = ranks.items()
    ask = getattr(handle, "role", None)  # (FlipWorkers only: prefill and decode replicas of one worker)
    if ask is None:
        return None
    try:
        role, name = ray.get(ask.remote(), timeout=30)
    except Exception:  # not answering: adopted as it is named; the watch replaces it if it is down
        return None
    return None if name == actor else (role, name)


def restarted() -> bool:
    """Whether this is a controller Ray restarted (after its process died), not the first."""
    try:
        return ray.get_runtime_context().was_current_actor_reconstructed
    except Exception:  # (built outside an actor)
        return False


def _kill(name: str) -> None:
    try:
        ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
    except Exception:
        pass


def _cause(e: Exception) -> str:
    """An error's last line (Ray's carry the remote traceback before it)."""
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__
