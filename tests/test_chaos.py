"""Every cluster change under a steady load: no request fails, none stalls.

A real `pdserve up` cluster per KV backend (nixl, tcp), two routers, and a steady Poisson load of
short greedy streams through the OpenAI client (pdserve/benchmarks/load/steady.py) running the whole time. Each
case makes one change while the load runs — scale prefill up and down, decode up and down, both at
once, scale while a worker is SIGKILLed, kill a router, kill the controller — and then checks what
a user sees: 0 requests failed, TTFT p95 of the requests sent during the change within
2 x the steady p99 + 1 s and none over 5 s (tests/chaos.py), every KV block back to idle, and
`pdserve status` showing every KV pair.
The cases share the module's cluster: each starts from the 1 + 1 it found and leaves it so.
"""

import asyncio
import os
import re
import signal
import threading
import time

import openai
import pytest

from chaos import STALL_S, change, pairs, scale, steady
from serving_cluster import Cluster


@pytest.fixture(scope="module", params=["nixl", "tcp"])
def cluster(request, tmp_path_factory):
    # A lease longer than any test: a request that waited it out would fail the TTFT bound by far.
    c = Cluster(tmp_path_factory.mktemp(f"chaos-{request.param}"), router={"replicas": 2},
                kv_transfer={"backend": request.param, "lease_s": 60})
    c.backend = request.param
    try:
        c.wait_ready()
        steady(c)
        yield c
    finally:
        if getattr(c, "load", None) is not None:
            c.load.stop()
        assert c.stop() == 0, c.output()


@pytest.fixture(autouse=True)
def from_one_and_one(request, cluster):
    """Each case starts from 1 + 1 with the load running; one that failed midway leaves it so for the
    next (its own failure is reported, not every later case's)."""
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed > failed:
        cluster.cli("scale", "--prefill", "1", "--decode", "1", "--grace", "30")
        cluster.load.resume()


def test_scale_prefill_up_and_down(cluster):
    change(cluster, scale(cluster, prefill=2), 2, 1, "prefill 1 -> 2")
    change(cluster, scale(cluster, prefill=1), 1, 1, "prefill 2 -> 1")


def test_scale_both_up_pairs_the_new_with_the_new_and_nothing_stalls(cluster):
    # The bug: a scale-up of both roles made no pair between the new prefill and the new decode
    # replica; a request routed over it waited out the lease, and moved.
    before = _metric(cluster, "pdserve_request_migrations_total")
    change(cluster, scale(cluster, prefill=2, decode=2), 2, 2, "both 1+1 -> 2+2")
    s = cluster.status()
    assert ("pdserve-prefill-1", "pdserve-decode-1") in pairs(s), s
    # The probe: 16 requests at once spread over every pair; none may wait out a lease.
    assert max(probe(cluster.url, 16)) <= STALL_S
    assert _metric(cluster, "pdserve_request_migrations_total") == before
    assert _metric(cluster, "pdserve_kv_transfer_failures_total") == 0
    change(cluster, scale(cluster, prefill=1, decode=1), 1, 1, "both 2+2 -> 1+1")


def test_scale_decode_up_a_worker_killed_while_prefill_scales_then_down(cluster):
    change(cluster, scale(cluster, decode=2), 1, 2, "decode 1 -> 2")
    pid = cluster.pid("pdserve-decode-0")
    mark = len(cluster.output())

    def kill_and_scale():  # its streams move to decode-1 while prefill-1 starts and pairs
        failed: list[BaseException] = []

        def scale_up():
            try:
                scale(cluster, prefill=2)()
            except BaseException as e:  # (reported by the test's thread below)
                failed.append(e)
        scaling = threading.Thread(target=scale_up)
        scaling.start()
        deadline = time.monotonic() + 120
        while "scale: starting" not in cluster.output()[mark:]:
            assert time.monotonic() < deadline and scaling.is_alive(), (failed, cluster.output()[mark:])
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)  # while the new prefill replica loads
        scaling.join(300)
        assert not scaling.is_alive() and not failed, (failed, cluster.output()[mark:])
    change(cluster, kill_and_scale, 2, 2, "decode-0 SIGKILLed while prefill 1 -> 2",
           after=lambda: cluster.replacements("pdserve-decode-0") >= 1)
    assert cluster.replacements("pdserve-decode-0") == 1, cluster.output()
    # The watch kept probing while the scale waited for its new replica: the death was seen, and the
    # replacement begun, before that replica served (the scale held the watch off until then).
    new = cluster.output()[mark:]
    assert "pdserve-decode-0 is down" in new, new
    assert new.index("pdserve-decode-0 is down") < re.search(r"scale: pdserve-prefill-\d+ serving", new).start(), new
    change(cluster, scale(cluster, decode=1), 2, 1, "decode 2 -> 1")
    change(cluster, scale(cluster, prefill=1), 1, 1, "prefill 2 -> 1 (after the kill)")


def test_kill_a_router(cluster):
    pid = cluster.pid("pdserve-router-1")
    change(cluster, lambda: os.kill(pid, signal.SIGKILL), 1, 1, "a router SIGKILLed",
           after=lambda: cluster.replacements("pdserve-router-1") >= 1)


def test_kill_the_controller(cluster):
    # Ray restarts it; it takes the running replicas and routers back (none restarted) with their
    # KV pairs, and `pdserve status` and `scale` keep working.
    pid = cluster.pid("pdserve-controller")
    workers = {n: cluster.pid(n) for n in ("pdserve-prefill-0", "pdserve-decode-0", "pdserve-router-0")}
    change(cluster, lambda: os.kill(pid, signal.SIGKILL), 1, 1, "the controller SIGKILLed",
           after=lambda: cluster.noted("; none restarted"))  # "recovered 2 replicas and 2 routers in S s; none ..."
    assert cluster.pid("pdserve-controller") != pid
    assert {n: cluster.pid(n) for n in workers} == workers  # nothing healthy restarted
    assert "recovered 2 replicas and 2 routers" in cluster.output(), cluster.output()
    change(cluster, scale(cluster, prefill=2), 2, 1, "prefill 1 -> 2 (restarted controller)")
    change(cluster, scale(cluster, prefill=1), 1, 1, "prefill 2 -> 1 (restarted controller)")


def probe(url: str, n: int) -> list[float]:
    """n greedy requests sent at once (with the steady load); each one's seconds to its answer."""
    async def one(client, i):
        t0 = time.monotonic()
        await client.completions.create(model="tiny-moe", prompt=f"probe {i} " * (1 + i % 5), max_tokens=4,
                                        temperature=0)
        return time.monotonic() - t0

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(n)))
    return asyncio.run(all_of_them())


def _metric(cluster: Cluster, series: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in cluster.metrics().splitlines() if ln.startswith(series))
