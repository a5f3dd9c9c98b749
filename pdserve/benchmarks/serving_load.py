"""`pdserve bench`: Poisson load against a running pdserve's OpenAI HTTP API (DESIGN §7).

    pdserve up &
    pdserve bench --rate 1 2 4 inf --num-prompts 200 --input-len 1024 --output-len 128 --json out.json
    python -m pdserve.benchmarks.serving_load ...          (the same command)

Workload: prompts of --input-len random token ids (seeded; ids in [3, 256): bytes for the
byte-level tokenizer of the presets, ordinary tokens of any HF vocabulary), each asking for exactly
--output-len tokens (max_tokens with ignore_eos), greedy, streamed from /v1/completions (SSE).
Arrivals are Poisson at each --rate in turn (inf: all at once), --num-prompts requests per rate or
rate × --duration; one seeded generator serves the whole sweep, so no two prompts repeat (the
prefix cache cannot help a later rate). --warmup requests go first, uncounted. A refused request
(503: no capacity) is not retried: it counts as failed, as it would for a user.

Per request, on the client's clock:
  TTFT  send -> the first chunk carrying output (text or the finish)
  ITL   the gaps between successive output chunks (vLLM's convention). pdserve streams a chunk
        per decode step, i.e. per token, but a token that completes no character (part of a UTF-8
        sequence, a special token) has no chunk of its own and rides in the next one, whose gap
        then spans several tokens (often so with the random weights of the presets).
  TPOT  (e2e - TTFT) / (output tokens - 1), the output tokens counted by the usage that ends the
        stream (stream_options.include_usage): exact whatever the chunking
  e2e   send -> [DONE]
Per rate: request and output-token throughput, mean / p50 / p90 / p99 of each, and SLO attainment
= the fraction of the requests *sent* that succeeded with TTFT <= --slo-ttft-ms and TPOT <=
--slo-tpot-ms; good requests per second = those / the run's duration. Goodput of the sweep = the
highest rate whose attainment >= --slo-attainment.

Imports no torch: it runs on any client machine with httpx.
"""

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

PROMPT_IDS = (3, 256)  # [low, high): below every vocabulary, clear of the usual specials 0..2
PROGRESS_EVERY_S = 5.0
_HINT_UP = "is `pdserve up` running there? (`pdserve status` prints its endpoints)"


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, not ready, bad model): says what to do."""


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- what is measured -------------------------------------------------------------------------------


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

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "tpot_ms": self.tpot_ms, "ok": self.ok}


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


def poisson_gaps(rate: float, n: int, rng: random.Random) -> list[float]:
    """Seconds before each of n arrivals: exponential with mean 1/rate; all 0 at an infinite rate."""
    if math.isinf(rate):
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(*PROMPT_IDS) for _ in range(length)]


def rate_json(rate: float | None) -> float | str | None:
    """JSON has no infinity: an unbounded rate is written "inf"."""
    return "inf" if rate is not None and math.isinf(rate) else rate


def _round(x: float) -> float:
    return round(x, 3)


# -- one request ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    url: str
    model: str
    max_model_len: int | None


def request_body(server: Server, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {"model": server.model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def stream_request(client: httpx.AsyncClient, server: Server, body: dict, rec: RequestRecord,
                         t0: float) -> None:
    """Send one streaming completion and fill `rec` with its timings, or with why it failed."""
    start = time.perf_counter()
    rec.start_s = start - t0
    try:
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {_error_text((await resp.aread()).decode(errors='replace'))}"
                return
            await _read_events(resp, rec, start)
    except httpx.HTTPError as e:
        rec.error = f"{type(e).__name__}: {e}".rstrip(": ")
    except json.JSONDecodeError as e:
        rec.error = f"a stream event is not JSON: {e}"


async def _read_events(resp: httpx.Response, rec: RequestRecord, start: float) -> None:
    last = None
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        now = time.perf_counter()  # before parsing: the arrival is what is timed
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            rec.e2e_ms = _ms(now - start)
            break
        event = json.loads(data)
        if "error" in event:  # the server failed it after the 200 was sent
            rec.error = f"error in the stream: {_error_text(data)}"
            return
        if event.get("choices"):
            if last is None:
                rec.ttft_ms = _ms(now - start)
            else:
                rec.itl_ms.append(_ms(now - last))
            last = now
            rec.chunks += 1
        if event.get("usage"):
            rec.output_tokens = event["usage"]["completion_tokens"]
    if rec.e2e_ms is None:
        rec.error = "the stream ended before [DONE]"
    elif rec.ttft_ms is None:
        rec.error = "the stream carried no output"
    elif not rec.output_tokens:
        rec.error = "the stream carried no usage (stream_options.include_usage)"


def _error_text(body: str) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), else the body (cut short)."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


# -- one rate, a sweep ------------------------------------------------------------------------------


@dataclass
class RateRun:
    summary: RateSummary
    records: list[RequestRecord]


async def run_rate(client: httpx.AsyncClient, server: Server, rate: float, workload: Workload,
                   rng: random.Random, slo: Slo, log: Callable[[str], None] = log) -> RateRun:
    n = workload.num_requests(rate)
    prompts = [random_prompt(rng, workload.input_len) for _ in range(n)]
    gaps = poisson_gaps(rate, n, rng)
    records = [RequestRecord(i, workload.input_len) for i in range(n)]
    limit = asyncio.Semaphore(workload.max_concurrency) if workload.max_concurrency else None
    label = rate_label(rate)
    log(f"rate {label} req/s: {n} requests")
    t0 = time.perf_counter()
    progress = asyncio.create_task(_report_progress(label, records, t0, log))

    async def send(rec: RequestRecord, prompt: list[int]) -> None:
        async with limit or contextlib.nullcontext():  # waiting for a slot is not part of the latency
            await stream_request(client, server, request_body(server, prompt, workload.output_len), rec, t0)

    tasks, due = [], 0.0
    try:
        for rec, prompt, gap in zip(records, prompts, gaps):
            due += gap
            await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
            tasks.append(asyncio.create_task(send(rec, prompt)))
        await asyncio.gather(*tasks)
    finally:
        progress.cancel()
        for t in tasks:
            t.cancel()
    summary = summarize(rate, records, time.perf_counter() - t0, slo)
    log(f"rate {label} req/s: {summary.completed}/{summary.sent} completed in {summary.duration_s:.1f} s, "
        f"SLO attainment {100 * summary.slo_attainment:.1f} %")
    if summary.errors:
        text, count = next(iter(summary.errors.items()))
        log(f"rate {label} req/s: {summary.failed} failed, e.g. ({count}x) {text}")
    return RateRun(summary, records)


async def _report_progress(label: str, records: list[RequestRecord], t0: float, log: Callable[[str], None]) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        sent = sum(r.start_s is not None for r in records)
        done = sum(r.ok for r in records)
        failed = sum(r.finished and not r.ok for r in records)
        log(f"rate {label} req/s: {time.perf_counter() - t0:.0f} s, sent {sent}/{len(records)}, "
            f"done {done}, failed {failed}")


@dataclass
class Sweep:
    server: Server
    workload: Workload
    slo: Slo
    runs: list[RateRun] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        return goodput([r.summary for r in self.runs], self.slo)

    def to_json(self, save_requests: bool) -> dict[str, Any]:
        runs = []
        for r in self.runs:
            runs.append(r.summary.to_json())
            if save_requests:
                runs[-1]["requests"] = [rec.to_json() for rec in r.records]
        return {"url": self.server.url, "model": self.server.model, "max_model_len": self.server.max_model_len,
                "workload": asdict(self.workload), "slo": asdict(self.slo), "runs": runs,
                "goodput": rate_json(self.goodput)}


async def connect(client: httpx.AsyncClient, url: str, model: str | None) -> Server:
    """Check that pdserve serves at `url` and is ready; the model to ask for (default: its first)."""
    try:
        health = await client.get(f"{url}/health", timeout=10)
        models = (await client.get(f"{url}/v1/models", timeout=10)).json()["data"]
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach {url} ({type(e).__name__}: {e}) — {_HINT_UP}") from None
    except (ValueError, KeyError, TypeError):
        raise BenchError(f"{url}/v1/models did not answer as an OpenAI API does — {_HINT_UP}") from None
    if health.status_code != 200:
        raise BenchError(f"{url} is up but not ready (/health: HTTP {health.status_code}, "
                         f"{_error_text(health.text)}): wait until `pdserve up` prints 'ready'")
    served = {m["id"]: m for m in models}
    if model is None:
        model = models[0]["id"]
    elif model not in served:
        raise BenchError(f"--model {model!r} is not served at {url}; it serves {', '.join(served)} "
                         f"(leave out --model to use the first)")
    return Server(url, model, served[model].get("max_model_len"))


async def warm_up(client: httpx.AsyncClient, server: Server, workload: Workload,
                  log: Callable[[str], None]) -> None:
    """The first requests of a fresh cluster pay one-time costs (kernel compilation, first
    allocations, connections): they would be counted against the first rate. Sent at once, so that
    the router spreads them over the replicas. Its own prompts: the sweep's are not cached by it."""
    rng = random.Random(f"warm-up {workload.seed}")
    records = [RequestRecord(i, workload.input_len) for i in range(workload.warmup)]
    t0 = time.perf_counter()
    await asyncio.gather(*(stream_request(client, server, request_body(
        server, random_prompt(rng, workload.input_len), workload.output_len), r, t0) for r in records))
    if failed := [r for r in records if not r.ok]:
        raise BenchError(f"{len(failed)} of {len(records)} warm-up requests failed ({failed[0].error}); "
                         f"the workload does not run here (--warmup 0 skips the warm-up)")
    log(f"warm-up: {len(records)} requests in {time.perf_counter() - t0:.1f} s")


def check_fits(server: Server, workload: Workload) -> None:
    total = workload.input_len + workload.output_len
    if server.max_model_len is not None and total > server.max_model_len:
        raise BenchError(f"--input-len + --output-len = {total} tokens exceed the context of {server.model} "
                         f"({server.max_model_len} tokens): lower them")


async def run_sweep(url: str, rates: list[float], workload: Workload, slo: Slo, model: str | None = None,
                    stop_below: float | None = None, log: Callable[[str], None] = log,
                    on_run: Callable[[Sweep], None] | None = None) -> Sweep:
    """One run per rate, in order; `on_run` sees the sweep after each (to save what is measured so far).
    With `stop_below`, a rate whose attainment falls under it ends the sweep: higher rates only do worse."""
    rng = random.Random(workload.seed)
    timeout = httpx.Timeout(workload.request_timeout_s, connect=30)
    # No pool limit: a request queued in the client's pool would count the wait as server latency.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        server = await connect(client, url.rstrip("/"), model)
        check_fits(server, workload)
        if workload.warmup:
            await warm_up(client, server, workload, log)
        sweep = Sweep(server, workload, slo)
        for i, rate in enumerate(rates):
            sweep.runs.append(await run_rate(client, server, rate, workload, rng, slo, log))
            if on_run:
                on_run(sweep)
            attained = sweep.runs[-1].summary.slo_attainment
            if stop_below is not None and attained < stop_below and i < len(rates) - 1:
                log(f"attainment {100 * attained:.1f} % < --stop-below {100 * stop_below:.0f} %: "
                    f"the higher rates are skipped")
                break
    return sweep


# -- the command ------------------------------------------------------------------------------------


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (requests/s, or inf)") from None
    if not rate > 0:  # also NaN
        raise argparse.ArgumentTypeError(f"{text!r}: a rate must be > 0 (or inf)")
    return rate


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The workload and SLO options, shared with pd_goodput."""
    p.add_argument("--rate", "--rates", dest="rates", type=_rate, nargs="+", default=[1.0], metavar="RATE",
                   help="requests/s, Poisson arrivals; several: a sweep, in order; inf: all at once (default: 1)")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--num-prompts", type=int, help="requests per rate (default: 100)")
    n.add_argument("--duration", type=float, help="seconds of arrivals per rate: rate × duration requests")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, exactly (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=4,
                   help="requests sent at once before the first rate, not counted (default: %(default)s)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="default: %(default)s")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="default: %(default)s")
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs for a rate to count (default: %(default)s)")
    p.add_argument("--stop-below", type=float, metavar="ATTAINMENT",
                   help="end the sweep after a rate whose attainment is under this (e.g. 0.5)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--save-requests", action="store_true", help="also write each request's record to the JSON")


def check_load_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.num_prompts is None and a.duration is None:
        a.num_prompts = 100
    if a.duration is not None and any(math.isinf(r) for r in a.rates):
        p.error("--rate inf sends everything at once: give --num-prompts, not --duration")
    for name in ("num_prompts", "duration", "input_len", "output_len", "max_concurrency", "request_timeout"):
        value = getattr(a, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if not 0 < a.slo_attainment <= 1:
        p.error(f"--slo-attainment must be in (0, 1], got {a.slo_attainment}")


def workload_of(a: argparse.Namespace) -> Workload:
    return Workload(a.input_len, a.output_len, a.num_prompts, a.duration, a.seed, a.max_concurrency,
                    a.request_timeout, a.warmup)


def slo_of(a: argparse.Namespace) -> Slo:
    return Slo(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_attainment)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the pdserve HTTP endpoint (default: %(default)s)")
    p.add_argument("--model", help="default: the first model /v1/models lists")
    add_load_args(p)
    return p


def args_json(a: argparse.Namespace) -> dict[str, Any]:
    return {k: [rate_json(r) for r in v] if k == "rates" else v for k, v in vars(a).items()}


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    check_load_args(p, a)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "args": args_json(a)}

    def save(sweep: Sweep) -> None:
        write_json(a.json, {"meta": meta, **sweep.to_json(a.save_requests)})

    try:
        sweep = asyncio.run(run_sweep(a.url, a.rates, workload_of(a), slo_of(a), a.model, a.stop_below,
                                      on_run=save))
    except BenchError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    print_table(sweep)
    if a.json:
        log(f"wrote {a.json}")
    # Nothing completed at all is a broken setup rather than a measurement.
    return 0 if any(r.summary.completed for r in sweep.runs) else 1


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_table(sweep: Sweep) -> None:
    w, slo = sweep.workload, sweep.slo
    print(f"\n{sweep.server.model} at {sweep.server.url}: prompts {w.input_len} tokens, output {w.output_len}; "
          f"SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms")
    print(f"{'rate':>6} {'ok/sent':>9} {'dur s':>7} {'req/s':>7} {'tok/s':>8} | "
          f"{'TTFT ms p50':>11} {'p90':>8} {'p99':>8} | {'TPOT ms p50':>11} {'p90':>7} {'p99':>7} | "
          f"{'ITL p90':>7} {'e2e p90':>8} | {'SLO %':>6} {'good/s':>7}")
    for run in sweep.runs:
        s = run.summary
        ttft, tpot = s.ttft_ms, s.tpot_ms
        print(f"{rate_label(s.rate):>6} {f'{s.completed}/{s.sent}':>9} {s.duration_s:>7.1f} "
              f"{s.request_throughput:>7.2f} {s.output_throughput:>8.1f} | {fmt(ttft.p50):>11} {fmt(ttft.p90):>8} "
              f"{fmt(ttft.p99):>8} | {fmt(tpot.p50, 2):>11} {fmt(tpot.p90, 2):>7} {fmt(tpot.p99, 2):>7} | "
              f"{fmt(s.itl_ms.p90, 2):>7} {fmt(s.e2e_ms.p90, 0):>8} | {100 * s.slo_attainment:>6.1f} {s.good_rps:>7.2f}")
    g = sweep.goodput
    print(f"goodput: {rate_label(g) + ' req/s' if g is not None else 'none of these rates'} "
          f"(the highest rate with >= {100 * slo.attainment:g} % of requests meeting both SLOs)")


if __name__ == "__main__":
    sys.exit(main())
