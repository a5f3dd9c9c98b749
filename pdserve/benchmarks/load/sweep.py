"""`pdserve bench`'s arrivals: the prompts, a warm-up, one run of Poisson arrivals per rate, the sweep."""

import asyncio
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import httpx

from pdserve.benchmarks.load.client import BenchError, Server, connect, request_body, stream_request, stream_session
from pdserve.benchmarks.load.clients import Clients, send_all
from pdserve.benchmarks.load.records import (RateSummary, RequestRecord, Slo, Workload, goodput, rate_json,
                                             rate_label, summarize)
from pdserve.benchmarks.load import workloads
from pdserve.benchmarks.load.server_metrics import means_ms, router_cpu_s, scrape
from pdserve.benchmarks.load.workloads import poisson_gaps, random_prompt  # noqa: F401 (their old home)

PROGRESS_EVERY_S = 5.0
CLIENT_BUSY = 0.85  # of one core: above it, a run's figures may be the client's own limit (said in the log)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- one rate ---------------------------------------------------------------------------------------


@dataclass
class RateRun:
    summary: RateSummary
    records: list[RequestRecord]
    server_ms: dict[str, float] = field(default_factory=dict)  # mean of each phase, as the router timed it
    # This client's own CPU over the run, as a share of one core: the client is one Python process
    # on one event loop, and near a whole core its figures (throughput, and the times it stamps on
    # arrivals) are its own limits, not the server's.
    client_cpu: float = 0.0
    # The routers' CPU seconds over the run (their process_cpu_seconds_total between the two scrapes).
    router_cpu_s: float | None = None


async def run_rate(client: httpx.AsyncClient, session: aiohttp.ClientSession, server: Server, rate: float,
                   workload: Workload, rng: random.Random, slo: Slo, log: Callable[[str], None] = log) -> RateRun:
    """One rate's run: its requests through `session` (one process) or client processes of their own,
    the routers' metrics before and after through `client`."""
    n = workload.num_requests(rate)
    w = workload
    plan = workloads.plan(w.kind, n, rate, rng, w.input_len, w.output_len, w.prefix_len, w.prefixes, w.turns,
                          w.think_s, run=rate_label(rate))
    records = [RequestRecord(i, len(p)) for i, p in enumerate(plan.prompts)]
    label = rate_label(rate)
    log(f"rate {label} req/s: {n} requests" + (f" from {workload.clients} client processes" if workload.clients > 1 else ""))
    before = await scrape(client, server.metrics_urls)
    if workload.clients > 1:
        pool = Clients(workload.clients)
        progress = asyncio.create_task(_report_progress(label, len(records), pool.progress, time.perf_counter(), log))
        try:
            t0, cpu = await pool.run(server, records, plan, workload.max_concurrency, workload.output_len,
                                     workload.request_timeout_s)
        finally:
            progress.cancel()
        wall = time.perf_counter() - t0
        client_cpu = max(cpu) / wall  # the busiest process: the one whose limit would show
    else:
        t0, cpu0 = time.perf_counter(), time.process_time()
        progress = asyncio.create_task(_report_progress(label, len(records), lambda: _counts(records), t0, log))
        try:
            await send_all(session, server, records, plan, workload.max_concurrency, workload.output_len, t0)
        finally:
            progress.cancel()
        wall = time.perf_counter() - t0
        client_cpu = (time.process_time() - cpu0) / wall
    summary = summarize(rate, records, wall, slo)
    log(f"rate {label} req/s: {summary.completed}/{summary.sent} completed in {summary.duration_s:.1f} s, "
        f"SLO attainment {100 * summary.slo_attainment:.1f} %")
    if summary.errors:
        text, count = next(iter(summary.errors.items()))
        log(f"rate {label} req/s: {summary.failed} failed, e.g. ({count}x) {text}")
    if client_cpu >= CLIENT_BUSY:
        log(f"rate {label} req/s: a client process used {100 * client_cpu:.0f} % of a core: the figures may be "
            f"the client's own limit, not the server's; --clients N spreads the requests over N processes")
    after = await scrape(client, server.metrics_urls)
    server_ms = means_ms(before, after)
    if server_ms:
        log(f"rate {label} req/s: the router's means (ms): "
            + ", ".join(f"{k} {v:g}" for k, v in server_ms.items()))
    cpu_s = router_cpu_s(before, after)
    if cpu_s:
        tokens = sum(r.output_tokens for r in records if r.ok)
        log(f"rate {label} req/s: the routers' CPU {cpu_s:.2f} s over the run: {tokens / cpu_s:,.0f} streamed "
            f"tokens per router CPU-second")
    return RateRun(summary, records, server_ms, round(client_cpu, 3), cpu_s)


def _counts(records: list[RequestRecord]) -> tuple[int, int, int]:
    return (sum(r.start_s is not None for r in records), sum(r.ok for r in records),
            sum(r.finished and not r.ok for r in records))


async def _report_progress(label: str, n: int, counts: Callable[[], tuple[int, int, int]], t0: float,
                           log: Callable[[str], None]) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        sent, done, failed = counts()
        log(f"rate {label} req/s: {time.perf_counter() - t0:.0f} s, sent {sent}/{n}, done {done}, failed {failed}")


# -- the sweep --------------------------------------------------------------------------------------


@dataclass
class Sweep:
    server: Server
    workload: Workload
    slo: Slo
    runs: list[RateRun] = field(default_factory=list)

    @property
    def goodput(self) -> float | None:
        return goodput([r.summary for r in self.runs], self.slo)

    def to_json(self, save_requests: bool, itl: bool = True) -> dict[str, Any]:
        runs = []
        for r in self.runs:
            runs.append(r.summary.to_json())
            runs[-1]["server_ms"] = r.server_ms
            runs[-1]["client_cpu"] = r.client_cpu
            runs[-1]["router_cpu_s"] = r.router_cpu_s
            if save_requests:
                runs[-1]["requests"] = [rec.to_json(itl) for rec in r.records]
        return {"url": self.server.url, "model": self.server.model, "max_model_len": self.server.max_model_len,
                "workload": asdict(self.workload), "slo": asdict(self.slo), "runs": runs,
                "goodput": rate_json(self.goodput)}


async def warm_up(session: aiohttp.ClientSession, server: Server, workload: Workload,
                  log: Callable[[str], None]) -> None:
    """The first requests of a fresh cluster pay one-time costs (kernel compilation, first
    allocations, connections): they would be counted against the first rate. Sent at once, so that
    the router spreads them over the replicas. Its own prompts: the sweep's are not cached by it."""
    rng = random.Random(f"warm-up {workload.seed}")
    records = [RequestRecord(i, workload.input_len) for i in range(workload.warmup)]
    t0 = time.perf_counter()
    await asyncio.gather(*(stream_request(session, server, request_body(
        server, random_prompt(rng, workload.input_len), workload.output_len), r, t0) for r in records))
    if failed := [r for r in records if not r.ok]:
        raise BenchError(f"{len(failed)} of {len(records)} warm-up requests failed ({failed[0].error}); "
                         f"the workload does not run here (--warmup 0 skips the warm-up)")
    log(f"warm-up: {len(records)} requests in {time.perf_counter() - t0:.1f} s")


def check_fits(server: Server, workload: Workload) -> None:
    w = workload
    total = workloads.longest_prompt(w.kind, w.input_len, w.output_len, w.prefix_len, w.turns) + w.output_len
    if server.max_model_len is not None and total > server.max_model_len:
        what = ("--input-len + --output-len" if w.kind == "random" else
                f"the longest {w.kind} prompt (--prefix-len, --input-len{', --turns' if w.kind == 'multi-turn' else ''})"
                f" + --output-len")
        raise BenchError(f"{what} = {total} tokens exceed the context of {server.model} "
                         f"({server.max_model_len} tokens): lower them")


async def run_sweep(url: str, rates: list[float], workload: Workload, slo: Slo, model: str | None = None,
                    stop_below: float | None = None, log: Callable[[str], None] = log,
                    on_run: Callable[[Sweep], None] | None = None, metrics_urls: list[str] | None = None) -> Sweep:
    """One run per rate, in order; `on_run` sees the sweep after each (to save what is measured so far).
    With `stop_below`, a rate whose attainment falls under it ends the sweep: higher rates only do worse."""
    # One generator for the whole sweep: no prompt repeats, so the prefix cache cannot help a later rate.
    rng = random.Random(workload.seed)
    async with (httpx.AsyncClient(timeout=httpx.Timeout(30)) as client,
                stream_session(workload.request_timeout_s) as session):
        server = await connect(client, url.rstrip("/"), model, metrics_urls)
        check_fits(server, workload)
        if workload.warmup:
            await warm_up(session, server, workload, log)
        sweep = Sweep(server, workload, slo)
        for i, rate in enumerate(rates):
            sweep.runs.append(await run_rate(client, session, server, rate, workload, rng, slo, log))
            if on_run:
                on_run(sweep)
            attained = sweep.runs[-1].summary.slo_attainment
            if stop_below is not None and attained < stop_below and i < len(rates) - 1:
                log(f"attainment {100 * attained:.1f} % < --stop-below {100 * stop_below:.0f} %: "
                    f"the higher rates are skipped")
                break
    return sweep
