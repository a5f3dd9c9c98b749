"""Streamed tokens counted per turn of the router's loop (router/token_tally.py): the series get what
observing each token at once gave them, and a reader never sees them late."""

import asyncio
import math
import random

from prometheus_client import CollectorRegistry, generate_latest

from pdserve.router.loop_metrics import LoopCounter, LoopHistogram
from pdserve.router.metrics import _ITL_BUCKETS, Metrics
from pdserve.router.token_tally import TokenTally


def _series(registry: CollectorRegistry):
    tokens = LoopCounter("tokens", "t", ["model_name"], registry=registry).labels("m")
    gaps = (LoopHistogram("itl_seconds", "i", buckets=_ITL_BUCKETS, registry=registry),
            LoopHistogram("vllm_itl_seconds", "v", ["model_name"], buckets=(0.01, 0.1), registry=registry).labels("m"))
    return tokens, gaps


def _text(registry: CollectorRegistry) -> bytes:
    text = generate_latest(registry)
    return b"\n".join(line.rsplit(b" ", 1)[0] if b"_created" in line else line for line in text.split(b"\n"))


def test_a_tally_gives_the_series_what_each_token_gave_them():
    rng = random.Random(1)
    wakes = [(rng.randint(1, 4), None if i % 7 == 0 else rng.choice([0.0, 0.01, 2.5, 1e9, rng.expovariate(100)]))
             for i in range(3_000)]
    at_once, tallied = CollectorRegistry(), CollectorRegistry()
    tally = TokenTally()
    tallied.register(tally)
    tally.feed(*_series(tallied))
    tokens, gaps = _series(at_once)
    for i, (n, gap) in enumerate(wakes):
        tokens.inc(n)
        for h in gaps:
            if gap is not None:
                h.observe(gap)
        tally.add(n, gap)
        if i % 500 == 0:  # (outside a loop it adds at once; flushed here as a loop's turn would)
            tally.flush()
    assert _text(tallied) == _text(at_once)


def test_observe_all_is_observe_in_order_nan_too():
    values = [0.001, 0.0025, float("nan"), 3.0, 1e-9, 0.3]
    one, many = CollectorRegistry(), CollectorRegistry()
    a = LoopHistogram("h", "h", buckets=_ITL_BUCKETS, registry=one)
    b = LoopHistogram("h", "h", buckets=_ITL_BUCKETS, registry=many)
    for v in values:
        a.observe(v)
    b.observe_all(values)
    b.observe_all([])
    assert _text(one) == _text(many)


def test_inside_the_loop_a_reader_sees_the_tokens_before_the_turn_ends():
    metrics = Metrics("router", "m")

    async def stream() -> tuple:
        timer = metrics.request_started("completions", 4)
        for _ in range(3):
            timer.tokens(2)
        # Still in this turn: the end-of-turn flush has not run, and a collection flushes first.
        seen = (metrics.registry.get_sample_value("pdserve_inter_token_latency_seconds_count"),
                metrics.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "m"}),
                metrics.traffic()["itl_count"])
        timer.tokens(1)
        await asyncio.sleep(0)  # the turn ends: flushed without a reader
        return seen

    assert asyncio.run(stream()) == (2, 6, 2)
    assert metrics.registry.get_sample_value("vllm:generation_tokens_total", {"model_name": "m"}) == 7
    assert metrics.streamed._tokens == 0 and not metrics.streamed._gaps  # (nothing held once flushed)
    assert math.isfinite(metrics.registry.get_sample_value("pdserve_inter_token_latency_seconds_sum"))
