"""Overload at twice the capacity through `pdserve up` (tiny-moe on CPU, one prefill and one decode
replica): admission control admits what meets the TTFT SLO and refuses the rest at once.

Capacity here is set by the configuration, not the machine's speed: the decode replica has SLOTS
sequence slots and every request asks for LONG tokens (ignore_eos), so one that finds the slots
taken would wait LONG decode steps for a slot: at least 3 s at 3 ms a step (a fast CPU), 3x the 1 s
SLO; on this 2-core machine the forecasts of those refused were 5-10 s. One that finds a slot waits
for its prefill only: its forecast 0.05-0.5 s, its TTFT 33-750 ms measured in 34 bursts beside
another serving test (load average 3-8), the worst p90 of a burst 696 ms. So every burst of
2 x SLOTS gets exactly SLOTS admitted and SLOTS refused. The refusals came in 0.3-37 ms (timed to
the kernel's arrival of the answer), but once in 36 bursts in 123 ms: the router waited that long
for a core. So the timing bounds (p90 within the SLO, refusals within 50 ms) are given BURSTS
bursts to be met in one; everything else must hold in each. The admitted are cut short once they
have shown their first tokens (their clients leave: aborted), and every block comes back."""

import asyncio
import gc
import math

import grpc
import pytest

from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2, completion_pb2_grpc
from serving_cluster import Cluster, until
from timed_http import Connection

SLO_MS = 1000
SLOTS = 10
LONG = 1024
REFUSE_WITHIN_MS = 50
BURSTS = 3  # bursts the timing bounds are given (every one must split and refuse alike)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # One router: admission control forecasts from this router's own requests (several routers
    # each see only theirs, and the replicas' stats half a second late).
    c = Cluster(tmp_path_factory.mktemp("overload"), router={"replicas": 1, "refuse_over_slo": True},
                decode={"max_num_seqs": SLOTS}, slo={"ttft_ms": SLO_MS})
    try:
        c.wait_ready()
        # Steps measured first: nothing is refused (nor forecast) before the router's stats of the
        # replicas hold a step profile (polled every 0.5 s).
        until(lambda: asyncio.run(burst(c.url, [dict(max_tokens=16)] * SLOTS)) and c.wait_idle() and
              metric(c.metrics(), "pdserve_ttft_forecast_seconds_count") > 0, timeout_s=60, what="a forecast")
        yield c
    finally:
        c.stop()


async def burst(url: str, requests: list[dict], during=None) -> list[dict]:
    """All at once, over connections opened beforehand (so that no connect is timed); `during`
    runs (in a thread) once every answer has begun — the refusals are in, the admitted stream —
    and then the streams are cut short (a few more events each).
    This process's garbage collector is off meanwhile: a full collection of a test process's heap
    (every module a test session imported, torch's included) held its loop ~100 ms here, and every
    answer that came in meanwhile read as that much later."""
    conns = await asyncio.gather(*(Connection.open(url) for _ in requests))
    enough = asyncio.Event()
    gc.disable()
    try:
        tasks = [asyncio.ensure_future(c.complete(**kw, enough=enough)) for c, kw in zip(conns, requests)]
        extra = None
        if during is not None:
            while not all(c.status for c in conns) and not any(t.done() and t.exception() for t in tasks):
                await asyncio.sleep(0.005)
            extra = await asyncio.to_thread(during)
            enough.set()
        results = await asyncio.gather(*tasks)
    finally:
        gc.enable()
        for c in conns:
            c.close()
    return results if during is None else (results, extra)


def metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + labels + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_overload_at_twice_the_capacity(cluster):
    channel = grpc.insecure_channel(cluster.grpc_address)  # connected before: the burst's timing is its own
    grpc.channel_ready_future(channel).result(timeout=30)

    def grpc_meanwhile():
        with pytest.raises(grpc.RpcError) as e:
            completion_pb2_grpc.CompletionStub(channel).Complete(
                completion_pb2.CompletionRequest(prompt="x" * 20, max_tokens=LONG, ignore_eos=True), timeout=30)
        return e.value

    seen = []  # each burst's admitted TTFTs and refusals' times, ms
    with channel:
        for _ in range(BURSTS):
            results, grpc_error = asyncio.run(burst(cluster.url, [dict(max_tokens=LONG)] * (2 * SLOTS),
                                                    grpc_meanwhile))
            assert all(r["status"] in (200, 429) for r in results), [r["status"] for r in results]  # no 5xx
            admitted = [r for r in results if r["status"] == 200]
            refused = [r for r in results if r["status"] == 429]
            assert len(admitted) == SLOTS and len(refused) == SLOTS
            assert all(r["events"] >= 8 and "error" not in r for r in admitted)  # streaming (until cut short)
            for r in refused:  # told when to come back
                assert int(r["retry_after"]) >= 1 and r["error"]["code"] == "overloaded"
                assert r["error"]["type"] == "overloaded_error" and "slo.ttft_ms" in r["error"]["message"]
            # gRPC, while the slots are still taken: RESOURCE_EXHAUSTED, and when to come back.
            assert grpc_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "slo.ttft_ms" in grpc_error.details()
            trailers = dict(grpc_error.trailing_metadata())
            assert int(trailers["retry-after"]) >= 1 and int(trailers["grpc-retry-pushback-ms"]) >= 1000
            stats = cluster.wait_idle()  # every block back
            assert len(stats) == 2 and all(s["used"] == 0 for s in stats.values()), stats
            # The admitted meet the SLO at p90 (nearest rank); the rest are refused within 50 ms.
            ttft = sorted(r["after_s"] * 1000 for r in admitted)
            refusals = sorted(r["after_s"] * 1000 for r in refused)
            seen.append((ttft, refusals))
            if ttft[math.ceil(0.9 * SLOTS) - 1] <= SLO_MS and refusals[-1] <= REFUSE_WITHIN_MS:
                break
        else:
            raise AssertionError(f"no burst in {BURSTS} met the SLO and the 50 ms: {seen}")
    text = cluster.metrics()  # every refusal counted by its reason; nothing waits
    assert metric(text, "pdserve_requests_refused_total", '{reason="predicted_ttft"}') == (SLOTS + 1) * len(seen)
    assert metric(text, "pdserve_requests_total", '{endpoint="/v1/completions",status="429"}') == SLOTS * len(seen)
    assert metric(text, "pdserve_router_queue_depth") == 0
