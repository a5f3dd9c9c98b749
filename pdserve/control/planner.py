"""The planner behind `pdserve tune`: from what the cluster measured, the prefill:decode split that
serves the traffic's shape best within the SLO, with its reasoning in numbers.

The model (the DistServe and Dynamo planner idea: size each phase from its measured capacity at
the latency target):

- **A step's cost** is linear in its size, fitted (least squares, weighted by steps) over the
  measured step buckets: prefill `fixed + per_token × tokens`, decode `fixed + per_seq × batch`.
- **Prefill** replicas are a queue: a request alone takes S = its chunks' fixed costs + per_token
  × prompt; saturated steps of max_batch_tokens give the replica θ tokens/s. At utilization ρ the
  mean wait is ρS / 2(1-ρ) (M/D/1), so TTFT ≈ S + KV transfer + wait. The pool sustains the rate
  at which that TTFT meets slo.ttft_ms (and ρ ≤ RHO_MAX).
- **Decode** replicas run a batch: a sequence decodes in a batch of itself and the others decoding
  meanwhile, r × TPOT of them at r tokens/s per rank (Little's law), so TPOT = step(1 + r × TPOT)
  = (fixed + per_seq) / (1 - r × per_seq). (Without the sequence itself, B = r × step(B) forecast a
  step of a fraction of a sequence at light load: 3.1 ms where the same run measured 5.3 ms.) The
  pool sustains the rate at which that TPOT reaches slo.tpot_ms, inside max_num_seqs and the KV
  blocks (full batches back to back).
- **The split**: for a budget of N units (a unit is a GPU, or a worker process on CPU; a decode
  replica is ep_size of them), every P + D·ep ≤ N is scored by the rate it sustains — the lower of
  its two phases' — and the best wins (ties: the one closest to now). `needed` is the least P and
  D for the traffic's rate.

Pure functions and plain data (no Ray): tested without a cluster; the profile file is a Measured
as JSON."""

import json
import math
from dataclasses import asdict, dataclass, field

from pdserve.step_cost import StepCost, fit_phases

RHO_MAX = 0.9  # no phase planned past 90 % busy: near 100 % its queue grows without bound
PROFILE_KIND = "pdserve-profile"


class PlannerError(ValueError):
    """The planner cannot answer (nothing measured yet, a colocated cluster): the message says what to do."""


# -- what was measured -----------------------------------------------------------------------------


@dataclass
class Limits:
    """The cluster's settings that bound a replica: from cluster.yaml and the replicas' KV pools."""

    max_batch_tokens: int = 8192  # prefill.max_batch_tokens
    chunk_size: int = 2048  # prefill.chunk_size
    max_num_seqs: int = 256  # decode.max_num_seqs (per rank)
    decode_kv_blocks: int = 0  # KV blocks of one decode rank (0: unknown, not a bound)
    block_size: int = 16
    ep_size: int = 1  # decode ranks per replica


@dataclass
class Traffic:
    """Requests over a window: arrivals per second, mean prompt and output tokens, and the TTFT and
    TPOT percentiles the routers measured (ms; None where nothing was counted)."""

    rate: float
    input_len: float
    output_len: float
    requests: int = 0
    finished: int = 0
    ttft_p50: float | None = None
    ttft_p90: float | None = None
    tpot_p50: float | None = None
    tpot_p90: float | None = None


@dataclass
class Measured:
    """What the planner reads: step costs by size per phase ({bucket: [steps, size, seconds]}),
    busy seconds per role, the traffic of the window, the mean KV transfer per request, the limits,
    the slo, the replicas per role now, the budget (units) and its unit."""

    window_s: float
    steps: dict[str, dict[int, list]]
    busy_s: dict[str, float]
    traffic: Traffic
    kv_transfer_s: float | None
    limits: Limits
    slo: dict
    replicas: dict[str, int]
    device: str = "cpu"
    budget: int = 0
    unit: str = "worker"
    waiting: dict[str, int] = field(default_factory=dict)  # requests queued per role at the latest heartbeat

    def to_json(self) -> dict:
        return {"kind": PROFILE_KIND, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict, source: str = "profile") -> "Measured":
        if not isinstance(d, dict) or d.get("kind") != PROFILE_KIND:
            raise PlannerError(f"{source}: not a pdserve profile (record one with `pdserve tune --record FILE` "
                               f"on a cluster that served traffic, e.g. after `pdserve bench`)")
        try:
            return cls(window_s=d["window_s"], steps={p: {int(b): row for b, row in rows.items()}
                                                      for p, rows in d["steps"].items()},
                       busy_s=d["busy_s"], traffic=Traffic(**d["traffic"]), kv_transfer_s=d["kv_transfer_s"],
                       limits=Limits(**d["limits"]), slo=d["slo"], replicas=d["replicas"], device=d["device"],
                       budget=d["budget"], unit=d["unit"], waiting=d.get("waiting", {}))
        except (KeyError, TypeError) as e:
            raise PlannerError(f"{source}: a pdserve profile missing or mangling {e}; record it again") from None

    @classmethod
    def load(cls, path: str) -> "Measured":
        try:
            with open(path) as f:
                return cls.from_json(json.load(f), path)
        except FileNotFoundError:
            raise PlannerError(f"--profile {path}: no such file") from None
        except json.JSONDecodeError as e:
            raise PlannerError(f"--profile {path}: not JSON ({e})") from None


def merge_steps(parts: list[dict[int, list]]) -> dict[int, list]:
    """Step buckets of several replicas as one."""
    out: dict[int, list] = {}
    for part in parts:
        for b, row in part.items():
            mine = out.setdefault(int(b), [0, 0, 0.0])
            for i in range(3):
                mine[i] += row[i]
    return out


# -- each phase at a number of replicas ------------------------------------------------------------


@dataclass
class PhaseLoad:
    replicas: int
    max_rate: float  # requests/s this pool sustains within its SLO
    predicted_ms: float | None  # TTFT (prefill) or TPOT (decode) at the traffic's rate; None: past capacity
    target_ms: float
    detail: str  # how: "S 210 ms, 6.1k tok/s each" / "batch 12"

    def load(self, rate: float) -> float:
        """The traffic's rate over what the pool sustains (1.0: at the SLO's edge)."""
        return math.inf if self.max_rate <= 0 else rate / self.max_rate


def prefill_load(cost: StepCost, traffic: Traffic, replicas: int, limits: Limits, ttft_ms: float,
                 kv_s_per_token: float) -> PhaseLoad:
    prompt = max(1.0, traffic.input_len)
    alone = math.ceil(prompt / limits.chunk_size) * cost.fixed + cost.per_unit * prompt
    full = limits.max_batch_tokens
    theta = full / cost.time(full)  # tokens/s of one replica with full steps
    kv = kv_s_per_token * prompt
    slack = ttft_ms / 1000.0 - alone - kv
    rho = 0.0 if slack <= 0 else min(RHO_MAX, 2 * slack / (alone + 2 * slack))
    max_rate = rho * replicas * theta / prompt
    u = traffic.rate * prompt / (replicas * theta)
    predicted = (alone + kv + u * alone / (2 * (1 - u))) * 1000.0 if u < 1 else None
    return PhaseLoad(replicas, max_rate, predicted, ttft_ms,
                     f"alone {alone * 1000:.0f} ms, {theta:,.0f} tok/s each, busy {100 * u:.0f} %")


def decode_load(cost: StepCost, traffic: Traffic, replicas: int, limits: Limits, tpot_ms: float) -> PhaseLoad:
    ranks = replicas * limits.ep_size  # attention is data-parallel: each rank runs a batch of its own
    out = max(1.0, traffic.output_len - 1)  # the first token comes from the prefill replica
    per_seq = math.ceil((traffic.input_len + traffic.output_len) / limits.block_size)
    cap = limits.max_num_seqs
    if limits.decode_kv_blocks:
        cap = min(cap, limits.decode_kv_blocks // max(1, per_seq))
    a, b = cost.fixed, cost.per_unit
    target = tpot_ms / 1000.0
    # Tokens/s per rank: where TPOT = (a + b) / (1 - r b) reaches the target, and full batches of
    # `cap` back to back (the most a rank decodes, whatever the TPOT).
    by_slo = 0.0 if target <= a + b else ((target - a - b) / (b * target) if b > 0 else math.inf)
    by_cap = cap / cost.time(cap) if cap >= 1 else 0.0
    max_rate = ranks * min(by_slo, by_cap) / out
    r = traffic.rate * out / ranks  # tokens/s per rank
    predicted, detail = None, "past capacity"
    if r * b < 1:
        tpot = (a + b) / (1 - r * b)
        batch = 1 + r * tpot  # as a sequence sees it: itself and the others decoding
        if batch <= cap:
            predicted, detail = tpot * 1000.0, f"batch {batch:.1f} of {cap}"
    return PhaseLoad(replicas, max_rate, predicted, tpot_ms, detail)


# -- the split ------------------------------------------------------------------------------------


@dataclass
class Split:
    prefill: PhaseLoad
    decode: PhaseLoad

    @property
    def counts(self) -> tuple[int, int]:
        return self.prefill.replicas, self.decode.replicas

    @property
    def max_rate(self) -> float:
        return min(self.prefill.max_rate, self.decode.max_rate)

    @property
    def bottleneck(self) -> str:
        return "prefill" if self.prefill.max_rate <= self.decode.max_rate else "decode"


@dataclass
class Plan:
    traffic: Traffic
    budget: int
    unit: str
    current: Split | None
    best: Split
    splits: list[Split]
    needed: tuple[int, int]  # least prefill and decode replicas for the traffic's rate (0: none suffices)
    costs: dict[str, StepCost]
    kv_ms: float
    slo: dict
    notes: list[str] = field(default_factory=list)
    budget_source: str = ""

    @property
    def change(self) -> bool:
        return self.current is None or self.best.counts != self.current.counts

    @property
    def gain(self) -> float:
        """How much more the recommended split sustains than the current one (1.0: the same)."""
        if self.current is None:
            return math.inf
        if self.current.max_rate <= 0:
            return math.inf if self.best.max_rate > 0 else 1.0
        return self.best.max_rate / self.current.max_rate


def plan(m: Measured, traffic: Traffic | None = None, budget: int | None = None) -> Plan:
    """The best split for `traffic` (default: the measured one) within `budget` units (default:
    the measured budget)."""
    traffic = traffic or m.traffic
    source = "--budget" if budget else "the GPUs the cluster has" if m.unit == "GPU" else \
        "the workers running now; --budget N to change" if m.replicas else "the workers of the profiled cluster"
    budget = budget or m.budget
    if m.replicas.get("colocated"):
        # (A mixed cluster's colocated replicas take a share of the traffic the fits cannot tell apart
        # from the P:D pools' share: sizing those pools from it would be wrong, so none is offered.)
        kind = "mixes colocated replicas with prefill and decode ones" if m.replicas.get("prefill") \
            else "is colocated"
        raise PlannerError(f"this cluster {kind}: `pdserve tune` sizes the prefill and decode pools of a "
                           f"disaggregated cluster only; tune one without colocated replicas (colocated.replicas: "
                           f"0), or size the colocated replicas with `pdserve scale --colocated N`")
    if traffic.rate <= 0 or traffic.input_len <= 0:
        raise PlannerError(f"no requests arrived in the last {m.window_s:.0f} s: nothing to size the pools for "
                           f"(send traffic, or use --offline with --rate/--input-len/--output-len)")
    decode, prefill = fit_phases(m.steps)
    costs = {"prefill": prefill, "decode": decode}
    for phase, cost in costs.items():
        if cost is None:
            raise PlannerError(f"no {phase} steps measured yet: send traffic first (e.g. `pdserve bench`), "
                               f"or answer from a recorded profile (--offline --profile FILE)")
    lim, slo = m.limits, m.slo
    ep = max(1, lim.ep_size)
    if budget < 1 + ep:
        raise PlannerError(f"a budget of {budget} {m.unit}s cannot hold 1 prefill and 1 decode replica "
                           f"({1 + ep} {m.unit}s with decode.ep_size {ep})")
    kv_per_token = (m.kv_transfer_s or 0.0) / m.traffic.input_len if m.traffic.input_len > 0 else 0.0

    def split(p: int, d: int) -> Split:
        return Split(prefill_load(costs["prefill"], traffic, p, lim, slo["ttft_ms"], kv_per_token),
                     decode_load(costs["decode"], traffic, d, lim, slo["tpot_ms"]))

    now = (m.replicas.get("prefill", 0), m.replicas.get("decode", 0))
    splits = [split(p, (budget - p) // ep) for p in range(1, budget - ep + 1)]
    best = max(splits, key=lambda s: (round(s.max_rate, 9), -abs(s.prefill.replicas - now[0])))
    current = split(*now) if all(now) else None
    needed = (_least(lambda n: split(n, 1).prefill.max_rate >= traffic.rate),
              _least(lambda n: split(1, n).decode.max_rate >= traffic.rate))
    notes = []
    if (budget - 1) % ep and ep > 1:
        notes.append(f"decode replicas take {ep} {m.unit}s each (decode.ep_size): some splits leave one idle")
    return Plan(traffic, budget, m.unit, current, best, splits, needed, costs,
                kv_per_token * traffic.input_len * 1000.0, slo, notes, source)


def _least(ok, most: int = 4096) -> int:
    n = 1
    while n <= most and not ok(n):
        n = n * 2 if n < 64 else n + 64  # (coarse past 64: only its order matters)
    if n > most:
        return 0
    lo = max(1, n // 2)
    while lo < n and not ok(lo):
        lo += 1
    return lo


# -- deciding when to act (--watch) ---------------------------------------------------------------


@dataclass
class Hysteresis:
    """A new split is applied only when it is worth it (it sustains `margin` more than the split now),
    the same one was recommended `confirm` times in a row, and `cooldown_s` passed since the last
    change: a workload that wavers does not make the cluster flap."""

    confirm: int = 2
    cooldown_s: float = 60.0
    margin: float = 0.15
    last_change: float = -math.inf
    _target: tuple[int, int] | None = None
    _streak: int = 0

    def decide(self, now: float, p: Plan) -> tuple[tuple[int, int] | None, str]:
        """(the split to move to, or None; why)."""
        if not p.change:
            self._target, self._streak = None, 0
            return None, "the split now is the best"
        if p.gain < 1 + self.margin:
            self._target, self._streak = None, 0
            return None, f"{_counts(p.best.counts)} would sustain only {100 * (p.gain - 1):.0f} % more (margin {100 * self.margin:.0f} %)"
        if p.best.counts != self._target:
            self._target, self._streak = p.best.counts, 0
        self._streak += 1
        if self._streak < self.confirm:
            return None, f"{_counts(p.best.counts)} recommended {self._streak}/{self.confirm} times in a row"
        wait = self.last_change + self.cooldown_s - now
        if wait > 0:
            return None, f"{_counts(p.best.counts)} recommended; cooling down {wait:.0f} s more"
        self.last_change, self._target, self._streak = now, None, 0
        return p.best.counts, f"moving to {_counts(p.best.counts)}"


def scale_steps(now: tuple[int, int], target: tuple[int, int], free_units: float, ep: int,
                on_gpus: bool) -> list[dict[str, int]]:
    """The `scale` calls that move `now` to `target`. Growth first, so capacity never dips — where
    the units it needs are free (always on CPU); else the shrinking role first (its replicas drain,
    freeing their GPUs), then the growing one."""
    counts = {"prefill": target[0], "decode": target[1]}
    need = max(0, target[0] - now[0]) + max(0, target[1] - now[1]) * ep
    if not on_gpus or need <= free_units or target[0] <= now[0] and target[1] <= now[1]:
        return [counts]
    shrink = {role: counts[role] if counts[role] < have else have
              for role, have in (("prefill", now[0]), ("decode", now[1]))}
    return [shrink, counts]


# -- what is printed ------------------------------------------------------------------------------


def _counts(c: tuple[int, int]) -> str:
    return f"{c[0]}P+{c[1]}D"


def _ms(v: float | None) -> str:
    return "past capacity" if v is None else f"{v:,.0f} ms" if v >= 10 else f"{v:.1f} ms"


def render(p: Plan, m: Measured, offline: bool = False) -> str:
    t, slo = p.traffic, p.slo
    lines = []
    if offline:
        lines.append(f"traffic (given): {_rate(t.rate)} req/s, prompts {t.input_len:,.0f} tokens, outputs "
                     f"{t.output_len:,.0f} tokens; SLO TTFT {slo['ttft_ms']:g} ms, TPOT {slo['tpot_ms']:g} ms")
    else:
        seen = lambda a, b: f"{_ms(a)} / {_ms(b)}" if a is not None else "-"  # noqa: E731
        lines.append(f"traffic over the last {m.window_s:.0f} s: {t.rate:.2f} req/s ({t.requests} arrived), prompts "
                     f"{t.input_len:,.0f} tokens, outputs {t.output_len:,.0f} tokens")
        lines.append(f"  measured TTFT p50 / p90 {seen(t.ttft_p50, t.ttft_p90)} (slo {slo['ttft_ms']:g} ms), "
                     f"TPOT p50 / p90 {seen(t.tpot_p50, t.tpot_p90)} (slo {slo['tpot_ms']:g} ms)")
        busy = [f"{role} {n} replicas busy {100 * m.busy_s.get(role, 0.0) / (n * m.window_s):.0f} %, "
                f"{m.waiting.get(role, 0)} queued" for role, n in m.replicas.items() if n and m.window_s > 0]
        if busy:
            lines.append(f"  measured load: {'; '.join(busy)}")
    pc, dc = p.costs["prefill"], p.costs["decode"]
    lines.append(f"step costs ({m.device}, {pc.steps:,} prefill and {dc.steps:,} decode steps):")
    lines.append(f"  prefill: {pc.fixed * 1000:.2f} ms + {pc.per_unit * 1e6:.1f} us/token; KV transfer "
                 f"{p.kv_ms:.1f} ms per request")
    lines.append(f"  decode:  {dc.fixed * 1000:.2f} ms + {dc.per_unit * 1000:.3f} ms/sequence "
                 f"(ep_size {m.limits.ep_size}, max_num_seqs {m.limits.max_num_seqs})")
    lines.append(f"budget: {p.budget} {p.unit}s ({p.budget_source})")
    lines.append("  load: the traffic's rate over what the phase sustains within its SLO (over 100 %: it misses)")
    lines.append(f"  {'split':<8} {'prefill load':>13} {'TTFT':>14} {'decode load':>12} {'TPOT':>14} {'sustains':>14}")
    for s in p.splits:
        mark = "  <- recommended" if s is p.best else ""
        if p.current is not None and s.counts == p.current.counts:
            mark += "  (now)"
        lines.append(f"  {_counts(s.counts):<8} {_pct(s.prefill.load(t.rate)):>13} {_ms(s.prefill.predicted_ms):>14} "
                     f"{_pct(s.decode.load(t.rate)):>12} {_ms(s.decode.predicted_ms):>14} "
                     f"{s.max_rate:>9.2f} req/s{mark}")
    b = p.best
    why = (f"{b.bottleneck} limits it: prefill {b.prefill.detail}; decode {b.decode.detail}")
    lines.append(f"recommended: {b.prefill.replicas} prefill + {b.decode.replicas} decode"
                 + (f" (now {_counts(p.current.counts)}, sustains {p.current.max_rate:.2f} req/s; "
                    f"{p.gain:.2f}x)" if p.current is not None and p.change else
                    " (as now)" if p.current is not None else "") + f" — {why}")
    need_p, need_d = p.needed
    if need_p and need_d:
        lines.append(f"for {_rate(t.rate)} req/s within the SLO: at least {need_p} prefill and {need_d} decode replicas "
                     f"({need_p + need_d * m.limits.ep_size} {p.unit}s)")
    else:
        short = " and ".join(r for r, n in (("prefill", need_p), ("decode", need_d)) if not n)
        lines.append(f"no number of {short} replicas meets the SLO for this traffic: a single request already "
                     f"takes longer than the target")
    if b.max_rate < t.rate:
        lines.append(f"warning: even the best split sustains {b.max_rate:.2f} req/s, under the {t.rate:.2f} req/s "
                     f"arriving: more {p.unit}s are needed")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def _rate(x: float) -> str:
    """Requests/s to 3 significant digits (1.08, 0.786, 12.3), whole from 100 on: what was measured
    over a minute carries no more."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _pct(x: float) -> str:
    return "over" if math.isinf(x) or x > 9.99 else f"{100 * x:.0f} %"
