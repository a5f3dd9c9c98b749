"""Scaling (the Controller's part for it): `scale` starts new replicas of a role — they load, make
their KV pairs with the serving replicas and with each other, then join the routers — or drains
the newest ones: the routers send them no new work, what they hold finishes (for at most grace_s),
then they stop and leave the replica set. A draining replica that dies meanwhile is removed, not
replaced; what it held migrates, as from any dead replica (the routers' job).
"""

import time

import ray

from pdserve.control.launcher import Incarnation, Launcher, taken_names

# Between two looks at a draining replica. Two quiet looks in a row end its drain, so this is most
# of a quick drain's time (a flip's, on an H200: 1.5 s of its 2.1 s at 0.5 s); a hand-over still on
# its way to the worker (one actor call, a few ms) arrives well within it.
DRAIN_POLL_S = 0.2


class Scaling:
    def scale(self, counts: dict[str, int], grace_s: float) -> dict[str, list[str]]:
        """Replicas per role as asked: new ones start, handshake and join the routers; removed ones
        (the newest first) drain — no new work, what they hold finishes, at most grace_s — then
        stop. Returns the replicas started and removed. One scale or flip at a time (`_scaling`); the
        new replicas load their model without the lock on the replica set (`_life`), so the watch
        keeps probing and replacing meanwhile: a replica that died during a scale-up was otherwise
        seen only once the new ones served (a minute, with a large model)."""
        with self._scaling:
            with self._life:
                if self.state not in ("running", "degraded"):
                    raise RuntimeError(f"the cluster is {self.state}")
                started = []
                for role, want in counts.items():
                    have = self._serving(role)
                    taken = taken_names(self.replicas.values())  # (a flipped worker's first name too: its actor's)
                    free = (n for i in range(1 << 20) if (n := f"pdserve-{role}-{i}") not in taken)
                    for _ in range(max(0, want - len(have))):
                        others = list(self.replicas.values()) + started
                        started.append(self.launcher.start(role, next(free), 0, others))
            if started:
                self._join(started)
            with self._life:
                # Chosen now, not before the join: a replica replaced while the new ones loaded is
                # another incarnation, and the one to drain is the serving one.
                removed = [inc for role, want in counts.items() for inc in self._serving(role)[want:][::-1]]
                for inc in removed:
                    inc.state = "draining"
                    self._tell(inc.change())
                    self._note(f"scale: draining {inc.replica}")
            self._drain(removed, grace_s)  # (not holding _life: a dead replica meanwhile is still replaced)
            with self._life:
                for inc in removed:
                    self._remove(inc)
        return {"started": [i.replica for i in started], "removed": [i.replica for i in removed]}

    def _serving(self, role: str) -> list[Incarnation]:
        """The role's serving replicas, oldest name first (a scale-down removes from the end)."""
        return sorted((inc for inc in self.replicas.values() if inc.role == role and inc.state == "serving"),
                      key=lambda inc: _index(inc.replica))

    def _join(self, started: list[Incarnation]) -> None:
        """The started replicas, once ready, pair and join the routers; all stopped if one fails."""
        self._note(f"scale: starting {', '.join(i.replica for i in started)}")
        try:
            self._wait_ready(started)  # (not holding _life: see scale)
        except Exception:
            for inc in started:
                Launcher.stop(inc)
            raise
        with self._life:
            try:
                if self.state not in ("running", "degraded"):  # (stopped or draining while they loaded)
                    raise RuntimeError(f"the cluster is {self.state}")
                # The new with the serving and with each other: a scale-up of both roles made no
                # pair between its new prefill and new decode replicas, whose requests then
                # waited out the lease (kv_transfer.lease_s) and moved.
                self._handshake([i for i in started if i.role != "colocated"], ("serving",))
            except Exception:
                for inc in started:
                    Launcher.stop(inc)
                raise
            for inc in started:
                self.replicas[inc.replica] = inc
                self._tell(inc.change())
                self._note(f"scale: {inc.replica} serving")

    def _drain(self, incs: list[Incarnation], grace_s: float) -> None:
        """Until the draining replicas hold no request (their workers and every router say so),
        or grace_s passed: what is left is then cut off (and migrates, as from a dead replica)."""
        deadline = time.monotonic() + grace_s
        left = {inc.replica: inc for inc in incs}
        quiet: dict[str, int] = {}
        while left and time.monotonic() < deadline:
            for name, inc in list(left.items()):
                try:
                    held = sum(s.held for s in ray.get([w.stats.remote() for w in inc.ranks.values()], timeout=5))
                    held += sum(ray.get([r["handle"].placed.remote(name) for r in self.routers.values()], timeout=5))
                except Exception:  # dead (the watch replaces nothing draining) or slow: look again
                    held = -1
                # Twice in a row: a request handed over just before the routers heard of the drain
                # may still be on its way to the worker.
                quiet[name] = quiet.get(name, 0) + 1 if held == 0 else 0
                if quiet[name] >= 2:
                    del left[name]
                    self._note(f"{name} drained")
            if left:
                time.sleep(DRAIN_POLL_S)
        for name in left:
            self._note(f"{name}: not drained within {grace_s:g} s; stopping it (its requests move elsewhere)")

    def _remove(self, inc: Incarnation) -> None:
        if self.replicas.get(inc.replica) is not inc:  # removed already (it died while draining)
            return
        inc.state = "gone"
        self._tell(inc.change())
        Launcher.stop(inc)
        self._forget_pairs(inc)
        self.replicas.pop(inc.replica, None)
        self._restarting.pop(inc.replica, None)
        self._beats.forget(inc.replica)
        self._note(f"{inc.replica} stopped")


def _index(replica: str) -> int:
    return int(replica.rsplit("-", 1)[1])

