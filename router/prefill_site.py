"""Where an attempt's prompt is computed (a disaggregated or mixed cluster): on a prefill replica (remote:
its KV then moves to the decode replica), or on the decode replica that will decode it (local: that
replica's steps mix the prompt's chunks with its decoding sequences', within its TPOT guard; no KV
moves). Dynamo and llm-d call this conditional disaggregation.

The rule (router.prefill_site, router.local_prefill_tokens N):
1. local while no prefill replica can take the attempt — every one down, draining, or paired with
   no live decode worker — rather than waiting for one (why: "no_prefill");
2. local when the prompt tokens it leaves to compute are at most N (why: "short");
3. adaptive: the site whose forecast first token comes sooner (why: "sooner").
   Remote: the quickest prefill replica's queue of prompt tokens and this prompt at its fitted
   per-token cost, then its KV's move (its latest transfers' mean) and a decode step. Local: the
   quickest decode replica's queue of local prompt tokens and this prompt at the pace its TPOT
   guard allows beside its decoders (the engine's guard paces with the same model from the same
   fit, pdserve/step_cost.py MixedCost; before the replica has measured a mixed step, a prior). A prompt
   the replica's prefix cache holds in part counts only what it lacks. So short prompts, cached
   prefixes and a backed-up prefill pool go local; long prompts go remote while the prefill pool
   keeps up. Until both forecasts can be made (no steps measured yet), remote;
4. remote otherwise (why: "long"), always so with router.prefill_site: remote (adaptive is the
   default: on two H200s it met or beat every-prompt-remote at every SLO pair run).
Only a decode replica of one worker takes a local prefill (an expert-parallel group's ranks step in
lockstep; none is chosen there yet).

A mixed cluster (colocated replicas beside prefill and decode ones) first decides, per attempt,
whether it goes whole to a colocated replica or down the disaggregated path (where the rule above
then picks remote or local) — `PrefillSite.choose_path`:
- where both forecasts exist, the path whose first token comes sooner (why: "sooner"). Colocated:
  the quickest colocated replica's queue of our prompt tokens and this prompt at its fitted
  per-token cost, then one of its decode steps (it hands out the first token itself; no KV moves).
  Disaggregated: the forecast of the site the rule above picks there (remote: a prefill replica's
  queue and this prompt, the KV's move, a decode step; local: a decode replica's, at its guard's pace);
- without them (no steps measured yet), the path whose replicas hold fewer of our requests in
  flight per replica (why: "balance"), so that both kinds get traffic from the start;
- a path whose replicas have no room for a new attempt gives it to the other (why: "room").
"""

import math
from dataclasses import dataclass
from typing import Callable, Literal

from pdserve.step_cost import MixedCost

# A decode replica's mixed step before it has measured one: its decoders' step, plus this share of
# it (the eager run's overhead: 0.36-0.64x on an H200 at 64-96 decoders), plus the prompt tokens at
# a prefill replica's per-token cost.
MIXED_OVERHEAD_PRIOR = 0.6

REMOTE, LOCAL = "remote", "local"
COLOCATED, DISAGGREGATED = "colocated", "disaggregated"  # a mixed cluster's two paths


# Replicas whose forecast first tokens are within this share of the quickest's are as quick: the
# routing policy orders them (round-robin turns, prefix-aware weighs caches, kv-aware free blocks).
# A strict minimum sent every request of a light load to the same replica, its fit a hair lower,
# whatever router.policy said.
AS_QUICK = 0.1


def as_quick(forecasts: tuple[tuple[str, float], ...], names: list[str]) -> list[str]:
    """Of `names`, those forecast within AS_QUICK of the quickest of them, in `names`' order; [] if
    none of them is forecast."""
    times = {n: t for n, t in forecasts if n in names}
    if not times:
        return []
    bound = min(times.values()) * (1 + AS_QUICK)
    return [n for n in names if n in times and times[n] <= bound]


@dataclass(frozen=True)
class SiteForecast:
    """Seconds to an attempt's first token at each site, and where (None: cannot be forecast yet)."""

    remote_s: float | None = None
    local_s: float | None = None
    local_replica: str | None = None  # the decode replica of local_s
    local_each: tuple[tuple[str, float], ...] = ()  # every decode replica's local forecast

    def local_candidates(self, names: list[str]) -> list[str]:
        """The decode replicas of `names` as quick as the quickest of them (AS_QUICK)."""
        return as_quick(self.local_each, names)


@dataclass(frozen=True)
class PathForecast:
    """A mixed cluster's two paths: seconds to an attempt's first token (None: cannot be forecast yet)."""

    colocated_s: float | None = None
    colocated_replica: str | None = None  # the colocated replica of colocated_s
    disaggregated_s: float | None = None  # the remote site's forecast (SiteForecast.remote_s)
    colocated_each: tuple[tuple[str, float], ...] = ()  # every colocated replica's forecast


@dataclass(frozen=True)
class LocalCosts:
    """What a decode replica's local prefill costs, as the router knows it."""

    mixed: MixedCost | None  # its steps of prompt tokens beside decoders (measured, or the prior)
    decoders: int  # sequences decoding there (its stats)
    queued_tokens: int  # prompt tokens of ours queued there for local prefill
    cached_tokens: int = 0  # of this prompt, what its prefix cache holds


@dataclass(frozen=True)
class PrefillSite:
    mode: Literal["adaptive", "remote"] = "remote"  # router.prefill_site
    local_tokens: int = 0  # router.local_prefill_tokens
    tpot_target_s: float | None = None  # slo.tpot_ms where slo.tpot_guard guards decode replicas
    floor: int = 16  # the guard's fewest prompt tokens a step (the block size)
    step_tokens: int = 8192  # a decode engine's token budget of a step
    chunk_tokens: int = 2048  # its most prompt tokens of one request in a step

    @classmethod
    def of(cls, cfg) -> "PrefillSite":
        """From a ClusterConfig (the decode replicas' step and chunk sizes)."""
        return cls(cfg.router.prefill_site, cfg.router.local_prefill_tokens,
                   cfg.slo.tpot_ms / 1e3 if cfg.slo.tpot_guard != "off" else None, cfg.kv_transfer.block_size,
                   cfg.decode.max_batch_tokens, cfg.decode.chunk_size)

    def choose(self, tokens: int, prefill_can_take: bool,
               forecast: Callable[[], SiteForecast] | None = None) -> tuple[str, str]:
        """(site, why) for an attempt leaving `tokens` prompt tokens to compute; `forecast` is asked
        only where the cheaper rules leave the choice open."""
        if not prefill_can_take:
            return LOCAL, "no_prefill"
        if tokens <= self.local_tokens:
            return LOCAL, "short"
        if self.mode == "adaptive" and forecast is not None:
            f = forecast()
            if f.remote_s is not None and f.local_s is not None:
                return (LOCAL if f.local_s < f.remote_s else REMOTE), "sooner"
        return REMOTE, "long"

    def path_s(self, tokens: int, prefill_can_take: bool, f: SiteForecast) -> float | None:
        """The disaggregated path's forecast first token, for a mixed cluster's choice of path: at
        the site `choose` would pick for the attempt (remote, or local on a decode replica)."""
        site, _ = self.choose(tokens, prefill_can_take, lambda: f)
        return f.local_s if site == LOCAL and f.local_s is not None else f.remote_s

    def choose_path(self, forecast: PathForecast, colocated_load: float,
                    disaggregated_load: float) -> tuple[str, str]:
        """(COLOCATED or DISAGGREGATED, why) for a new attempt in a mixed cluster; the loads are our
        requests in flight per replica of each path (their decode or colocated replicas')."""
        f = forecast
        if f.colocated_s is not None and f.disaggregated_s is not None:
            return (COLOCATED if f.colocated_s < f.disaggregated_s else DISAGGREGATED), "sooner"
        # (A tie goes colocated: no KV moves.)
        return (COLOCATED if colocated_load <= disaggregated_load else DISAGGREGATED), "balance"

    def local_s(self, tokens: int, c: LocalCosts) -> float | None:
        """Seconds until a decode replica that prefills `tokens` prompt tokens itself (behind its queue
        of local prompts) yields the first token; None before its costs are known."""
        m = c.mixed
        if m is None:
            return None
        mine = max(1, tokens - c.cached_tokens)
        total = c.queued_tokens + mine
        if self.tpot_target_s is not None and c.decoders:
            # At the guard's pace (engine/tpot_guard.py, the same model), from an empty bank: the
            # router does not see the bank; a replica that has banked slack takes a prompt sooner.
            return m.paced_s(c.decoders, total, self.tpot_target_s, self.floor, self.chunk_tokens)
        steps = max(math.ceil(total / self.step_tokens), math.ceil(mine / self.chunk_tokens))
        return steps * (m.time(c.decoders, 0) + m.overhead) + total * m.per_token

def forecast_sites(site: PrefillSite, fc, rs, prefill: list[str], local: list[str], tokens: int,
                   cached: Callable[[list[str]], dict[str, int]]) -> SiteForecast:
    """Both sites' forecasts for an attempt leaving `tokens` to compute, over the live prefill
    replicas `prefill` (paired, with room) and the decode replicas `local` that can prefill it:
    `fc` the admission gate's TTFTForecast (the fitted step costs and KV transfer times of every
    replica, from their stats), `rs` the ReplicaSet (stats, our queued prompt tokens per replica),
    `cached` replica -> prompt tokens its prefix cache holds (the routing policy's index)."""
    held = cached(prefill + local)
    steps = [fc.decode_cost[d].time(_decoders(rs, d)) for d in local if d in fc.decode_cost]
    decode_step = min(steps) if steps else 0.0
    remote = [fc.prefill_s(p, rs.prompt_tokens.get(p, 0) + max(1, tokens - held.get(p, 0)))
              + fc.transfer_s.get(p, 0.0) + decode_step for p in prefill if p in fc.prefill_cost]
    measured = [fc.prefill_cost[p].per_unit for p in fc.prefill_cost if p in rs.prefill]
    per_token = min(measured) if measured else None  # the same model's prompt tokens on a prefill replica
    each: list[tuple[str, float]] = []
    for d in local:
        mixed = fc.mixed_cost.get(d)
        if mixed is None and d in fc.decode_cost and per_token is not None:  # no local prefill measured there yet
            mixed = MixedCost(fc.decode_cost[d], MIXED_OVERHEAD_PRIOR * fc.decode_cost[d].time(_decoders(rs, d)),
                              per_token)
        costs = LocalCosts(mixed, _decoders(rs, d), rs.prompt_tokens.get(d, 0), held.get(d, 0))
        if (t := site.local_s(tokens, costs)) is not None:
            each.append((d, t))
    best = min(each, key=lambda e: e[1]) if each else None
    return SiteForecast(min(remote) if remote else None, best[1] if best else None, best[0] if best else None,
                        tuple(each))


def forecast_paths(fc, rs, colocated: list[str], tokens: int, cached: dict[str, int],
                   disaggregated_s: float | None) -> PathForecast:
    """A mixed cluster's forecasts for an attempt leaving `tokens` to compute, over the live
    colocated replicas `colocated` (with room): `fc` the TTFTForecast, `rs` the ReplicaSet, `cached`
    replica -> prompt tokens its prefix cache holds, `disaggregated_s` the remote site's forecast."""
    each: list[tuple[str, float]] = []
    for c in colocated:
        if c not in fc.prefill_cost or c not in fc.decode_cost:  # no prompt or decode step measured there yet
            continue
        each.append((c, fc.prefill_s(c, rs.prompt_tokens.get(c, 0) + max(1, tokens - cached.get(c, 0)))
                     + fc.decode_cost[c].time(_decoders(rs, c))))
    best = min(each, key=lambda e: e[1]) if each else None
    return PathForecast(best[1] if best else None, best[0] if best else None, disaggregated_s, tuple(each))


def per_replica(rs, names: list[str]) -> float:
    """Our requests in flight per replica of `names` (ReplicaSet.loads); 0 for none."""
    return sum(rs.loads.get(n, 0) for n in names) / len(names) if names else 0.0


def _decoders(rs, replica: str) -> int:
    s = rs.stats.get(replica)
    return s.running if s else 0
