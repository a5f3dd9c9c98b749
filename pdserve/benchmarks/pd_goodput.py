"""P:D configurations through `pdserve up`, compared by goodput on one workload.

    python -m pdserve.benchmarks.pd_goodput deploy/pd4/*.yaml --rates 1 2 4 8 --duration 20 \\
        --input-len 4096 --output-len 256 --stop-below 0.5 --json out.json --log-dir out/ --plot out/

For each cluster file in turn: start `pdserve up FILE` (a process group of its own, output to
LOG_DIR/pdserve-up.NAME.log), wait for its /health (router.http_port of the file), run the
`pdserve bench` sweep against it in this process, stop it as a user does (Ctrl-C; if it hangs,
SIGUSR1 writes its threads' stacks to the log, then the group is killed), and go on to the next;
a cluster that does not start is reported with its log's tail and skipped. Goodput of a
configuration = the highest rate at which >= --slo-attainment of the requests meet TTFT <=
--slo-ttft-ms and TPOT <= --slo-tpot-ms (defaults: 90 %, 2 s, 50 ms). Every other option is
`pdserve bench`'s (`pdserve bench --help` describes what is measured). --plot DIR draws every
cluster file's curves on one set of charts (each named by its file); the saved JSON again, later:
`python -m pdserve.benchmarks.load.plot out.json [other.json ...] --out DIR`.

Last, the goodput of every configuration at each SLO pair of --slo-grid (default: issue 39's six,
grid.DEFAULT_GRID), computed again from each request's record, and each one's ratio to the best of
the others there: one sweep answers every SLO. --json saves those records (their ITL gaps only with
--save-requests), so that the grid can be computed again, for other pairs, without a cluster:
`python -m pdserve.benchmarks.load.grid out.json [other.json ...] --slo-grid 2000/50,1000/20`.
"""

import argparse
import asyncio
import datetime
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.benchmarks.load import grid, plot
from pdserve.benchmarks.load.command import add_load_args, args_json, check_load_args, fmt, slo_of, workload_of, write_json
from pdserve.benchmarks.load.client import BenchError
from pdserve.benchmarks.load.records import RateSummary, rate_json, rate_label
from pdserve.benchmarks.load.sweep import Sweep, run_sweep
from pdserve.benchmarks.up_process import ClusterStartError, UpProcess
from pdserve.config import ClusterConfig, ConfigError, load_cluster_config

WAIT_PROGRESS_S = 15.0


def log(msg: str) -> None:
    print(f"[pd-goodput] {msg}", file=sys.stderr, flush=True)


# -- one cluster ------------------------------------------------------------------------------------


def endpoint(cfg: ClusterConfig) -> tuple[str, int]:
    """(host, port) to reach the cluster's HTTP API from this machine; port 0: the one it will print."""
    host = "127.0.0.1" if cfg.router.host in ("0.0.0.0", "::", "") else cfg.router.host
    return host, cfg.router.http_port


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def wait_port_closed(host: str, port: int, timeout_s: float) -> bool:
    """The router dies with its cluster, a moment after `pdserve up`; the next file may use the same port."""
    deadline = time.monotonic() + timeout_s
    while port_open(host, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


@dataclass
class ConfigResult:
    name: str
    path: str
    url: str
    log_path: str
    error: str | None = None  # why it did not start or was not measured
    sweep: Sweep | None = None
    exit_code: int | None = None  # of `pdserve up`
    stopped: str | None = None  # "interrupted" (Ctrl-C was enough) | "killed"
    port_closed: bool | None = None
    # The router's pdserve_prefill_site_total after the sweep ("site/why" -> attempts): where the
    # prompts were computed (an adaptive cluster's choices).
    sites: dict[str, float] | None = None

    @property
    def runs(self) -> list[RateSummary]:
        return [r.summary for r in self.sweep.runs] if self.sweep else []

    @property
    def goodput(self) -> float | None:
        return self.sweep.goodput if self.sweep else None

    def to_json(self, save_requests: bool, itl: bool = True) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "log_path": self.log_path, "error": self.error,
                "exit_code": self.exit_code, "stopped": self.stopped, "port_closed": self.port_closed,
                "prefill_sites": self.sites,
                "goodput": rate_json(self.goodput),
                **(self.sweep.to_json(save_requests, itl) if self.sweep else {"url": self.url, "runs": []})}


def prefill_sites(url: str) -> dict[str, float] | None:
    """The router's pdserve_prefill_site_total by "site/why" (None: not read)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_prefill_site":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = f"{sample.labels['site']}/{sample.labels['why']}"
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def run_config(path: Path, cfg: ClusterConfig, a: argparse.Namespace, log_dir: Path) -> ConfigResult:
    host, port = endpoint(cfg)
    url = f"http://{host}:{port}" if port else None
    res = ConfigResult(path.stem, str(path), url or "", str(log_dir / f"pdserve-up.{path.stem}.log"))
    if port and port_open(host, port):  # /health would answer from the wrong cluster
        res.error = f"port {port} is already in use (another cluster? `pdserve down` stops it)"
        log(f"{res.name}: {res.error}")
        return res
    log(f"{res.name}: pdserve up {path} (log: {res.log_path})")
    up = UpProcess(path, Path(res.log_path))
    try:
        t0 = time.monotonic()
        url = res.url = up.wait_healthy(url, a.start_timeout, progress=lambda m: log(f"{res.name}: {m}"),
                                        every_s=WAIT_PROGRESS_S)
        port = int(url.rsplit(":", 1)[1])
        log(f"{res.name}: serving at {url} after {time.monotonic() - t0:.0f} s")
        res.sweep = asyncio.run(run_sweep(
            url, a.rates, workload_of(a), slo_of(a), stop_below=a.stop_below,
            log=lambda m: log(f"{res.name}: {m}")))
        res.sites = prefill_sites(url)
        if res.sites:
            log(f"{res.name}: prompts computed {res.sites}")
    except (BenchError, ClusterStartError) as e:
        res.error = str(e)
        log(f"{res.name}: {res.error}; the log's tail:\n{up.tail()}")
    finally:
        log(f"{res.name}: stopping")
        res.exit_code, res.stopped = up.stop(a.stop_timeout)
        res.port_closed = wait_port_closed(host, port, 30)
        if not res.port_closed:
            log(f"{res.name}: port {port} still answers after the stop")
    return res


# -- the command ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.pd_goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="+", type=Path, help="cluster.yaml files, run in this order")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds for a cluster to answer /health (default: %(default)s)")
    p.add_argument("--stop-timeout", type=float, default=120.0,
                   help="seconds for a cluster to stop after Ctrl-C before it is killed (default: %(default)s)")
    p.add_argument("--log-dir", type=Path, help="where the `pdserve up` logs go (default: a new temporary folder)")
    add_load_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    check_load_args(p, a)
    try:  # every file is checked before the first cluster starts
        configs = {path: load_cluster_config(str(path)) for path in a.configs}
        compare = plot.load_compare(a.compare, a.plot)
    except (ConfigError, plot.PlotError) as e:
        print(f"pd_goodput: error: {e}", file=sys.stderr)
        return 2
    log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="pd_goodput-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "host": socket.gethostname(),
            "args": {**args_json(a), "configs": [str(c) for c in a.configs],
                     "log_dir": str(log_dir)}}
    results: list[ConfigResult] = []
    for path, cfg in configs.items():
        results.append(run_config(path, cfg, a, log_dir))
        # The records always: the grid is computed from them, and again from the file.
        write_json(a.json, {"meta": meta, "configs": [r.to_json(True, itl=a.save_requests) for r in results]})
    print_table(results, a)
    print("\n" + grid.table([grid.config_of(r.name, r.sweep, r.error) for r in results],
                            a.slo_grid or grid.DEFAULT_GRID, a.slo_attainment))
    if a.json:
        log(f"wrote {a.json}")
    if a.plot:
        try:
            paths = plot.write_charts(plot.series_of({"configs": [r.to_json(False) for r in results]}, "--plot",
                                                     "pd_goodput") + compare, a.plot)
            log(f"wrote {', '.join(map(str, paths))}")
        except plot.PlotError as e:
            print(f"pd_goodput: error: {e}", file=sys.stderr)
            return 2
    return 0 if all(r.error is None for r in results) else 1


def print_table(results: list[ConfigResult], a: argparse.Namespace) -> None:
    print(f"\nprompts {a.input_len} tokens, output {a.output_len}; goodput: the highest rate with >= "
          f"{100 * a.slo_attainment:g} % of requests meeting TTFT <= {a.slo_ttft_ms:g} ms and TPOT <= "
          f"{a.slo_tpot_ms:g} ms")
    print(f"{'config':<14} {'goodput':>8} | {'rate':>6} {'ok/sent':>9} {'SLO %':>6} {'p90 TTFT ms':>12} "
          f"{'p90 TPOT ms':>12}")
    for r in results:
        goodput = rate_label(r.goodput) if r.goodput is not None else "-"
        if not r.runs:
            print(f"{r.name:<14} {goodput:>8} | {r.error}")
        for i, s in enumerate(r.runs):
            head = f"{r.name:<14} {goodput:>8}" if i == 0 else " " * 23
            print(f"{head} | {rate_label(s.rate):>6} {f'{s.completed}/{s.sent}':>9} {100 * s.slo_attainment:>6.1f} "
                  f"{fmt(s.ttft_ms.p90):>12} {fmt(s.tpot_ms.p90, 2):>12}")


if __name__ == "__main__":
    sys.exit(main())
