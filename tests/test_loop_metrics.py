"""The router's lock-free metrics (router/loop_metrics.py) against prometheus_client's own: the same
observations give the same /metrics text, byte for byte, and the same errors."""

import random

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdserve.router.loop_metrics import LoopCounter, LoopHistogram
from pdserve.router.metrics import _PHASE_BUCKETS, _TOKEN_BUCKETS


def exposition(histogram, counter, amounts: list[float]) -> bytes:
    registry = CollectorRegistry()
    plain = histogram("plain_seconds", "Unlabelled", buckets=_PHASE_BUCKETS, registry=registry)
    tokens = histogram("tokens", "Integer bounds", buckets=_TOKEN_BUCKETS, registry=registry)
    phases = histogram("phase_seconds", "Labelled", ["phase"], buckets=_PHASE_BUCKETS, registry=registry)
    requests = counter("requests", "Labelled counter", ["endpoint", "status"], registry=registry)
    total = counter("total", "Unlabelled counter", registry=registry)
    for i, x in enumerate(amounts):
        plain.observe(x)
        tokens.observe(round(x * 1000))
        phases.labels(("reserve", "dispatch", "first_token")[i % 3]).observe(x)
        requests.labels(endpoint="/v1/completions", status=str(200 + 100 * (i % 4))).inc()
        total.inc(x)
    text = generate_latest(registry)
    # The series' creation times differ between the two runs: blanked.
    return b"\n".join(line.rsplit(b" ", 1)[0] if b"_created" in line else line for line in text.split(b"\n"))


def test_the_same_observations_give_the_same_exposition():
    rng = random.Random(0)
    amounts = [rng.choice([0.0, 1e-5, 0.00025, 0.0005, 60.0, 61.0, 1e9]) if i % 5 == 0 else rng.expovariate(50)
               for i in range(5_000)]  # bucket bounds exactly, beyond the last, and between
    assert exposition(LoopHistogram, LoopCounter, amounts) == exposition(Histogram, Counter, amounts)


def test_the_same_errors():
    registry = CollectorRegistry()
    for cls in (Counter, LoopCounter):
        counter = cls(f"c_{cls.__name__}", "c", ["a"], registry=registry)
        with pytest.raises(ValueError):  # a labelled parent is not counted
            counter.inc()
        with pytest.raises(ValueError):  # counters only grow
            counter.labels("x").inc(-1)
    for cls in (Histogram, LoopHistogram):
        with pytest.raises(ValueError):
            cls(f"h_{cls.__name__}", "h", ["a"], registry=registry).observe(1.0)


def test_nan_falls_in_no_bucket_as_before():
    texts = []
    for cls in (Histogram, LoopHistogram):
        registry = CollectorRegistry()
        cls("h", "h", buckets=(1.0, 2.0), registry=registry).observe(float("nan"))
        texts.append(b"\n".join(line for line in generate_latest(registry).split(b"\n") if b"_created" not in line))
    assert texts[0] == texts[1]
