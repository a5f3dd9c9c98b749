"""The cluster as `pdserve status --watch` (control/watch.py) and the router's /dashboard
(router/dashboard.py) both show it: the service's latency over the last minute, and the status's
replicas and routers as rows. Plain functions, unit-tested without a cluster; no torch, no Ray.

The latency comes from the routers' Prometheus histograms: each router's /metrics is scraped every
interval, and the window is the difference between the newest scrape and the oldest one at most
WINDOW_S old, summed over every router. Percentiles are read off the bucket counts by linear
interpolation inside the bucket (as Prometheus' histogram_quantile does). The prefix cache's hit
rate over the window comes the same way from each replica's cumulative lookups (ReplicaStats.profile
in the controller's status), a window source of its own per replica.
"""

import math
import os
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60.0
TTFT = "pdserve_ttft_seconds"
TPOT = "pdserve_inter_token_latency_seconds"
REQUESTS = "pdserve_requests_total"
# A replica's cumulative prefix-cache figures (prompt tokens looked up, and found): ReplicaStats.profile's keys.
PREFIX_QUERIES, PREFIX_HITS = "prefix_queries", "prefix_hits"


# -- scraping -------------------------------------------------------------------------------------


@dataclass
class Snapshot:
    """One router's (or several routers' summed) cumulative figures: histogram name -> {upper bound:
    cumulative count} (math.inf for +Inf), and requests answered in all; or one replica's cumulative
    counters (PREFIX_QUERIES, PREFIX_HITS)."""

    histograms: dict[str, dict[float, float]] = field(default_factory=dict)
    requests: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)


def parse_metrics(text: str) -> Snapshot:
    """The figures `watch` uses, from a /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (TTFT + "_bucket", TPOT + "_bucket"):
                buckets = snap.histograms.setdefault(s.name.removesuffix("_bucket"), {})
                le = float(s.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + s.value
            elif s.name == REQUESTS:
                snap.requests += s.value
    return snap


def combine(snaps: list[Snapshot]) -> Snapshot:
    """Several routers' figures as one: counts add up, bucket by bucket."""
    out = Snapshot()
    for snap in snaps:
        out.requests += snap.requests
        for name, n in snap.counters.items():
            out.counters[name] = out.counters.get(name, 0.0) + n
        for name, buckets in snap.histograms.items():
            mine = out.histograms.setdefault(name, {})
            for le, n in buckets.items():
                mine[le] = mine.get(le, 0.0) + n
    return out


def difference(new: Snapshot, old: Snapshot | None) -> Snapshot:
    """What one router (or replica) counted between two scrapes. With no earlier scrape (a router that
    appeared meanwhile), or one it has counted below (it restarted, from zero), all it has counted since
    it started."""
    if old is None or new.requests < old.requests or any(
            n < old.histograms.get(name, {}).get(le, 0.0)
            for name, buckets in new.histograms.items() for le, n in buckets.items()) or any(
            n < old.counters.get(name, 0.0) for name, n in new.counters.items()):
        return new
    return Snapshot({name: {le: n - old.histograms.get(name, {}).get(le, 0.0) for le, n in buckets.items()}
                     for name, buckets in new.histograms.items()}, new.requests - old.requests,
                    {name: n - old.counters.get(name, 0.0) for name, n in new.counters.items()})


def percentile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile (0..1) of a histogram given as {upper bound: cumulative count}: linear inside
    the bucket it falls in (from 0 in the first); in the +Inf bucket, the highest finite bound. None
    when the histogram counted nothing."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank = q * total
    lo, below = 0.0, 0.0
    for le in bounds:
        n = buckets[le]
        if n >= rank and n > below:
            if math.isinf(le):
                return lo
            return lo + (le - lo) * (rank - below) / (n - below)
        lo, below = (le if not math.isinf(le) else lo), n
    return lo


@dataclass
class Latency:
    """The service over a window: TTFT and TPOT p50/p90 (seconds; None: nothing counted), requests/s,
    and the share of prompt tokens looked up in the replicas' prefix caches that were found there
    (None: no lookup in the window)."""

    window_s: float
    requests_per_s: float
    ttft_p50: float | None
    ttft_p90: float | None
    tpot_p50: float | None
    tpot_p90: float | None
    prefix_hit_rate: float | None = None


def latency(window: Snapshot, window_s: float) -> Latency:
    ttft, tpot = window.histograms.get(TTFT, {}), window.histograms.get(TPOT, {})
    queries = window.counters.get(PREFIX_QUERIES, 0.0)
    return Latency(window_s, window.requests / window_s if window_s > 0 else 0.0,
                   percentile(ttft, 0.5), percentile(ttft, 0.9), percentile(tpot, 0.5), percentile(tpot, 0.9),
                   window.counters.get(PREFIX_HITS, 0.0) / queries if queries > 0 else None)


class Window:
    """Scrapes of every router (and replica_snapshots) kept for WINDOW_S; `latency()` over the oldest
    of them to the newest."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self.scrapes: deque[tuple[float, dict[str, Snapshot]]] = deque()

    def add(self, t: float, by_router: dict[str, Snapshot]) -> None:
        self.scrapes.append((t, by_router))
        while len(self.scrapes) > 2 and t - self.scrapes[0][0] > self.window_s:
            self.scrapes.popleft()

    def latency(self) -> Latency | None:
        """None until there are two scrapes to difference."""
        if len(self.scrapes) < 2:
            return None
        (t0, old), (t1, new) = self.scrapes[0], self.scrapes[-1]
        return latency(combine([difference(snap, old.get(url)) for url, snap in new.items()]), t1 - t0)


def router_urls(status: dict) -> list[str]:
    """Each router's own HTTP address (its /metrics counts what it served); with one router, the
    service's "http" endpoint."""
    urls = []
    for r in status.get("routers", {}).values():
        if isinstance(r, dict):
            url = r["endpoints"].get("own") or r["endpoints"].get("http")
            if url and url not in urls:
                urls.append(url)
    if not urls and "http" in status.get("endpoints", {}):
        urls.append(status["endpoints"]["http"])
    return urls


def replica_snapshots(status: dict) -> dict[str, Snapshot]:
    """Each serving replica's prefix-cache counters, keyed apart from the routers' URLs ("replica:"
    and its name) so that one Window differences both. A replica down or draining is left out; a
    replaced one counts from zero again, which `difference` takes for a restart."""
    out = {}
    for name, r in status.get("replicas", {}).items():
        if not isinstance(r, str):
            out[f"replica:{name}"] = Snapshot(counters={k: float(r.profile.get(k, 0))
                                                        for k in (PREFIX_QUERIES, PREFIX_HITS)})
    return out


ADMIN_KEY_VAR = "PDSERVE_ADMIN_KEY"  # an admin API key: with keys on, a router's /metrics is an admin's


def scrape(urls: list[str], timeout: float = 2.0) -> dict[str, Snapshot]:
    """Each router's figures; one that does not answer is left out (it is down, and shown so), as is
    one that refuses (keys on, and no admin key in PDSERVE_ADMIN_KEY)."""
    import httpx

    key = os.environ.get(ADMIN_KEY_VAR)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    out = {}
    for url in urls:
        try:
            r = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout)
            if r.is_success:
                out[url] = parse_metrics(r.text)
        except (httpx.HTTPError, ValueError):
            pass
    return out


# -- the status as rows ----------------------------------------------------------------------------


@dataclass
class ReplicaRow:
    """One replica as shown: health is "serving", "draining" or "down: why"; its load figures are
    None when it is not serving (nothing to read)."""

    role: str
    name: str
    health: str
    restarts: int
    running: int | None = None
    waiting: int | None = None
    kv_used: int | None = None
    kv_total: int | None = None


@dataclass
class RouterRow:
    """One router as shown (pid and streaming None when it is down)."""

    name: str
    health: str
    restarts: int
    pid: int | None = None
    streaming: int | None = None


def replica_rows(status: dict) -> list[ReplicaRow]:
    """The controller's status (or a router's own view of the replicas, in the same shape) as rows."""
    restarts = status.get("restarts", {})
    rows = []
    for name, r in status["replicas"].items():
        if isinstance(r, str):
            role = name.removeprefix("pdserve-").rsplit("-", 1)[0]
            rows.append(ReplicaRow(role, name, r, restarts.get(name, 0)))
        else:
            rows.append(ReplicaRow(r.role, name, "serving", restarts.get(name, 0), r.running, r.waiting,
                                   r.total_blocks - r.free_blocks, r.total_blocks))
    return rows


def router_rows(status: dict) -> list[RouterRow]:
    restarts = status.get("restarts", {})
    return [RouterRow(name, r, restarts.get(name, 0)) if isinstance(r, str)
            else RouterRow(name, "serving", restarts.get(name, 0), r["pid"], r["in_flight"])
            for name, r in status.get("routers", {}).items()]
