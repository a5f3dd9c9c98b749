"""What the server says about a run: its router's timing histograms (/metrics) before and after
it, as the mean of each phase over the run's requests.

The client sees one TTFT; the router splits it (`pdserve_request_phase_seconds`): reserve (KV
blocks on a decode replica), dispatch (handing the prompt to a prefill or colocated replica),
first_token (from then until the first token reached the router: queueing and prefill there, the
KV transfer, the decode replica's first step); and `pdserve_kv_transfer_seconds` times the KV
transfers alone. A server without /metrics gives nothing, and the run goes on.
"""

import httpx
from prometheus_client.parser import text_string_to_metric_families

_HISTOGRAMS = {"pdserve_request_phase_seconds", "pdserve_kv_transfer_seconds"}

Scrape = dict[str, tuple[float, float]]  # phase (or "kv_transfer") -> (sum of seconds, count)


async def scrape(client: httpx.AsyncClient, url: str) -> Scrape | None:
    try:
        r = await client.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out: Scrape = {}
    for family in text_string_to_metric_families(r.text):
        if family.name not in _HISTOGRAMS:
            continue
        for s in family.samples:
            key = s.labels.get("phase", "kv_transfer")
            total, count = out.get(key, (0.0, 0.0))
            if s.name.endswith("_sum"):
                out[key] = (s.value, count)
            elif s.name.endswith("_count"):
                out[key] = (total, s.value)
    return out


def means_ms(before: Scrape | None, after: Scrape | None) -> dict[str, float]:
    """Mean milliseconds of each phase over what the server recorded between two scrapes."""
    if before is None or after is None:
        return {}
    means = {}
    for key, (total, count) in after.items():
        total0, count0 = before.get(key, (0.0, 0.0))
        if count > count0:
            means[key] = round((total - total0) / (count - count0) * 1e3, 2)
    return means
