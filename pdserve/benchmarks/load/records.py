"""What `pdserve bench` measures: a record per request, statistics per rate, goodput. Pure, no I/O.

Per request, on the client's clock:
  TTFT  send -> the first chunk carrying output (text or the finish)
  ITL   the gaps between successive output chunks (vLLM's convention). pdserve streams a chunk
        per decode step, i.e. per token, while the router keeps up (a router behind its workers
        gets their steps joined: one chunk of several tokens); and a token that completes no
        character (part of a UTF-8 sequence, a special token) has no chunk of its own and rides in
        the next one, whose gap then spans several tokens (often so with the presets' random weights).
  TPOT  (e2e - TTFT) / (output tokens - 1), the output tokens counted by the usage that ends the
        stream (stream_options.include_usage): exact whatever the chunking
  e2e   send -> [DONE]
Per rate: request and output-token throughput, mean / p50 / p90 / p99 of each, and SLO attainment
= the fraction of the requests *sent* that succeeded with TTFT <= --slo-ttft-ms and TPOT <=
--slo-tpot-ms; good requests per second = those / the run's duration. Goodput of the sweep = the
highest rate whose attainment >= --slo-attainment.
"""

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    num_prompts: int | None = None  # per rate; or
    duration_s: float | None = None  # per rate: rate × duration requests
    seed: int = 0
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    warmup: int = 4  # requests of this shape, all at once, before the first rate; not counted
    clients: int = 1  # client processes a rate's requests are dealt over (clients.py)
    kind: str = "random"  # workloads.py: random | shared-prefix | multi-turn
    prefix_len: int = 0  # shared-prefix: each shared prefix's tokens; multi-turn: the system prompt's
    prefixes: int = 4  # shared-prefix: how many shared prefixes
    turns: int = 4  # multi-turn: turns per session
    think_s: float = 0.0  # multi-turn: from a turn's end to the next turn

    def num_requests(self, rate: float) -> int:
        if self.num_prompts is not None:
            return self.num_prompts
        return max(1, round(rate * self.duration_s))


@dataclass(frozen=True)
class Slo:
    ttft_ms: float = 2000.0
    tpot_ms: float = 50.0
    attainment: float = 0.9  # the share of requests that must meet both for a rate to count

    def met(self, r: "RequestRecord") -> bool:
        # One output token has no TPOT: only its TTFT can miss.
        return r.ok and r.ttft_ms <= self.ttft_ms and (r.tpot_ms is None or r.tpot_ms <= self.tpot_ms)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    start_s: float | None = None  # when it was sent, from the start of its rate's run
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0  # from the stream's usage
    chunks: int = 0  # stream chunks that carried output
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_ms is not None

    @property
    def finished(self) -> bool:
        return self.error is not None or self.e2e_ms is not None

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_json(self, itl: bool = True) -> dict[str, Any]:
        # Without `itl`: the gaps are the one field that grows with the output (a float per token),
        # and the SLO grid (grid.py) needs only TTFT, e2e and the token count.
        d = {**asdict(self), "tpot_ms": self.tpot_ms, "ok": self.ok}
        if not itl:
            del d["itl_ms"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "RequestRecord":
        """A record as to_json wrote it (the derived tpot_ms and ok are computed again)."""
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class Stats:
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> "Stats":
        if not values:
            return cls(None, None, None, None)
        xs = sorted(values)
        return cls(_round(sum(xs) / len(xs)), *(_round(percentile(xs, p)) for p in (50, 90, 99)))


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    k = (len(sorted_values) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


@dataclass(frozen=True)
class RateSummary:
    rate: float
    sent: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    e2e_ms: Stats
    slo_attainment: float  # of the requests sent
    good_rps: float  # requests meeting the SLO / s
    errors: dict[str, int]  # error text -> how many requests failed with it

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "rate": rate_json(self.rate)}


def summarize(rate: float, records: list[RequestRecord], duration_s: float, slo: Slo) -> RateSummary:
    ok = [r for r in records if r.ok]
    good = sum(slo.met(r) for r in records)
    return RateSummary(
        rate=rate, sent=len(records), completed=len(ok), failed=len(records) - len(ok),
        duration_s=_round(duration_s), request_throughput=_round(len(ok) / duration_s),
        output_throughput=_round(sum(r.output_tokens for r in ok) / duration_s),
        ttft_ms=Stats.of([r.ttft_ms for r in ok]),
        tpot_ms=Stats.of([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        itl_ms=Stats.of([gap for r in ok for gap in r.itl_ms]),
        e2e_ms=Stats.of([r.e2e_ms for r in ok]),
        slo_attainment=_round(good / len(records)) if records else 0.0,
        good_rps=_round(good / duration_s),
        errors=dict(Counter(r.error or "unfinished" for r in records if not r.ok).most_common()))


def goodput(summaries: list[RateSummary], slo: Slo) -> float | None:
    """The highest rate whose attainment reaches the SLO's; None when none does."""
    passing = [s.rate for s in summaries if s.slo_attainment >= slo.attainment]
    return max(passing, default=None)


def rate_json(rate: float | None) -> float | str | None:
    """JSON has no infinity: an unbounded rate is written "inf"."""
    return "inf" if rate is not None and math.isinf(rate) else rate


def rate_from_json(x: float | str) -> float:
    return math.inf if x == "inf" else float(x)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _round(x: float) -> float:
    return round(x, 3)
