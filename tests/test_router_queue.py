"""The router's admission queue through `pdserve up` (one colocated tiny-moe replica on CPU, two
sequence slots; the router hands it at most one request without a first token, and queues two):
requests wait in the router by priority, then arrival; a full queue refuses at once, or gives a
lower-priority request's place to a higher one; a client that leaves while queued is dropped;
every block comes back.

Nothing here depends on the machine's speed: each step waits for the state it needs (the router's
/metrics: its queue's depth, the requests it handed over), and the long requests that hold the two
slots run until the test lets them go (their clients leave)."""

import asyncio

import grpc
import pytest

from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2, completion_pb2_grpc
from serving_cluster import Cluster
from timed_http import Connection

LOW, HIGH = 5, -1
LONG = 2000  # tokens asked by the requests that hold the slots: they are cut short, never run out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("queue"), colocated={"replicas": 1, "max_num_seqs": 2},
                router={"replicas": 1, "max_queued": 2, "max_queued_per_replica": 1})
    try:
        c.wait_ready()
        yield c
    finally:
        c.stop()


def sample(text: str, name: str, labels: str = "") -> float:
    """A metric's value (summed over its series when `labels` is empty and it has several)."""
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + labels + " ") or (not labels and line.startswith(name + "{"))]
    return sum(values)


async def eventually(cluster: Cluster, check, what: str, timeout_s: float = 60) -> str:
    """Poll the router's /metrics until check(text) holds; returns the text."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check(text := await asyncio.to_thread(cluster.metrics)):
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)
    return text


def depth(text: str) -> float:
    return sample(text, "pdserve_router_queue_depth")


def closed(text: str) -> float:
    """Requests whose client left before they finished (HTTP has no status for it: nginx's 499)."""
    return sample(text, "pdserve_requests_total", '{endpoint="/v1/completions",status="499"}')


def handed(text: str) -> float:
    """Requests the router handed to the replica so far."""
    return sample(text, "pdserve_replica_requests_total")


async def hold_the_slots(cluster: Cluster, conns: list[Connection], stop: asyncio.Event) -> list[asyncio.Task]:
    """Two long low-priority requests, both streaming: the replica's slots are taken."""
    tasks = [asyncio.ensure_future(c.complete(LONG, LOW, enough=stop)) for c in conns]
    while not all(c.status == 200 for c in conns):
        assert not any(t.done() for t in tasks), [t.result() for t in tasks if t.done()]
        await asyncio.sleep(0.02)
    return tasks


async def let_go(conns: list[Connection], tasks: list[asyncio.Task], stop: asyncio.Event) -> None:
    """The slot holders' clients leave (a few more tokens each first): their requests are aborted."""
    stop.set()
    for t in tasks:
        assert (await t)["events"] >= 8
    for c in conns:
        c.close()


def test_a_high_priority_request_overtakes_queued_low_priority_ones(cluster):
    async def scenario():
        a, b, c, d, e, f, h = [await Connection.open(cluster.url) for _ in range(7)]
        stop = asyncio.Event()
        start = handed(await asyncio.to_thread(cluster.metrics))
        holders = await hold_the_slots(cluster, [a, b], stop)
        # C is handed over and waits at the replica for a slot; D and E wait in the router.
        tc = asyncio.ensure_future(c.complete(8, LOW))
        await eventually(cluster, lambda t: handed(t) == start + 3, "C handed to the replica")
        td = asyncio.ensure_future(d.complete(8, LOW))
        await eventually(cluster, lambda t: depth(t) == 1, "D queued")
        te = asyncio.ensure_future(e.complete(8, LOW))
        await eventually(cluster, lambda t: depth(t) == 2, "E queued")
        # The queue is full: a request of the same priority is refused at once...
        full = await f.complete(8, LOW)
        # ... and one of a higher priority takes the place of the last low-priority one waiting.
        th = asyncio.ensure_future(h.complete(8, HIGH))
        displaced = await te
        await eventually(cluster, lambda t: depth(t) == 2, "H and D queued")
        assert not (tc.done() or td.done() or th.done())
        await let_go([a, b], holders, stop)  # room: C gets a slot, then H (the first in the queue), then D
        done = {name: await t for name, t in (("C", tc), ("D", td), ("H", th))}
        for conn in (c, d, e, f, h):
            conn.close()
        return full, displaced, done

    full, displaced, done = asyncio.run(scenario())
    assert full["status"] == 429 and full["error"]["code"] == "overloaded" and "queue is full" in full["error"]["message"]
    assert displaced["status"] == 429 and "higher priority" in displaced["error"]["message"]
    assert int(full["retry_after"]) >= 1 and int(displaced["retry_after"]) >= 1
    assert all(r["status"] == 200 and r["tokens"] == 8 and "error" not in r for r in done.values()), done
    assert done["H"]["first_at"] < done["D"]["first_at"]  # H came after D, and overtook it
    stats = cluster.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats
    text = cluster.metrics()
    assert depth(text) == 0
    assert sample(text, "pdserve_requests_refused_total", '{reason="queue_full"}') == 1
    assert sample(text, "pdserve_requests_refused_total", '{reason="displaced"}') == 1
    assert sample(text, "pdserve_router_queue_wait_seconds_count") >= 5  # each admitted: A, B, C, H, D


@pytest.mark.parametrize("front_end", ["http", "grpc"])
def test_a_request_whose_client_leaves_while_queued_is_dropped(cluster, front_end):
    async def scenario():
        a, b, c, d = [await Connection.open(cluster.url) for _ in range(4)]
        stop = asyncio.Event()
        before = await asyncio.to_thread(cluster.metrics)
        holders = await hold_the_slots(cluster, [a, b], stop)
        tc = asyncio.ensure_future(c.complete(8, LOW))
        await eventually(cluster, lambda t: handed(t) == handed(before) + 3, "C handed to the replica")
        if front_end == "http":
            td = asyncio.ensure_future(d.complete(8, LOW))
        else:
            channel = grpc.aio.insecure_channel(cluster.grpc_address)
            call = completion_pb2_grpc.CompletionStub(channel).CompleteStream(
                completion_pb2.CompletionRequest(prompt="queued", max_tokens=8, priority=LOW))
        await eventually(cluster, lambda t: depth(t) == 1, "D queued")
        if front_end == "http":  # D's client leaves
            td.cancel()
            d.close()
            await eventually(cluster, lambda t: depth(t) == 0 and closed(t) == closed(before) + 1,
                             "D dropped from the queue, counted as its client's leaving")
        else:
            call.cancel()
            await eventually(cluster, lambda t: depth(t) == 0, "D dropped from the queue")
            await channel.close()
        await let_go([a, b], holders, stop)
        served = await tc
        c.close()
        return before, served

    before, served = asyncio.run(scenario())
    assert served["status"] == 200 and served["tokens"] == 8
    stats = cluster.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats
    text = cluster.metrics()
    assert handed(text) == handed(before) + 3  # D never reached the replica
    assert depth(text) == 0
