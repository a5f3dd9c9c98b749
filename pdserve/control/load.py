"""What the running cluster measured, kept by the controller for the planner (`pdserve tune`).

Every heartbeat (health.py) brings each replica's stats and each router's info; the controller
keeps them for KEEP_S. `measured()` differences the oldest and newest samples of each worker and
router in a window into a `Measured`:

- what a step cost, by size, per phase (engine/step_profile.py), over the long window: the cost of
  a step depends on the hardware and the model, not on the traffic, so more steps give a better fit;
- the traffic (arrivals, prompt and output lengths, TTFT and inter-token percentiles) over the
  short window: it is what the planner sizes the pools for, and it shifts.

Counters are cumulative at their source; one that went down (a router or replica restarted from
zero) counts from zero. A worker that appeared inside a window counts from its first sample."""

import math
import threading
import time
from collections import deque

from pdserve.cluster_view import percentile
from pdserve.control.planner import Limits, Measured, Traffic, merge_steps

KEEP_S = 600.0


class LoadWindow:
    def __init__(self, keep_s: float = KEEP_S) -> None:
        self.keep_s = keep_s
        # (time, {worker name: (role, ReplicaStats.profile, transfers, its KV blocks, waiting)}, {router key: traffic})
        self.samples: deque[tuple[float, dict, dict]] = deque()
        self._lock = threading.Lock()  # the watch thread adds while a `load` call (another thread) reads

    def add(self, t: float, replicas: dict[str, list], routers: dict[str, dict]) -> None:
        """replicas: replica name -> its ranks' ReplicaStats (rank 0 speaks for an EP group, which
        steps in lockstep); routers: slot -> its info()."""
        workers = {}
        for ranks in replicas.values():
            s = ranks[0]
            workers[s.name] = (s.role, s.profile, list(s.transfers), s.total_blocks, s.waiting)
        traffic = {f"{slot}:{info.get('pid')}": info["traffic"] for slot, info in routers.items() if "traffic" in info}
        with self._lock:
            self.samples.append((t, workers, traffic))
            while len(self.samples) > 2 and t - self.samples[0][0] > self.keep_s:
                self.samples.popleft()

    def measured(self, window_s: float, limits: Limits, slo: dict, replicas: dict[str, int],
                 device: str) -> Measured:
        with self._lock:
            samples = list(self.samples)
        now = samples[-1][0] if samples else time.monotonic()
        recent = [s for s in samples if s[0] >= now - window_s] or samples[-1:]
        traffic, span = self._traffic(recent)
        steps, _ = self._steps(samples)
        _, busy = self._steps(recent)
        last = samples[-1][1] if samples else {}
        waiting: dict[str, int] = {}
        for role, *_, queued in last.values():
            waiting[role] = waiting.get(role, 0) + queued
        transfers = [x for w in last.values() if w[0] == "prefill" for x in w[2]]
        kv_s = sum(s for _, s in transfers) / len(transfers) if transfers else None
        return Measured(window_s=span, steps=steps, busy_s=busy, traffic=traffic, kv_transfer_s=kv_s,
                        limits=limits, slo=dict(slo), replicas=dict(replicas), device=device, waiting=waiting)

    def decode_kv_blocks(self) -> int:
        """KV blocks of one decode rank (the smallest, where they differ); 0 before any sample."""
        with self._lock:
            last = self.samples[-1][1] if self.samples else {}
        blocks = [w[3] for w in last.values() if w[0] == "decode"]
        return min(blocks) if blocks else 0

    # -- differencing ----------------------------------------------------------------------------

    def _steps(self, rows: list) -> tuple[dict[str, dict[int, list]], dict[str, float]]:
        """Step buckets per phase and busy seconds per role over `rows` (samples)."""
        first: dict[str, dict] = {}
        last: dict[str, tuple[str, dict]] = {}
        for _, workers, _ in rows:
            for name, (role, profile, *_) in workers.items():
                first.setdefault(name, profile)
                last[name] = (role, profile)
        phases: dict[str, list[dict]] = {"prefill": [], "decode": []}
        busy: dict[str, float] = {}
        for name, (role, new) in last.items():
            old = first[name]
            if not _grew(new, old):  # it restarted: all it counted
                old = {}
            for phase in phases:
                phases[phase].append(_diff_buckets(new.get(phase, {}), old.get(phase, {})))
            busy[role] = busy.get(role, 0.0) + new.get("busy_s", 0.0) - old.get("busy_s", 0.0)
        return {phase: merge_steps(parts) for phase, parts in phases.items()}, busy

    def _traffic(self, rows: list) -> tuple[Traffic, float]:
        if not rows:
            return Traffic(0.0, 0.0, 0.0), 0.0
        t0, t1 = rows[0][0], rows[-1][0]
        first: dict[str, dict] = {}
        last: dict[str, dict] = {}
        for _, _, routers in rows:
            for key, tr in routers.items():
                first.setdefault(key, tr)
                last[key] = tr
        sums = {k: 0.0 for k in ("prompt_count", "prompt_sum", "generation_count", "generation_sum")}
        hists: dict[str, dict[float, float]] = {"ttft": {}, "itl": {}}
        for key, new in last.items():
            old = first[key] if first[key] is not new else {}
            if any(new.get(k, 0.0) < old.get(k, 0.0) for k in sums):  # restarted
                old = {}
            for k in sums:
                sums[k] += new.get(k, 0.0) - old.get(k, 0.0)
            for h in hists:
                for le, n in new.get(h, {}).items():
                    hists[h][le] = hists[h].get(le, 0.0) + n - old.get(h, {}).get(le, 0.0)
        span = t1 - t0
        arrivals = sums["prompt_count"]
        return Traffic(
            rate=arrivals / span if span > 0 else 0.0,
            input_len=sums["prompt_sum"] / arrivals if arrivals else 0.0,
            output_len=sums["generation_sum"] / sums["generation_count"] if sums["generation_count"] else 0.0,
            requests=int(arrivals), finished=int(sums["generation_count"]),
            ttft_p50=_ms(percentile(hists["ttft"], 0.5)), ttft_p90=_ms(percentile(hists["ttft"], 0.9)),
            tpot_p50=_ms(percentile(hists["itl"], 0.5)), tpot_p90=_ms(percentile(hists["itl"], 0.9)),
        ), span


def _ms(s: float | None) -> float | None:
    return None if s is None else s * 1000.0


def _diff_buckets(new: dict, old: dict) -> dict[int, list]:
    out = {}
    for b, row in new.items():
        o = old.get(b, [0, 0, 0.0])
        d = [row[0] - o[0], row[1] - o[1], row[2] - o[2]]
        if d[0] > 0:
            out[int(b)] = d
    return out


def _grew(new: dict, old: dict) -> bool:
    """False when a counter went down: the worker restarted from zero (a new incarnation has a new
    name, so this is only a guard)."""
    return not math.isnan(new.get("busy_s", 0.0)) and new.get("busy_s", 0.0) >= old.get("busy_s", 0.0)
