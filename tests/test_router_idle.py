"""An idle router's periodic tasks (router/idle.py): the stats poll slows and the loop-lag sampler
stops while no request is in flight, and both wake as soon as one starts. On a real event loop
with real timers; test_serving.py checks a served cluster's sampler stays still at idle."""

import asyncio
import time

from pdserve.router import loop_lag
from pdserve.router.idle import Activity


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


def test_a_request_starting_ends_an_idle_pause_at_once():
    async def go():
        in_flight = [0]
        activity = Activity(lambda: in_flight[0])
        waiting = asyncio.ensure_future(activity.pause(0.01, 30.0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        in_flight[0] = 1
        activity.started()
        t = time.monotonic()
        await asyncio.wait_for(waiting, 1.0)
        return time.monotonic() - t

    assert asyncio.run(go()) < 0.5


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
