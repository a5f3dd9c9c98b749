"""`pdserve bench`: Poisson load against a running pdserve's OpenAI HTTP API.

    pdserve up &
    pdserve bench --rate 1 2 4 inf --num-prompts 200 --input-len 1024 --output-len 128 --json out.json
    pdserve bench ... --label pd2-2 --plot charts/ [--compare earlier.json ...]   (PNG charts; matplotlib)
    python -m pdserve.benchmarks.load.plot a.json b.json --out charts/             (charts of saved results)
    pdserve bench ... --json a.json --slo-grid 2000/50,1000/20     (goodput at each SLO pair, from these runs)
    python -m pdserve.benchmarks.load.grid a.json --slo-grid ...   (the same from the saved records)
    python -m pdserve.benchmarks.load ...          (the same command)

Imports no torch: it runs on any client machine with httpx and aiohttp.

Workload: prompts of --input-len random token ids (seeded; ids in [3, 256): bytes for the
byte-level tokenizer of the presets, ordinary tokens of any HF vocabulary), each asking for exactly
--output-len tokens (max_tokens with ignore_eos), greedy, streamed from /v1/completions (SSE).
Arrivals are Poisson at each --rate in turn (inf: all at once), --num-prompts requests per rate or
rate × --duration; one seeded generator serves the whole sweep, so no two prompts repeat (the
prefix cache cannot help a later rate). --warmup requests go first, uncounted. A refused request
(503: no capacity) is not retried: it counts as failed, as it would for a user.
"""

import argparse
import asyncio
import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

from pdserve.benchmarks.load import grid, plot, records, workloads
from pdserve.benchmarks.load.client import BenchError
from pdserve.benchmarks.load.records import Slo, Workload, rate_json, rate_label
from pdserve.benchmarks.load.sweep import Sweep, log, run_sweep


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (requests/s, or inf)") from None
    if not rate > 0:  # also NaN
        raise argparse.ArgumentTypeError(f"{text!r}: a rate must be > 0 (or inf)")
    return rate


def add_load_args(p: argparse.ArgumentParser, slo_of_cluster: bool = False) -> None:
    """The workload and SLO options, shared with pd_goodput. slo_of_cluster: the SLO left out is the
    cluster's (`pdserve bench`, against one cluster: cluster_slo), else 2 s / 50 ms (pd_goodput's
    clusters, compared against one SLO)."""
    p.add_argument("--rate", "--rates", dest="rates", type=_rate, nargs="+", default=[1.0], metavar="RATE",
                   help="requests/s, Poisson arrivals; several: a sweep, in order; inf: all at once (default: 1)")
    n = p.add_mutually_exclusive_group()
    n.add_argument("--num-prompts", type=int, help="requests per rate (default: 100)")
    n.add_argument("--duration", type=float, help="seconds of arrivals per rate: rate × duration requests")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens, exactly (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default: %(default)s)")
    p.add_argument("--workload", choices=workloads.KINDS, default="random",
                   help="random: independent prompts; shared-prefix: --prefixes few-shot prefixes of --prefix-len "
                        "tokens, each followed by --input-len of its own; multi-turn: sessions of --turns turns "
                        "over a shared --prefix-len system prompt, each turn --input-len new tokens, its history "
                        "growing by --output-len per answer (default: %(default)s)")
    p.add_argument("--prefix-len", type=int, default=512, help="shared-prefix, multi-turn (default: %(default)s)")
    p.add_argument("--prefixes", type=int, default=4, help="shared-prefix (default: %(default)s)")
    p.add_argument("--turns", type=int, default=4, help="multi-turn (default: %(default)s)")
    p.add_argument("--think-time", type=float, default=0.0, metavar="S",
                   help="multi-turn: seconds from a turn's end to the session's next (default: %(default)s)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight (default: no cap)")
    p.add_argument("--clients", type=int, default=1, metavar="N",
                   help="client processes to send from (default: %(default)s); one runs at a whole core near a "
                        "hundred fast streams, and the JSON's client_cpu says when it did")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=4,
                   help="requests sent at once before the first rate, not counted (default: %(default)s)")
    if slo_of_cluster:
        default = "default: the cluster's slo: (as /dashboard/data gives it; cluster.yaml's default where none answers)"
        p.add_argument("--slo-ttft-ms", type=float, help=default)
        p.add_argument("--slo-tpot-ms", type=float, help=default)
    else:
        p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="default: %(default)s")
        p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="default: %(default)s")
    p.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of requests that must meet both SLOs for a rate to count (default: %(default)s)")
    p.add_argument("--stop-below", type=float, metavar="ATTAINMENT",
                   help="end the sweep after a rate whose attainment is under this (e.g. 0.5)")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--save-requests", action="store_true",
                   help="also write each request's record to the JSON, its ITL gaps included (with a grid, "
                        "the records are written anyway, without the gaps: the grid is computed from them)")
    p.add_argument("--slo-grid", type=grid.parse_grid, metavar="TTFT/TPOT,...",
                   help=f"{grid.SLO_GRID_HELP}. pd_goodput prints it always (default: {grid.DEFAULT_GRID_TEXT}), "
                        f"`pdserve bench` only when given. From saved results: "
                        f"python -m pdserve.benchmarks.load.grid FILE...")
    p.add_argument("--plot", metavar="DIR",
                   help="after the sweep, write charts into DIR (created if missing): ttft.png, tpot.png (and "
                        "ITL), goodput.png (and output tokens/s) against the rate, the SLO drawn; needs matplotlib "
                        "(the plot extra)")
    p.add_argument("--compare", nargs="+", metavar="FILE",
                   help="with --plot: earlier results (the --json of pdserve bench or pd_goodput) drawn on the same "
                        "charts, each named by its label. Saved results alone, without a cluster: "
                        "python -m pdserve.benchmarks.load.plot FILE... --out DIR")


def check_load_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    if a.num_prompts is None and a.duration is None:
        a.num_prompts = 100
    if a.duration is not None and any(math.isinf(r) for r in a.rates):
        p.error("--rate inf sends everything at once: give --num-prompts, not --duration")
    for name in ("num_prompts", "duration", "input_len", "output_len", "max_concurrency", "request_timeout",
                 "prefixes", "turns"):
        value = getattr(a, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if a.clients < 1:
        p.error(f"--clients must be >= 1, got {a.clients}")
    if a.max_concurrency is not None and a.max_concurrency < a.clients:
        p.error(f"--max-concurrency {a.max_concurrency} is below --clients {a.clients}: every client process "
                f"needs at least one request in flight")
    if a.prefix_len < 0 or a.think_time < 0:
        p.error(f"--{'prefix-len' if a.prefix_len < 0 else 'think-time'} must be >= 0")
    if a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    if not 0 < a.slo_attainment <= 1:
        p.error(f"--slo-attainment must be in (0, 1], got {a.slo_attainment}")
    for name in ("slo_ttft_ms", "slo_tpot_ms"):
        value = getattr(a, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {value}")


def cluster_slo(url: str) -> tuple[dict, str]:
    """The cluster's slo: ({"ttft_ms", "tpot_ms"}, where from): what its dashboard shows (the
    controller's config), or cluster.yaml's default where the dashboard has none (no controller
    answering, or a server that is not pdserve's)."""
    import httpx

    from pdserve.config import SloConfig

    try:
        slo = httpx.get(f"{url}/dashboard/data", timeout=10, verify=False).json().get("slo") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        slo = {}
    if "ttft_ms" in slo and "tpot_ms" in slo:
        return slo, "the cluster's slo:"
    return SloConfig().model_dump(), "cluster.yaml's default slo: (the cluster did not say its own)"


def workload_of(a: argparse.Namespace) -> Workload:
    return Workload(a.input_len, a.output_len, a.num_prompts, a.duration, a.seed, a.max_concurrency,
                    a.request_timeout, a.warmup, a.clients, a.workload, a.prefix_len if a.workload != "random" else 0,
                    a.prefixes, a.turns, a.think_time)


def slo_of(a: argparse.Namespace) -> Slo:
    return Slo(a.slo_ttft_ms, a.slo_tpot_ms, a.slo_attainment)


def build_parser() -> argparse.ArgumentParser:
    # The help: this docstring, then records.py's (what is measured) less its first line.
    measured = records.__doc__.split("\n", 2)[2]
    p = argparse.ArgumentParser(prog="pdserve bench", description=f"{__doc__}\n{measured}",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the pdserve HTTP endpoint (default: %(default)s)")
    p.add_argument("--model", help="default: the first model /v1/models lists")
    p.add_argument("--metrics-url", nargs="+", metavar="URL",
                   help="whose /metrics split TTFT into the router's phases (default: --url). With "
                        "router.replicas > 1 give every router's own address (`pdserve status` lists them): "
                        "through the shared port each scrape reaches whichever router the kernel picks")
    p.add_argument("--label", help="this run's name, written into the JSON and on the charts (default: the "
                                   "--json file's name)")
    add_load_args(p, slo_of_cluster=True)
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
    if a.slo_ttft_ms is None or a.slo_tpot_ms is None:
        # The same targets `pdserve status --watch` and /dashboard judge the traffic by.
        slo, source = cluster_slo(a.url)
        a.slo_ttft_ms = slo["ttft_ms"] if a.slo_ttft_ms is None else a.slo_ttft_ms
        a.slo_tpot_ms = slo["tpot_ms"] if a.slo_tpot_ms is None else a.slo_tpot_ms
        log(f"SLO TTFT <= {a.slo_ttft_ms:g} ms, TPOT <= {a.slo_tpot_ms:g} ms: {source}")
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "args": args_json(a)}
    try:  # a --compare file that cannot be drawn fails now, not after the sweep
        compare = plot.load_compare(a.compare, a.plot)
    except plot.PlotError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2

    def result(sweep: Sweep, save_requests: bool) -> dict[str, Any]:
        return {"meta": meta, "label": a.label, **sweep.to_json(save_requests, itl=a.save_requests)}

    def save(sweep: Sweep) -> None:
        # A grid asked for now can be asked for again from the file, with other pairs.
        write_json(a.json, result(sweep, a.save_requests or a.slo_grid is not None))

    try:
        sweep = asyncio.run(run_sweep(a.url, a.rates, workload_of(a), slo_of(a), a.model, a.stop_below,
                                      on_run=save, metrics_urls=a.metrics_url))
    except BenchError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    print_table(sweep)
    if a.slo_grid:
        name = a.label or (Path(a.json).stem if a.json else "this run")
        print("\n" + grid.table([grid.config_of(name, sweep)], a.slo_grid, a.slo_attainment))
    if a.json:
        log(f"wrote {a.json}")
    if a.plot:
        name = Path(a.json).stem if a.json else "this run"
        try:
            paths = plot.write_charts(plot.series_of(result(sweep, False), "--plot", name) + compare, a.plot)
        except plot.PlotError as e:
            print(f"pdserve bench: error: {e}", file=sys.stderr)
            return 2
        log(f"wrote {', '.join(map(str, paths))}")
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
