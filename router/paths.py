"""How an attempt is placed: which path (colocated, disaggregated with the prompt computed remote or
on its decode replica, or either in a mixed cluster: router/prefill_site.py's rule), at which
replicas (the routing policy's pick among those with room, router/policy.py), and the calls that hand
it to their workers (a KV reservation on a decode rank, then the prompt to a prefill worker; or the
whole request to one worker). Mixed into `Lifecycle` (router/lifecycle.py), which strings a request's
attempts together: these methods read its replica set, routing policy, admission gate, prefill-site
rule, metrics and block size, and time the phases through its `_admitted` and `_phase`."""

import time

from pdserve.messages import NewRequest, Request, Unpaired
from pdserve.router.attempt import Attempt, Lost, raise_refused
from pdserve.router.prefill_site import (COLOCATED, LOCAL, REMOTE, SiteForecast, as_quick, forecast_paths,
                                         forecast_sites, per_replica)


class Paths:
    """The placing half of `Lifecycle`: the paths an attempt can take (see the module's doc)."""

    def _prompt_replica(self, replicas: dict, role: str, run: Attempt, request: Request,
                        sent: list[int]) -> str | None:
        """A live replica to compute the attempt's prompt (prefill or colocated), as the routing policy picks;
        a new attempt only among those with room (None: none has room)."""
        names = self.replicas.health.live(replicas)
        if not names:
            if run.move > 0:  # a request already under way waits for a replacement; a new one hears 503 now
                raise Lost(f"no live {role} replica", role)
            raise self.replicas.health.unavailable(role)
        if run.move == 0 and not (names := [n for n in names if self.gate.has_room(n)]):
            return None
        run.to_compute = None
        return self.routing.prompt_replica(names, role, run, request, sent)

    async def _start_mixed(self, request: Request, run: Attempt, sent: list[int]) -> None:
        """A mixed cluster: the attempt goes whole to a colocated replica, or down the disaggregated
        path, as router/prefill_site.py's rule picks at each try."""
        placed = await self.gate.admit(request, run, lambda: self._try_mixed(request, run, sent))
        if placed[0] != COLOCATED:
            await self._send_disaggregated(request, run, sent, placed)
            return
        _, why, name = placed
        if self.metrics:
            self.metrics.count_prefill_site(COLOCATED, why)
        await self._hand_whole(request, run, sent, name, self.replicas.worker(name), self.replicas.send)

    async def _try_mixed(self, request: Request, run: Attempt, sent: list[int]) -> tuple | None:
        """One try at placing the attempt in a mixed cluster: (COLOCATED, why, replica) or what
        `_try_disaggregated` places; the path the rule picks first, the other where it has no room."""
        rs = self.replicas
        colocated = rs.health.live(rs.colocated)
        decode = rs.health.live(rs.decode)
        split = bool(decode) and bool(rs.health.live(rs.prefill) or self._local_replicas())
        if not colocated or not split:  # one path is down (a replacement is coming): the other
            return await (self._try_disaggregated(request, run, sent) if split
                          else self._try_colocated_path(request, run, sent, "room"))
        tokens = len(request.prompt_ids) + len(sent)
        room = [n for n in colocated if run.move > 0 or self.gate.has_room(n)]
        cached = self._cached(run, room)
        fc = forecast_paths(self.gate.forecast, rs, room, tokens, cached, None)
        if fc.colocated_s is not None:  # the disaggregated side is asked only where it can be compared
            prefill = {n: h for n, h in rs.prefill.items() if rs.paired(n)}
            sites = self._site_forecast(run, prefill, self._local_replicas(), tokens)
            fc = forecast_paths(self.gate.forecast, rs, room, tokens, cached,
                                self.prefill_site.path_s(tokens, bool(rs.health.live(prefill)), sites))
        path, why = self.prefill_site.choose_path(fc, per_replica(rs, colocated), per_replica(rs, decode))
        if path == COLOCATED:
            quick = as_quick(fc.colocated_each, room)
            if (placed := await self._try_colocated_path(request, run, sent, why, quick)) is not None:
                return placed
            return await self._try_disaggregated(request, run, sent)
        if (placed := await self._try_disaggregated(request, run, sent)) is not None:
            return placed
        return await self._try_colocated_path(request, run, sent, "room")

    async def _try_colocated_path(self, request: Request, run: Attempt, sent: list[int], why: str,
                                  quick: list[str] | None = None) -> tuple | None:
        """(COLOCATED, why, replica) placed at a colocated replica with room (of `quick`, those the
        forecast found as quick as the quickest, the routing policy's pick), or None."""
        rs = self.replicas
        if quick:  # (found among those with room, in this same turn of the loop)
            run.to_compute = None
            name = self.routing.prompt_replica(quick, "colocated", run, request, sent)
            self._place_whole(request, run, sent, name, rs.worker(name))
            return COLOCATED, why, name
        name = await self._try_colocated(request, run, sent)
        return None if name is None else (COLOCATED, why, name)

    def _site_forecast(self, run: Attempt, prefill: dict, local: list[str], tokens: int) -> SiteForecast:
        """Both sites' forecasts of the disaggregated path (remote, local) for the attempt."""
        rs = self.replicas
        room = [n for n in rs.health.live(prefill) if run.move > 0 or self.gate.has_room(n)]
        return forecast_sites(self.prefill_site, self.gate.forecast, rs, room, local, tokens,
                              lambda names: self._cached(run, names))

    async def _start_disaggregated(self, request: Request, run: Attempt, sent: list[int]) -> None:
        """Reserve KV on a decode replica, then have a prefill replica stream the prompt's KV there;
        or hand the request whole to a decode replica that prefills it itself (router/prefill_site.py)."""
        placed = await self.gate.admit(request, run, lambda: self._try_disaggregated(request, run, sent))
        await self._send_disaggregated(request, run, sent, placed)

    async def _send_disaggregated(self, request: Request, run: Attempt, sent: list[int], placed: tuple) -> None:
        """The attempt, placed by `_try_disaggregated`, goes to its workers."""
        rs = self.replicas
        site, why = placed[0], placed[1]
        if self.metrics:
            self.metrics.count_prefill_site(site, why)
        if site == LOCAL:
            _, _, d_name, d_rank = placed
            await self._hand_whole(request, run, sent, d_name, d_rank, rs.send_whole)
            return
        _, _, p_name, p_worker, (d_name, d_rank, handle) = placed
        t1 = time.perf_counter()
        rs.count_placed(p_name)
        rs.count_placed(d_name)  # (counted in its load from the reservation on: `_reserve`)
        run.holders |= {d_name: d_rank, p_name: p_worker}
        for name in (d_name, p_name):
            rs.health.wait_on(name, run.request_id, run.queue)
        answer = await rs.call(p_name, p_worker, rs.send[p_worker](NewRequest(_attempted(request, run, sent),
                                                                             handle=handle)))
        if isinstance(answer, Unpaired):  # the pair lost its handshake since the stats said so
            raise Lost(str(answer), "prefill", transfer="unpaired")
        raise_refused(answer)
        self._phase("dispatch", t1)

    async def _try_disaggregated(self, request: Request, run: Attempt, sent: list[int]) -> tuple | None:
        """One try at placing the attempt: (LOCAL, why, decode replica, its worker) where its prompt
        is computed on its decode replica; else (REMOTE, why, prefill replica, its worker, the KV
        reservation on a decode replica); None when none has room."""
        rs = self.replicas
        prefill = {n: h for n, h in rs.prefill.items() if rs.paired(n)}  # only over a KV pair
        local = self._local_replicas()
        tokens = len(request.prompt_ids) + len(sent)
        seen: list[SiteForecast] = []

        def forecast() -> SiteForecast:
            seen.append(self._site_forecast(run, prefill, local, tokens))
            return seen[0]

        site, why = self.prefill_site.choose(tokens, bool(rs.health.live(prefill)), forecast if local else None)
        if site == LOCAL and local:
            if (placed := self._try_local(request, run, sent, seen[0] if seen else None)) is not None:
                return (LOCAL, why, *placed)
            if why == "no_prefill":
                return None  # (room on a decode replica comes, or a prefill replica)
        if not prefill and rs.health.live(rs.prefill):  # paired to none yet: handshakes under way
            return None
        p_name = self._prompt_replica(prefill or rs.prefill, "prefill", run, request, sent)
        if p_name is None:
            return None
        # Counted before the reservation's await, so that a burst spreads over the prefill replicas.
        rs.place(p_name, run)
        rs.await_prompt(run, p_name, len(request.prompt_ids) + len(sent))
        p_worker = rs.worker(p_name)
        self._admitted(run)
        t0 = time.perf_counter()
        run.slot = ""  # reserving one
        reserved = await self._reserve(request, run, sent, p_name, p_worker)
        if reserved is None:
            run.slot = None
            rs.prompt_done(run)
            rs.unplace(run, p_name)
            return None
        self._phase("reserve", t0)
        self.routing.routed(run, request, {p_name: p_worker, reserved[0]: reserved[1]})
        return REMOTE, why, p_name, p_worker, reserved

    def _local_replicas(self) -> list[str]:
        """Live decode replicas that can prefill a request themselves (one worker each)."""
        rs = self.replicas
        return [n for n in rs.health.live(rs.decode) if len(rs.decode[n].ranks) == 1]

    def _try_local(self, request: Request, run: Attempt, sent: list[int],
                   forecast: SiteForecast | None = None) -> tuple[str, str] | None:
        """A decode replica to prefill the attempt itself -> (replica, its worker): the routing
        policy's first of those with room that the forecast finds as quick as the quickest of them
        (prefill_site.AS_QUICK), or of all with room where none is forecast; None when none has room
        (a new attempt: fewer than router.max_queued_per_replica of ours without a first token)."""
        names = self._local_replicas()
        if run.move == 0:
            names = [n for n in names if self.gate.has_room(n)]
        if not names:
            return None
        quick = forecast.local_candidates(names) if forecast is not None else []
        name, ranks = self.routing.decode_order(quick or names, run, request)[0]
        run.to_compute = None  # (all of it: what a remote try before this one counted was another replica's)
        self._place_whole(request, run, sent, name, ranks[0])
        return name, ranks[0]

    def _cached(self, run: Attempt, names: list[str]) -> dict[str, int]:
        """Per replica, the attempt's prompt tokens its prefix cache holds (as the routing policy's
        index knows them; nothing without one)."""
        index, rs = self.routing.index, self.replicas
        if index is None or not run.hashes:
            return {}
        worker = {n: next(iter(rs.decode[n].ranks)) if n in rs.decode else rs.worker(n) for n in names}
        held = index.match(run.hashes, worker.values())
        return {n: held[w] * self.block_size for n, w in worker.items()}

    def _place_whole(self, request: Request, run: Attempt, sent: list[int], name: str, worker: str) -> None:
        """The attempt is placed whole at the replica: it holds a sequence slot there and leaves it
        its prompt to compute."""
        rs = self.replicas
        rs.place(name, run)
        rs.count_placed(name)
        if name in rs.decode:  # its prompt's blocks, against the free blocks it last reported (as a reservation's)
            rs.reserved[name] = rs.reserved.get(name, 0) + self._blocks(request, sent)
        run.slot = name
        rs.await_prompt(run, name, len(request.prompt_ids) + len(sent))
        self.routing.routed(run, request, {name: worker})

    async def _start_colocated(self, request: Request, run: Attempt, sent: list[int]) -> None:
        """Hand the whole request to a colocated replica. Placed by the requests in flight from us, not
        by free KV blocks as for decode: a colocated replica never refuses (it queues), so a burst
        routed by stats up to 0.5 s old would all land on one replica; our own counts are exact."""
        name = await self.gate.admit(request, run, lambda: self._try_colocated(request, run, sent))
        await self._hand_whole(request, run, sent, name, self.replicas.worker(name), self.replicas.send)

    async def _hand_whole(self, request: Request, run: Attempt, sent: list[int], name: str, worker: str,
                          send: dict) -> None:
        """The attempt, placed at the replica, goes to its worker whole: prompt and decode there."""
        rs = self.replicas
        run.holders[name] = worker  # before the call: a client leaving during it must still stop the request
        rs.health.wait_on(name, run.request_id, run.queue)
        self._admitted(run)
        t0 = time.perf_counter()
        raise_refused(await rs.call(name, worker, send[worker](NewRequest(_attempted(request, run, sent)))))
        self._phase("dispatch", t0)

    async def _try_colocated(self, request: Request, run: Attempt, sent: list[int]) -> str | None:
        """A colocated replica with room for the attempt (it is placed there), or None."""
        rs = self.replicas
        name = self._prompt_replica(rs.colocated, "colocated", run, request, sent)
        if name is not None:
            self._place_whole(request, run, sent, name, rs.worker(name))
        return name

    async def _reserve(self, request: Request, run: Attempt, sent: list[int],
                       p_name: str, p_worker: str) -> tuple[str, str, bytes] | None:
        """Reserve KV blocks on a decode replica's rank, best candidates first -> (replica, rank,
        handle); None when all are full; raises when none is live. The handle names the rank: the
        KV goes there."""
        rs = self.replicas
        for d_name, ranks in self.routing.decode_order(rs.health.live(rs.decode), run, request):
            for rank in ranks:
                if not rs.paired(p_name, d_name, rank):  # its KV could not move there
                    continue
                # Held from the call on: a client that leaves while the reservation is answered
                # still has it aborted on the rank (not left to its lease). Counted in the replica's
                # load from the call on too, so that a burst's reservations, answered together,
                # spread by the routing policy's balance guard rather than all see it idle.
                run.holders[d_name] = rank
                rs.place(d_name, run)
                try:
                    res = await rs.call(d_name, rank, rs.send[rank](
                        NewRequest(_attempted(request, run, sent), prefill_id=p_worker)))
                except Lost:
                    run.holders.pop(d_name, None)
                    rs.unplace(run, d_name)
                    break  # this replica is down: try the next one
                raise_refused(res.refused)
                if res.unpaired is not None:  # the stats we routed by were older than its handshakes
                    self._count_transfer_failure("unpaired", f"{request.request_id}: {res.unpaired}")
                if res.handle is not None:
                    run.slot = d_name
                    rs.reserved[d_name] = rs.reserved.get(d_name, 0) + self._blocks(request, sent)
                    return d_name, rank, res.handle
                run.holders.pop(d_name, None)
                rs.unplace(run, d_name)
        if not rs.health.live(rs.decode):
            # (One died under this very reservation: the request waits for its replacement, as a
            # moving one does, rather than hear a 503 that a request a moment later would not.)
            raise Lost("no live decode replica", "decode")
        return None

    def _blocks(self, request: Request, sent: list[int]) -> int:
        return -(-(len(request.prompt_ids) + len(sent) + 1) // self.block_size)


def _attempted(request: Request, run: Attempt, sent: list[int]) -> Request:
    """The request as this attempt hands it to workers: under the attempt's id, with the tokens the
    client has (a move prefills them again)."""
    return Request(run.request_id, request.prompt_ids, request.params, sent, request.priority)
