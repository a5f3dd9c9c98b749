"""An idle router's periodic tasks (router/idle.py): the stats poll slows and the loop-lag sampler
stops while no request is in flight, and both wake as soon as one starts. On a real event loop
with real timers, and a RouterCore polling a real Ray actor; test_serving.py checks a served
cluster's sampler stays still at idle."""

import asyncio
import time

import pytest

from pdserve.messages import ReplicaChange, ReplicaStats
from pdserve.router import idle, loop_lag
from pdserve.router.core import RouterCore
from pdserve.router.idle import Activity
from pdserve.tokenizer import load_tokenizer


def test_pause_sleeps_the_busy_period_while_requests_are_in_flight():
    async def go():
        activity = Activity(lambda: 1)
        t = time.monotonic()
        await activity.pause(0.05, 10.0)
        return time.monotonic() - t

    assert 0.04 < asyncio.run(go()) < 1.0


def test_pause_waits_the_idle_period_while_nothing_is_in_flight():
    async def go():
        activity = Activity(lambda: 0)
        t = time.monotonic()
        await activity.pause(0.01, 0.3)
        return time.monotonic() - t

    assert 0.25 < asyncio.run(go()) < 2.0


def test_the_pause_after_the_last_request_ends_is_still_the_busy_one():
    async def go():
        in_flight = [1]
        activity = Activity(lambda: in_flight[0])
        await activity.pause(0.01, 10.0)
        in_flight[0] = 0  # the last request ended: one more round at the busy period (its last figures)
        t = time.monotonic()
        await activity.pause(0.01, 10.0)
        after_last = time.monotonic() - t
        t = time.monotonic()
        await activity.pause(0.01, 0.3)  # then idle
        return after_last, time.monotonic() - t

    after_last, idle = asyncio.run(go())
    assert after_last < 0.25 and idle > 0.25


def test_a_request_starting_ends_an_idle_pause_at_its_first_token():
    async def go():
        in_flight = [0]
        activity = Activity(lambda: in_flight[0])
        waiting = asyncio.ensure_future(activity.pause(0.01, 30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        in_flight[0] = 1
        activity.started()
        await asyncio.sleep(0.2)  # its first step: the poll's round stays out of its way
        assert not waiting.done()
        activity.answered()
        t = time.monotonic()
        await asyncio.wait_for(waiting, 1.0)
        return time.monotonic() - t

    assert asyncio.run(go()) < 0.1


def test_a_first_token_that_does_not_come_holds_the_woken_poll_a_bounded_time(monkeypatch):
    monkeypatch.setattr(idle, "FIRST_TOKEN_WAIT_S", 0.2)

    async def go():
        in_flight = [0]
        activity = Activity(lambda: in_flight[0])
        activity.answered()  # a token of the busy period before: not this request's
        waiting = asyncio.ensure_future(activity.pause(0.01, 30.0))
        await asyncio.sleep(0.05)
        in_flight[0] = 1
        activity.started()
        t = time.monotonic()
        await asyncio.wait_for(waiting, 2.0)
        return time.monotonic() - t

    assert 0.15 < asyncio.run(go()) < 1.0


def test_loop_lag_samples_only_while_requests_are_in_flight():
    async def go():
        in_flight = [0]
        activity = Activity(lambda: in_flight[0])
        lags: list[float] = []
        task = asyncio.ensure_future(loop_lag.watch(lags.append, activity.until_busy))
        await asyncio.sleep(5 * loop_lag.TICK_S)
        idle = len(lags)
        in_flight[0] = 1
        activity.started()
        await asyncio.sleep(5 * loop_lag.TICK_S)
        busy = len(lags)
        in_flight[0] = 0  # the last request ended: the sampler stops after its current tick
        await asyncio.sleep(2 * loop_lag.TICK_S)
        after = len(lags)
        await asyncio.sleep(5 * loop_lag.TICK_S)
        task.cancel()
        return idle, busy, after, len(lags)

    idle, busy, after, end = asyncio.run(go())
    assert idle == 0
    assert busy >= 3
    assert end == after  # nothing sampled once idle again


# -- the stats poll of a RouterCore over a real Ray actor ------------------------------------------

@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


def counting_replica():
    """A colocated worker's `stats` as the poll calls it, counting the calls (defined in a function:
    Ray then ships the class by value, and the workers need not import this test module)."""

    class CountingReplica:
        def __init__(self, name: str):
            self.name, self.calls = name, 0

        def stats(self) -> ReplicaStats:
            self.calls += 1
            return ReplicaStats(self.name, "colocated", 0, 0, 1 << 20, 1 << 20, 0)

        def count(self) -> int:
            return self.calls

    return CountingReplica


def test_an_idle_router_polls_every_idle_period_and_at_once_when_a_request_starts(ray_session):
    replica = ray_session.remote(counting_replica()).options(num_cpus=0).remote("c0")

    async def go():
        core = RouterCore("r", "tiny-moe", 64, load_tokenizer("tiny-moe"),
                          [ReplicaChange("colocated", "c0", {"c0-w": replica})], "kv-aware")
        assert await replica.count.remote() == 0  # (its process is up: the rounds below are the poll's)
        poll = asyncio.ensure_future(core.refresh_stats(interval_s=0.05, idle_s=1.5))
        await asyncio.sleep(1.0)  # idle: the first round only (busy, 0.05 s apart, it would be ~20)
        idle = await replica.count.remote()
        await asyncio.sleep(0.1)  # (the poll past its first round's answer, waiting)
        core.lifecycle.activity.started()  # a request's start (one too short to be in flight now)
        await asyncio.sleep(0.1)
        core.lifecycle.activity.answered()  # ... and its first token
        await asyncio.sleep(0.4)
        woken = await replica.count.remote()
        poll.cancel()
        return idle, woken, core.stats

    idle, woken, stats = asyncio.run(go())
    assert idle == 1
    assert woken == 2  # polled at once, then idle again
    assert "c0" in stats
