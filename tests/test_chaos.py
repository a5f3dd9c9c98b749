"""Every cluster change under a steady load: no request fails, none stalls.

A real `pdserve up` cluster per KV backend (nixl, tcp), two routers, and a steady Poisson load of
short greedy streams through the OpenAI client (tests/steady_load.py) running the whole time. Each
case makes one change while the load runs — scale prefill up and down, decode up and down, both at
once, scale while a worker is SIGKILLed, kill a router, kill the controller — and then checks what
a user sees: 0 requests failed, TTFT p99 of the requests sent during the change within
2 x the steady p99 + 1 s, every KV block back to idle, and `pdserve status` showing every KV pair.
The cases share the module's cluster: each starts from the 1 + 1 it found and leaves it so.
"""

import os
import signal
import time

import pytest

from serving_cluster import Cluster, until
from steady_load import SteadyLoad

RATE = 3.0  # requests a second: steady on 2 cores beside a replica that starts
STEADY_S = 12.0  # the reference window, before any change
AFTER_S = 2.0  # the change's window runs this long past its end (requests sent then still see it)


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def cluster(request, tmp_path_factory):
    # A lease longer than any test: a request that waited it out would fail the TTFT bound by far.
    c = Cluster(tmp_path_factory.mktemp(f"chaos-{request.param}"), router={"replicas": 2},
                kv_transfer={"backend": request.param, "lease_s": 60})
    try:
        c.wait_ready()
        c.load = SteadyLoad(c.url, RATE)
        c.load.start()
        time.sleep(STEADY_S)
        c.steady_p99 = c.load.window(0, time.monotonic()).ttft_p99()
        yield c
    finally:
        if getattr(c, "load", None) is not None:
            c.load.stop()
        assert c.stop() == 0, c.output()


def pairs(status: str) -> set[tuple[str, str]]:
    """(prefill worker, decode worker) of every KV pair `pdserve status` lists as paired."""
    out = set()
    for line in status.splitlines():
        if line.startswith("KV ") and ": not paired" not in line:
            a, b = line[3:].split(": ", 1)[0].split(" -> ")
            out.add((a, b))
    return out


def replicas(status: str, role: str) -> list[str]:
    return sorted({ln.split(" ", 1)[0].rstrip(":") for ln in status.splitlines()
                   if ln.startswith(f"pdserve-{role}-")})


def settled(cluster: Cluster, prefill: int, decode: int) -> str:
    """Until `pdserve status` shows the cluster running with these replicas, every one serving,
    and every prefill worker paired with every decode worker; returns that status."""
    def check():
        s = cluster.status()
        if "state: running" not in s or "down:" in s or "draining" in s:
            return None
        p, d = replicas(s, "prefill"), replicas(s, "decode")
        if (len(p), len(d)) != (prefill, decode):
            return None
        return s if len(pairs(s)) == prefill * decode else None
    return until(check, timeout_s=120, what=f"{prefill} + {decode} replicas serving, all paired")


def change(cluster: Cluster, do, prefill: int, decode: int) -> dict:
    """Do the change under the load; check what the requests sent meanwhile saw, and the cluster
    after it. Returns the figures (benchmarks.md's table)."""
    t0 = time.monotonic()
    do()
    t1 = time.monotonic()
    status = settled(cluster, prefill, decode)
    paired = time.monotonic() - t0
    time.sleep(AFTER_S)
    w = cluster.load.window(t0, max(t1, time.monotonic() - AFTER_S))
    cluster.load.drain(timeout_s=60)
    figures = {"sent": w.sent, "failed": w.failed, "p99_s": w.ttft_p99(), "steady_p99_s": cluster.steady_p99,
               "paired_s": paired}
    print("chaos:", figures)
    assert w.failed == 0, f"{w.failed} of {w.sent} requests failed: {w.errors[:3]}"
    assert w.sent > 0
    assert w.ttft_p99() <= 2 * cluster.steady_p99 + 1.0, figures
    stats = cluster.wait_idle(timeout=60)  # (nothing in flight: every block back)
    assert stats and all(s.get("used") == 0 for s in stats.values()), stats
    cluster.load.resume()
    return figures


def scale(cluster: Cluster, **counts):
    args = [x for role, n in counts.items() for x in (f"--{role}", str(n))]

    def do():
        r = cluster.cli("scale", *args, "--grace", "60")
        assert r.returncode == 0, r.stderr
    return do


def test_scale_prefill_up_and_down(cluster):
    change(cluster, scale(cluster, prefill=2), 2, 1)
    change(cluster, scale(cluster, prefill=1), 1, 1)


def test_scale_both_up_pairs_the_new_with_the_new_and_nothing_stalls(cluster):
    # The bug: a scale-up of both roles made no pair between the new prefill and the new decode
    # replica; a request routed over it waited out the lease, and moved.
    before = _metric(cluster, "pdserve_request_migrations_total")
    change(cluster, scale(cluster, prefill=2, decode=2), 2, 2)
    s = cluster.status()
    assert ("pdserve-prefill-1", "pdserve-decode-1") in pairs(s), s
    assert _metric(cluster, "pdserve_request_migrations_total") == before
    assert _metric(cluster, "pdserve_kv_transfer_failures_total") == 0
    change(cluster, scale(cluster, prefill=1, decode=1), 1, 1)


def test_scale_decode_up_a_worker_killed_while_prefill_scales_then_down(cluster):
    change(cluster, scale(cluster, decode=2), 1, 2)
    pid = cluster.pid("pdserve-decode-0")

    def kill_and_scale():  # its streams move to decode-1 while prefill-1 starts and pairs
        os.kill(pid, signal.SIGKILL)
        scale(cluster, prefill=2)()
    change(cluster, kill_and_scale, 2, 2)
    assert cluster.replacements("pdserve-decode-0") == 1, cluster.output()
    change(cluster, scale(cluster, decode=1), 2, 1)
    change(cluster, scale(cluster, prefill=1), 1, 1)


def test_kill_a_router(cluster):
    pid = cluster.pid("pdserve-router-1")
    change(cluster, lambda: os.kill(pid, signal.SIGKILL), 1, 1)
    until(lambda: cluster.replacements("pdserve-router-1") >= 1, 120, "the router replaced")


def test_kill_the_controller(cluster):
    # Ray restarts it; it takes the running replicas and routers back (none restarted) with their
    # KV pairs, and `pdserve status` and `scale` keep working.
    pid = cluster.pid("pdserve-controller")
    workers = {n: cluster.pid(n) for n in ("pdserve-prefill-0", "pdserve-decode-0", "pdserve-router-0")}
    change(cluster, lambda: os.kill(pid, signal.SIGKILL), 1, 1)
    assert cluster.pid("pdserve-controller") != pid
    assert {n: cluster.pid(n) for n in workers} == workers  # nothing healthy restarted
    assert "recovered 2 replicas and 2 routers" in cluster.output(), cluster.output()
    change(cluster, scale(cluster, prefill=2), 2, 1)
    change(cluster, scale(cluster, prefill=1), 1, 1)


def _metric(cluster: Cluster, series: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in cluster.metrics().splitlines() if ln.startswith(series))
