"""What the server says about a run: its router's timing histograms (/metrics) before and after
it, as the mean and the 99th percentile of each phase over the run's requests.

The client sees one TTFT; the router splits it (`pdserve_request_phase_seconds`): admit (from the
request's arrival at the router's lifecycle until it is first handed to a worker), reserve (KV
blocks on a decode replica), dispatch (handing the prompt to a prefill or colocated replica),
first_token (from then until the first token reached the router: queueing and prefill there, the
KV transfer, the decode replica's first step); `pdserve_kv_transfer_seconds` times the KV
transfers alone; `pdserve_router_loop_lag_seconds` (loop_lag) how late the router's loop woke. The percentile is read off the histogram's buckets: "p99 ≤ X" is the upper
bound of the bucket holding it. A server without /metrics gives nothing, and the run goes on.
"""

import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Each histogram's key in a Scrape: the phase's name, or the histogram's own.
_HISTOGRAMS = {"pdserve_request_phase_seconds": None, "pdserve_kv_transfer_seconds": "kv_transfer",
               "pdserve_router_loop_lag_seconds": "loop_lag"}
_ROUTERS = "routers"  # the Scrape's entry naming the routers scraped (pdserve_router_info), not a phase
_CPU = "cpu"  # the Scrape's entry of the routers' process_cpu_seconds_total, added up, not a phase

Scrape = dict[str, dict]  # phase (or "kv_transfer") -> {"sum": s, "count": n, "buckets": {le: cumulative n}}


async def scrape(client: httpx.AsyncClient, urls: list[str]) -> Scrape | None:
    """The histograms of every router named (several routers of one cluster: each its own address,
    as `pdserve status` lists them), added up; None if one does not answer."""
    out: Scrape = {_ROUTERS: {"names": []}}
    for url in urls:
        one = await _scrape_one(client, url)
        if one is None:
            return None
        out[_ROUTERS]["names"] += one.pop(_ROUTERS)["names"]
        cpu = one.pop(_CPU, None)
        if cpu is not None and out.get(_CPU, 0.0) is not None:
            out[_CPU] = out.get(_CPU, 0.0) + cpu
        else:
            out[_CPU] = None  # (one router without it: no total)
        for key, h in one.items():
            entry = out.setdefault(key, {"sum": 0.0, "count": 0.0, "buckets": {}})
            entry["sum"] += h["sum"]
            entry["count"] += h["count"]
            for le, n in h["buckets"].items():
                entry["buckets"][le] = entry["buckets"].get(le, 0.0) + n
    return out


async def _scrape_one(client: httpx.AsyncClient, url: str) -> Scrape | None:
    try:
        r = await client.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    return parse(r.text)


def parse(text: str) -> Scrape:
    """The phase and transfer histograms of a /metrics text."""
    out: Scrape = {_ROUTERS: {"names": []}}
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_router_info":
            out[_ROUTERS]["names"] += [s.labels["router"] for s in family.samples]
        if family.name == "process_cpu_seconds":
            out[_CPU] = sum(s.value for s in family.samples)
        if family.name not in _HISTOGRAMS:
            continue
        for s in family.samples:
            entry = out.setdefault(s.labels.get("phase", _HISTOGRAMS[family.name]), {"sum": 0.0, "count": 0.0, "buckets": {}})
            if s.name.endswith("_sum"):
                entry["sum"] = s.value
            elif s.name.endswith("_count"):
                entry["count"] = s.value
            elif s.name.endswith("_bucket"):
                entry["buckets"][float(s.labels["le"])] = s.value
    return out


def means_ms(before: Scrape | None, after: Scrape | None) -> dict[str, float]:
    """Milliseconds of each phase over what the server recorded between two scrapes: the mean
    (key: the phase) and the 99th percentile's bucket bound (key: "<phase> p99<=")."""
    if before is None or after is None:
        return {}
    # The two scrapes reached different routers (through a shared port): no figures, rather than wrong ones.
    if before.get(_ROUTERS) != after.get(_ROUTERS) or any(
            after.get(k, {}).get("count", 0.0) < h.get("count", 0.0) for k, h in before.items()
            if k not in (_ROUTERS, _CPU)):
        return {}
    out = {}
    for key, now in after.items():
        if key in (_ROUTERS, _CPU):
            continue
        then = before.get(key, {"sum": 0.0, "count": 0.0, "buckets": {}})
        n = now["count"] - then["count"]
        if n <= 0:
            continue
        out[key] = round((now["sum"] - then["sum"]) / n * 1e3, 2)
        for le in sorted(now["buckets"]):
            if now["buckets"][le] - then["buckets"].get(le, 0.0) >= 0.99 * n:
                if not math.isinf(le):
                    out[f"{key} p99<="] = round(le * 1e3, 3)
                break
        if key == "loop_lag":  # the run's longest pause of the router's loop: the bucket of its last sample
            top = min((le for le in now["buckets"] if now["buckets"][le] - then["buckets"].get(le, 0.0) >= n),
                      default=math.inf)
            out[f"{key} max<="] = round(top * 1e3, 3) if not math.isinf(top) else float("inf")
    return out


def router_cpu_s(before: Scrape | None, after: Scrape | None) -> float | None:
    """CPU seconds the scraped routers spent between two scrapes (process_cpu_seconds_total): the
    run's window alone, not the bench's start or warm-up; None where a scrape lacks it or the two
    reached different routers."""
    if before is None or after is None or before.get(_ROUTERS) != after.get(_ROUTERS):
        return None
    if before.get(_CPU) is None or after.get(_CPU) is None:
        return None
    return round(after[_CPU] - before[_CPU], 3)
