"""Flips (the Controller's part for them): a replica of one worker turns from prefill to decode or
back in place — its process, weights and KV cache memory stay; `pdserve scale --role`, and `pdserve
tune --apply` where a split moves replicas between the two roles.

A flip, one replica at a time:
1. drain: the routers are told the replica drains (they send it no new work of its role); the
   controller waits until it and every router say it holds nothing (`Scaling._drain`, at most
   grace_s: what is left is cut off by the worker and moves, as from a replica lost);
2. leave: the routers are told the replica is gone, its KV pairs forgotten;
3. switch: the worker changes its engine's role and its KV connector's side (pdserve/worker/flip.py);
4. pair: its new connector pairs with every live worker of the other role (`Handshake._handshake`);
5. join: the routers are told of a new replica of the new role (`pdserve-decode-<i>`, its next
   free index), whose worker is the same Ray actor under the new name.
A new name rather than the old one in a new role: to a router the flip is a replica gone and one
started, which it knows already (its prefix index, health, load counts and migrations start clean,
and a worker name is one KV engine id per connector, never reused by a peer's records). The Ray
actor keeps the name it was started under (`Incarnation.born_as`), which no new replica then takes.
"""

import time

import ray

from pdserve.control.launcher import Incarnation, taken_names, worker_name
from pdserve.control.recovery import _cause

FLIP_S = 60  # the worker's switch: its loop's last step, a connector closed and one made (seconds)
ROLES = ("prefill", "decode")


class Flipping:
    def flip(self, replica: str | None, role: str, grace_s: float) -> dict:
        """Turn `replica` (None: the controller's choice, the newest of the other role, as a scale
        removes) into a `role` replica. Returns what it became and what each part took (seconds;
        `serving_s` from the call to serving in the new role)."""
        with self._scaling:  # (a scale's new replicas are not in self.replicas while they load: names)
            return self._flip(replica, role, grace_s)

    def _flip(self, replica: str | None, role: str, grace_s: float) -> dict:
        t0 = time.monotonic()
        with self._life:
            if self.state not in ("running", "degraded"):
                raise RuntimeError(f"the cluster is {self.state}")
            if role not in ROLES:
                raise ValueError(f"{role!r}: a flip turns a replica into 'prefill' or 'decode'")
            if (why := self.launcher.flippable()) is not None:
                raise ValueError(why)
            inc = self._to_flip(replica, role)
            inc.state = "draining"
            self._tell(inc.change())
            self._note(f"flip: {inc.replica} drains its {inc.role} work")
        self._drain([inc], grace_s)  # (not holding _life: a dead replica meanwhile is still replaced)
        drained = time.monotonic()
        with self._life:
            if self.replicas.get(inc.replica) is not inc:
                raise RuntimeError(f"{inc.replica} was lost while it drained; its replacement is a "
                                   f"{inc.role} replica")
            new = self._leave(inc, role)
            try:
                took = ray.get(new.ranks[new.replica].flip.remote(role, new.replica), timeout=FLIP_S)
                switched = time.monotonic()
                self._handshake([new])
            except Exception as e:  # a worker in no known state: the watch replaces it (in its new role)
                self.replicas[new.replica] = new
                self._restarting[new.replica] = f"its flip from {inc.role} failed ({_cause(e)})"
                raise RuntimeError(f"{inc.replica}: the flip to {role} failed ({_cause(e)}); "
                                   f"a fresh {new.replica} replaces it") from None
            self.replicas[new.replica] = new
            self._tell(new.change())
            done = time.monotonic()
            new.flipped = f"flipped from {inc.replica}, serving {done - t0:.2f} s after the command"
            self._note(f"flip: {inc.replica} serves as {new.replica} {done - t0:.2f} s after the call (drain "
                       f"{drained - t0:.2f} s, switch {took['total_s']:.2f} s, KV pairs {done - switched:.2f} s)")
        return {"replica": inc.replica, "as": new.replica, "role": role, "serving_s": done - t0,
                "drain_s": drained - t0, "switch_s": took["total_s"], "pair_s": done - switched,
                "free_blocks": took["free_blocks"], "total_blocks": took["total_blocks"]}

    def flippable(self) -> str | None:
        """None when this cluster's replicas can flip; else why not (`pdserve tune --apply` asks)."""
        return self.launcher.flippable()

    def _to_flip(self, replica: str | None, role: str) -> Incarnation:
        other = ROLES[1 - ROLES.index(role)]
        serving = [i for i in self.replicas.values() if i.state == "serving" and i.replica not in self._restarting]
        if replica is None:
            of_other = sorted((i for i in serving if i.role == other), key=lambda i: _index(i.replica))
            if not of_other:
                raise ValueError(f"no serving {other} replica to flip to {role}")
            inc = of_other[-1]
        else:
            inc = self.replicas.get(replica)
            if inc is None:
                raise ValueError(f"{replica}: no such replica (the cluster has {', '.join(sorted(self.replicas))})")
            if inc.role == role:
                raise ValueError(f"{replica} is a {role} replica already")
            if inc.role not in ROLES:
                raise ValueError(f"{replica} is a {inc.role} replica: a flip moves one between prefill and decode")
            if all(inc is not i for i in serving):
                raise ValueError(f"{replica} is {'being replaced' if replica in self._restarting else inc.state}")
        if len(inc.ranks) != 1 or inc.followers:
            raise ValueError(f"{inc.replica} has {len(inc.ranks) + len(inc.followers)} workers: a flip needs a "
                             f"replica of one worker")
        if sum(1 for i in serving if i.role == inc.role) < 2:
            raise ValueError(f"{inc.replica} is the only serving {inc.role} replica: the cluster needs one")
        return inc

    def _leave(self, inc: Incarnation, role: str) -> Incarnation:
        """The drained replica leaves the routers and the books; returns the replica its worker
        becomes (not yet in the set)."""
        inc.state = "gone"
        self._tell(inc.change())
        self.replicas.pop(inc.replica, None)
        self._forget_pairs(inc)
        self._beats.forget(inc.replica)
        self._note(f"flip: {inc.replica} left the routers; its worker turns {role}")
        (born, handle), = inc.ranks.items()
        name = worker_name(self._free_replica(role), 0)
        return Incarnation(role, name, 0, {name: handle}, placement_group=inc.placement_group,
                           chosen_node=inc.chosen_node, held=inc.held,
                           nodes={name: n for n in inc.nodes.values()}, born_as=inc.born_as or born)

    def _free_replica(self, role: str) -> str:
        """The next replica name of `role` that no replica has, and no flipped worker was started under."""
        used = taken_names(self.replicas.values())
        return next(n for i in range(1 << 20) if (n := f"pdserve-{role}-{i}") not in used)


def _index(replica: str) -> int:
    return int(replica.rsplit("-", 1)[1])
