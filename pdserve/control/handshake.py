"""The KV handshake (the Controller's part for it): every prefill worker is introduced to every
decode worker of the live replicas, the decode end first, then the prefill end, each batch in
parallel; a new or replaced replica pairs with the live ones (and a scale-up's new prefill with its
new decode replicas). Each pair's record goes into the PairBook (kv_pairs.py); a pairing that failed
is retried by the watch, with backoff, once its two ends are still live (`_repair`), and the
routers are told the failures (`_tell_pairing`); a peer that died meanwhile is marked for
replacement, and its replacement pairs anew. A stopped incarnation's records are forgotten.
"""

import ray

from pdserve.control.launcher import Incarnation
from pdserve.control.recovery import _cause


class Handshake:
    def _handshake(self, incs: list[Incarnation], states=("serving", "draining")) -> None:
        """Pair every worker of `incs` with every worker of the other KV role: those of the live
        replicas (in `states`, not being replaced) and those of `incs` themselves (a scale-up of
        both roles pairs the new with the new). A failure of `incs`' own workers raises; a peer that
        is dead (or dies meanwhile) is left out: it is being replaced, and its replacement will pair
        with these. A pairing that fails otherwise is retried by the watch (kv_pairs.py)."""
        others = [i for i in list(self.replicas.values()) if i.state in states and i.replica not in self._restarting
                  and i.role in ("prefill", "decode") and all(i is not j for j in incs)]
        pairs = []
        for a in incs:
            for b in others + incs:
                if {a.role, b.role} != {"prefill", "decode"}:
                    continue
                if a.role == "decode" and any(b is j for j in incs):  # two new ones: paired from the prefill side
                    continue
                p, d = (a, b) if a.role == "prefill" else (b, a)
                pairs += [(p, pw, d, dw) for pw in p.ranks for dw in d.ranks]
        self._pair(pairs, incs)

    def _pair(self, pairs: list[tuple[Incarnation, str, Incarnation, str]], own: list[Incarnation] = ()) -> None:
        """Handshake each (prefill replica, its worker, decode replica, its worker): the decode end
        takes the prefill end's metadata first, then the prefill end the decode end's, each batch
        in parallel. A worker of `own` that fails raises; another replica's dead worker marks that
        replica for replacement; any other failure is the pair's (PairBook.failed: retried)."""
        if not pairs:
            return
        mine = {w for inc in own for w in inc.ranks}
        handles = {w: inc.ranks[w] for p, pw, d, dw in pairs for inc, w in ((p, pw), (d, dw))}
        replica_of = {w: inc for p, pw, d, dw in pairs for inc, w in ((p, pw), (d, dw))}
        dead: set[str] = set()

        def died(worker: str, e: BaseException) -> None:
            if worker in mine:
                raise RuntimeError(f"{worker} failed its KV handshake: {_cause(e)}") from None
            inc = replica_of[worker]
            dead.add(worker)
            self._restarting.setdefault(inc.replica, f"it failed its KV handshake ({type(e).__name__})")

        # Asked afresh for each pairing: a record is stamped and proven when packed, and a peer
        # refuses one it accepted before or one packed long ago (kvtransfer/metadata.py: Replays).
        refs = {w: handles[w].metadata.remote() for w in handles}
        for w, ref in refs.items():
            try:
                self._metas[w] = ray.get(ref, timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                died(w, e)
        for end in ("decode", "prefill"):  # the decode end first: it then takes reservations naming the prefill end
            todo = [(p, pw, d, dw) for p, pw, d, dw in pairs if pw not in dead and dw not in dead and
                    (end == "decode" or (dw, pw) in self.pairs.records)]
            calls = {(pw, dw): (handles[dw].add_peer.remote(self._metas[pw]) if end == "decode"
                                else handles[pw].add_peer.remote(self._metas[dw])) for _, pw, _, dw in todo}
            if not calls:
                continue
            ray.wait(list(calls.values()), num_returns=len(calls), timeout=60)
            for (pw, dw), ref in calls.items():
                caller = dw if end == "decode" else pw
                try:
                    rec = ray.get(ref, timeout=0)
                except ray.exceptions.RayActorError as e:
                    if caller not in dead:
                        died(caller, e)
                    self._pair_failed(pw, dw, "died", f"{caller}'s process died; it is being replaced")
                    continue
                except ray.exceptions.GetTimeoutError:
                    self._pair_failed(pw, dw, "timeout", f"{caller} did not answer the handshake within 60 s")
                    continue
                except ray.exceptions.RayTaskError as e:
                    self._pair_failed(pw, dw, "refused", _cause(e))
                    continue
                if end == "decode":
                    self.pairs.half(dw, pw, rec)
                else:
                    self.pairs.paired(pw, dw, rec, self.pairs.records[(dw, pw)])

    def _pair_failed(self, prefill: str, decode: str, reason: str, why: str) -> None:
        f = self.pairs.failed(prefill, decode, reason, why)
        self._note(f"KV pair {prefill} -> {decode} failed ({reason}: {why}); trying again in {f.backoff:.0f} s "
                   f"(attempt {f.attempts})")
        self._tell_pairing()

    def _repair(self) -> None:
        """Pairings that failed, tried again once due (their two ends still live)."""
        due = self.pairs.due()
        if not due:
            return
        where = {w: inc for inc in self.replicas.values() if inc.replica not in self._restarting for w in inc.ranks}
        pairs = [(where[p], p, where[d], d) for p, d in due if p in where and d in where]
        for p, d in due:
            if p not in where or d not in where:
                self.pairs.forget([w for w in (p, d) if w not in where])
        if pairs:
            self._pair(pairs)
            for _, p, _, d in pairs:
                if (p, d) not in self.pairs.failing:
                    self._note(f"KV pair {p} -> {d} paired")

    def _forget_pairs(self, inc: Incarnation) -> None:
        """The KV handshakes' records of a stopped incarnation's workers."""
        self.pairs.forget(inc.ranks)
        for w in inc.ranks:
            self._metas.pop(w, None)

