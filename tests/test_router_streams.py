"""A worker's stream of deltas to a router (pdserve/worker/router_streams.py) keeps each request's tokens
in order, though Ray runs an async actor's calls (the router is one) in any order."""

import asyncio
import random
import time

import pytest
import ray

from pdserve.control import ray_start
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import FinishReason
from pdserve.worker.router_streams import RouterStreams

NAMESPACE = "test-router-streams"


@ray.remote
class SlowRouter:
    """Takes `deliver` as the router does (async), but each call awaits a random while first: calls
    in flight together would finish, and record, out of order."""

    def __init__(self):
        self.tokens: dict[str, list[int]] = {}
        self.calls = 0

    async def deliver(self, deltas) -> None:
        self.calls += 1
        await asyncio.sleep(random.random() * 0.003)
        for d in deltas:
            self.tokens.setdefault(d.request_id, []).extend(d.token_ids)

    def seen(self) -> tuple[dict[str, list[int]], int]:
        return self.tokens, self.calls


@pytest.fixture(scope="module")
def router():
    ray_start.init(num_cpus=1, namespace=NAMESPACE, include_dashboard=False)
    yield SlowRouter.options(name="router-0", namespace=NAMESPACE).remote()
    ray.shutdown()


def test_tokens_reach_the_router_in_order_and_nothing_is_left_behind(router):
    streams = RouterStreams(NAMESPACE)
    steps = 300
    for rid in ("a", "b"):
        streams.add(rid, "router-0")
    for i in range(steps):  # a fast engine: one step's output after another, no nap between
        for rid in ("a", "b"):
            last = i == steps - 1
            streams.output(RequestOutput(rid, [i], str(i), finished=last,
                                         finish_reason=FinishReason.LENGTH if last else None))
        streams.flush()
    deadline = time.monotonic() + 30
    while streams.flush():  # what the steps left held back goes once the router takes the rest
        assert time.monotonic() < deadline, "deltas still held back after 30 s"
        time.sleep(0.001)
    while True:  # the last message may still be on its way
        tokens, calls = ray.get(router.seen.remote())
        if sum(map(len, tokens.values())) == 2 * steps or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert tokens == {"a": list(range(steps)), "b": list(range(steps))}
    assert calls < steps  # a router taking its time gets fewer, larger messages
    assert len(streams) == 0  # both finished: no longer streaming from here


def test_a_dead_routers_requests_are_orphaned_once_and_stream_no_more(router):
    doomed = SlowRouter.options(name="router-doomed", namespace=NAMESPACE).remote()
    orphaned: list[list[str]] = []
    streams = RouterStreams(NAMESPACE, orphaned=orphaned.append)
    streams.add("x", "router-doomed")
    streams.add("y", "router-doomed")
    streams.add("z", "router-0")
    streams.output(RequestOutput("x", [1], "a"))
    streams.flush()
    ray.get(doomed.seen.remote())
    ray.kill(doomed)
    deadline = time.monotonic() + 30
    while not orphaned:  # its next message finds it dead
        assert time.monotonic() < deadline, "the dead router was never noticed"
        streams.output(RequestOutput("x", [2], "b"))
        streams.output(RequestOutput("z", [2], "b"))
        streams.flush()
        time.sleep(0.01)
    assert orphaned == [["x", "y"]]  # the live router's request is not among them
    for rid in ("x", "y"):  # the worker aborts them: they stream no more
        assert streams.drop(rid)
    streams.output(RequestOutput("z", [3], "c", finished=True, finish_reason=FinishReason.LENGTH))
    while streams.flush():
        time.sleep(0.001)
    assert orphaned == [["x", "y"]] and len(streams) == 0


@ray.remote
class BrokenRouter:
    """A router whose `deliver` raises once (a bug there, not a death), then records."""

    def __init__(self):
        self.deltas = []
        self.calls = 0

    async def deliver(self, deltas) -> None:
        self.calls += 1
        if self.calls == 1:
            raise ValueError("a bug in deliver")
        self.deltas.extend(deltas)

    def seen(self) -> list:
        return self.deltas


def test_a_message_the_router_failed_to_take_ends_its_requests_with_an_error(router):
    broken = BrokenRouter.options(name="router-broken", namespace=NAMESPACE).remote()
    streams = RouterStreams(NAMESPACE)
    streams.add("p", "router-broken")
    streams.add("q", "router-broken")
    streams.output(RequestOutput("p", [1], "a"))  # lost with the failed message
    streams.flush()
    deadline = time.monotonic() + 30
    seen = []
    while not seen:  # the next messages: p's error (its tokens were lost), q's output goes on
        assert time.monotonic() < deadline, "the failed message was never answered"
        streams.output(RequestOutput("q", [2], "b"))
        streams.flush()
        time.sleep(0.05)
        seen = [d for d in ray.get(broken.seen.remote()) if d.request_id == "p"]
    assert seen[0].finish_reason == "error" and "could not take" in seen[0].error, seen
    assert all(d.finish_reason != "error" for d in ray.get(broken.seen.remote()) if d.request_id == "q")
