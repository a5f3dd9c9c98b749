"""The router's admission queue (router/admission_queue.py) and TTFT forecast (router/forecast.py) on their
own: the order waiters are served in, the bounds, and the forecast's arithmetic against sums done by
hand. The cluster tests (test_overload.py, test_router_queue.py) run both for real."""

import asyncio

import pytest

from pdserve.messages import ReplicaStats
from pdserve.protocol import SamplingParams
from pdserve.router.admission_queue import AdmissionQueue
from pdserve.router.forecast import SlotHolder, TTFTForecast
from pdserve.messages import Request
from pdserve.router.types import OverloadedError


def request(name: str, priority: int = 0, max_tokens: int = 100, ignore_eos: bool = True) -> Request:
    return Request(name, [1] * 10, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), priority=priority)


def test_waiters_are_woken_by_priority_then_arrival_and_a_full_queue_displaces_the_lowest():
    async def scenario():
        q = AdmissionQueue(limit=3, wait_s=30)
        low1, low2, mid = q.join(request("low1", 5)), q.join(request("low2", 5)), q.join(request("mid", 1))
        assert [w.request.request_id for w in q.waiters] == ["mid", "low1", "low2"]
        assert [w.request.request_id for w in q.ahead(1)] == ["mid"] and len(q.ahead(5)) == 3
        sleeping = {w.request.request_id: asyncio.ensure_future(q.wait(w)) for w in (low1, low2, mid)}
        await asyncio.sleep(0)
        with pytest.raises(OverloadedError) as full:  # one more of the lowest priority: refused at once
            q.join(request("low3", 5))
        assert full.value.reason == "queue_full" and len(q) == 3
        high = q.join(request("high", -1))  # outranks the last: low2 gets the 429
        with pytest.raises(OverloadedError) as displaced:
            await sleeping.pop("low2")
        assert displaced.value.reason == "displaced"
        assert [w.request.request_id for w in q.waiters] == ["high", "mid", "low1"]
        sleeping["high"] = asyncio.ensure_future(q.wait(high))
        await asyncio.sleep(0)
        q.wake(2)  # the first two sleeping, in order
        await asyncio.sleep(0)
        assert {n for n, t in sleeping.items() if t.done()} == {"high", "mid"}
        for w in (high, mid):
            q.leave(w)
        q.wake()
        await sleeping["low1"]
        q.leave(low1)
        q.leave(low1)  # (twice: nothing happens)
        assert len(q) == 0

    asyncio.run(scenario())


def test_a_waiter_is_refused_at_its_deadline():
    async def scenario():
        q = AdmissionQueue(limit=4, wait_s=0.05)
        w = q.join(request("r"))
        with pytest.raises(OverloadedError) as e:
            await q.wait(w)
        assert e.value.reason == "queue_timeout" and e.value.retry_after == 1

    asyncio.run(scenario())


def stats(name: str, role: str, running: int, slots: int, decode: dict | None = None, prefill: dict | None = None,
          waiting: int = 0, reserved: int = 0) -> ReplicaStats:
    profile = {"decode": decode or {}, "prefill": prefill or {}}
    return ReplicaStats(name, role, running, waiting, 100, 100, 0, profile=profile, max_num_seqs=slots,
                        reserved=reserved)


NEW = request("new").params  # the new request's: 100 tokens, ignoring EOS

# Decode steps of 10 ms whatever the batch (one bucket: all fixed cost); prefill steps of 1 ms per
# token (one bucket: all per token).
DECODE = {4: [10, 40, 0.1]}
PREFILL = {64: [1, 64, 0.064]}


def test_the_forecast_replays_the_slots_freeing_up():
    f = TTFTForecast(prefill_step_tokens=8192)
    decode, prefill = stats("d", "decode", 2, 2, DECODE), stats("p", "prefill", 0, 8, prefill=PREFILL)
    f.refit("d", decode)
    f.refit("p", prefill)
    pool = f.pool([decode], held_here=2)
    assert pool.slots == 2 and pool.others == 0 and pool.step_s == pytest.approx(0.01)
    assert f.prefill_s("p", 10) == pytest.approx(0.010)
    # Two holders: 100 and 300 tokens left (10 ms a token) -> slots free at 1 s and 3 s. One ahead in
    # line takes the first (its prefill 10 ms, 100 tokens: 1.01 s) -> it frees at 2.01 s, before 3 s.
    holders = [SlotHolder(request("a").params, 10, 0, True), SlotHolder(request("b", max_tokens=300).params, 10, 0, True)]
    line = [(request("c").params, 10)]
    assert f.slot_wait(pool, holders, line, "p", NEW) == pytest.approx(2.01)
    assert f.slot_wait(pool, holders, [], "p", NEW) == pytest.approx(1.0)
    assert f.slot_wait(pool, holders[:1], [], "p", NEW) == 0  # a slot is free
    # Another router holds a slot the stats count: taken to be like ours (the median of ours left: 1 s).
    assert f.slot_wait(f.pool([decode], held_here=1), holders[:1], [], "p", NEW) == pytest.approx(1.0)
    assert f.slot_wait(f.pool([stats("d", "decode", 3, 3, DECODE)], held_here=2), holders, line, "p", NEW) == \
        pytest.approx(2.01)
    # Only another router's requests hold the slots: taken to be half-way through one like the new one.
    assert f.slot_wait(f.pool([decode], held_here=0), [], [], "p", NEW) == pytest.approx(0.5)


def test_the_forecast_expects_what_a_request_will_generate():
    f = TTFTForecast(prefill_step_tokens=8192)
    stopping = request("r", max_tokens=500, ignore_eos=False).params
    assert f.expected_tokens(stopping) == 500  # nothing seen finish yet: all it may
    f.finished(40)
    assert f.expected_tokens(stopping) == 40  # the mean of those that finished
    assert f.expected_tokens(request("r", max_tokens=500).params) == 500  # ignoring EOS, it runs to max_tokens
    assert f.expected_tokens(request("r", max_tokens=20, ignore_eos=False).params) == 20
    # No decode step measured on a replica of the pool: no forecast.
    assert f.pool([stats("d", "decode", 0, 4)], held_here=0) is None
