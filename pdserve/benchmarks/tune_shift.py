"""The planner against fixed splits, on the same shifting workload: goodput (requests meeting both
SLOs per second) of each fixed prefill:decode split and of a cluster that `pdserve tune --watch
--apply` moves, and the planner's reaction time (from a shift to the new split serving).

    python -m pdserve.benchmarks.tune_shift [--phase-s 60] [--splits 1:2 2:1] [--json out.json]

Each cluster (tiny-moe on CPU by default; --cluster FILE for another, its prefill/decode replicas
set per run) gets the same phases, in order, each `pdserve bench` for --phase-s seconds with the
same seeds: decode-heavy (16-token prompts, 64-token outputs), prefill-heavy (1,000-token prompts,
2-token outputs), decode-heavy again. The tuned cluster starts at the first --splits entry. Its
moves are read off the controller's steps that `pdserve up` prints ("scale: <replica> serving",
to the second): nothing polls the cluster meanwhile. Prints a table and one JSON line.
"""

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from pdserve.benchmarks.up_process import UpProcess

DECODE_HEAVY = {"input_len": 16, "output_len": 64}
PREFILL_HEAVY = {"input_len": 1000, "output_len": 2}
SLO = {"ttft_ms": 2000, "tpot_ms": 100}


def log(msg: str) -> None:
    print(f"[tune_shift] {msg}", file=sys.stderr, flush=True)


def moves(up_log: str, day: datetime.date) -> list[float]:
    """When each scale's new replica started serving (Unix seconds), from `pdserve up`'s output."""
    out = []
    for line in up_log.splitlines():
        if line.startswith("[pdserve] ") and " scale: " in line and line.endswith(" serving"):
            hms = line.split()[1]
            t = datetime.datetime.combine(day, datetime.time.fromisoformat(hms))
            out.append(t.timestamp())
    return out


def run_cluster(name: str, base: dict, start: tuple[int, int], tuned: bool, phase_s: float, work: Path,
                tune_args: list[str], phases_: list) -> dict:
    cfg = {**base, "router": {**base.get("router", {}), "http_port": 0, "grpc_port": None},
           "prefill": {**base.get("prefill", {}), "replicas": start[0]},
           "decode": {**base.get("decode", {}), "replicas": start[1]}, "slo": SLO}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    up = UpProcess(path, work / f"{name}-up.log")
    watcher = None
    try:
        url = up.wait_healthy(None, 300, log)
        address = up.ray_address()
        log(f"{name}: serving at {url}")
        if tuned:
            watcher = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "tune", "--watch", "--apply",
                                        *tune_args, "--address", address],
                                       stdout=open(work / f"{name}-tune.log", "w"), stderr=subprocess.STDOUT)
        phases = []
        for i, (kind, w) in enumerate(phases_):
            out = work / f"{name}-{i}.json"
            t0 = time.time()
            r = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "--url", url, "--rate", str(w["rate"]),
                                "--duration", str(phase_s), "--input-len", str(w["input_len"]), "--output-len",
                                str(w["output_len"]), "--warmup", "0", "--seed", str(i + 1), "--slo-ttft-ms",
                                str(SLO["ttft_ms"]), "--slo-tpot-ms", str(SLO["tpot_ms"]), "--json", str(out)],
                               capture_output=True, text=True, timeout=phase_s * 4 + 120)
            if r.returncode != 0:
                raise RuntimeError(f"{name} phase {i}: pdserve bench failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
            s = json.loads(out.read_text())["runs"][0]
            phases.append({"phase": kind, "start": t0, "sent": s["sent"], "failed": s["failed"],
                           "duration_s": s["duration_s"], "attainment": s["slo_attainment"], "good": s["good_rps"],
                           "ttft_p90": s["ttft_ms"]["p90"], "tpot_p90": s["tpot_ms"]["p90"]})
            log(f"{name} {kind}: {s['completed']}/{s['sent']} ok, SLO {100 * s['slo_attainment']:.0f} %, "
                f"goodput {s['good_rps']:.2f} req/s")
        served = moves(up.output(), datetime.date.today())
        return {"name": name, "phases": phases, "moves": served, "reactions_s": reactions(phases, served)}
    finally:
        if watcher is not None:
            watcher.terminate()
            watcher.wait(30)
        up.stop(60)


def reactions(phases: list[dict], served: list[float]) -> list[float | None]:
    """For each phase after the first: seconds from its start to the first new replica of a move
    serving (None: the split did not change)."""
    out = []
    for ph, nxt in zip(phases[1:], phases[2:] + [None]):
        end = nxt["start"] if nxt else float("inf")
        moved = [t for t in served if ph["start"] <= t < end]
        out.append(round(moved[0] - ph["start"], 1) if moved else None)
    return out


def goodput(result: dict) -> float:
    """Requests meeting both SLOs per second over every phase."""
    good = sum(p["good"] * p["duration_s"] for p in result["phases"])
    return good / sum(p["duration_s"] for p in result["phases"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--splits", nargs="+", default=["1:2", "2:1"], help="fixed P:D splits to compare (default: 1:2 2:1)")
    p.add_argument("--cluster", help="cluster.yaml to start from (default: tiny-moe on CPU, tcp KV)")
    p.add_argument("--tune-args", default="--interval 3 --window 15 --confirm 2 --cooldown 10 --min-requests 8",
                   help="what `pdserve tune --watch --apply` is given (default: %(default)s)")
    p.add_argument("--decode-rate", type=float, default=9.0, help="decode-heavy phases' req/s (default: %(default)s)")
    p.add_argument("--prefill-rate", type=float, default=4.0, help="prefill-heavy phase's req/s (default: %(default)s)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    phases = [("decode-heavy", {**DECODE_HEAVY, "rate": a.decode_rate}),
              ("prefill-heavy", {**PREFILL_HEAVY, "rate": a.prefill_rate}),
              ("decode-heavy", {**DECODE_HEAVY, "rate": a.decode_rate})]
    base = yaml.safe_load(Path(a.cluster).read_text()) if a.cluster else {"kv_transfer": {"backend": "tcp"}}
    fixed = [tuple(int(x) for x in s.split(":")) for s in a.splits]
    results = []
    with tempfile.TemporaryDirectory(prefix="pdserve-tune-shift-") as tmp:
        work = Path(tmp)
        for f in fixed:
            results.append(run_cluster(f"fixed {f[0]}P+{f[1]}D".replace(" ", "-"), base, f, False, a.phase_s, work, [], phases))
        results.append(run_cluster("tuned", base, fixed[0], True, a.phase_s, work, a.tune_args.split(), phases))
    shape = ", ".join("%s %g req/s" % (k, w["rate"]) for k, w in phases)
    print(f"\nshifting workload, {a.phase_s:g} s per phase ({shape}); SLO TTFT "
          f"{SLO['ttft_ms']} ms, TPOT {SLO['tpot_ms']} ms; goodput = requests meeting both per second")
    print(f"{'cluster':<14} " + " ".join(f"{f'{i + 1}:{k} good/s (SLO %)':>30}" for i, (k, _) in enumerate(phases))
          + f" {'all good/s':>11} {'failed':>7} {'reaction s':>12}")
    for r in results:
        cells = " ".join(f"{'%.2f (%.0f %%)' % (ph['good'], 100 * ph['attainment']):>30}" for ph in r["phases"])
        react = ", ".join("-" if x is None else f"{x:g}" for x in r["reactions_s"]) if r["name"] == "tuned" else ""
        print(f"{r['name']:<14} {cells} {goodput(r):>11.2f} {sum(ph['failed'] for ph in r['phases']):>7} {react:>12}")
    tuned = results[-1]
    best_fixed = max(results[:-1], key=goodput)
    print(f"tuned / best fixed ({best_fixed['name']}): {goodput(tuned) / goodput(best_fixed):.2f}x goodput")
    summary = {"date": datetime.date.today().isoformat(), "phase_s": a.phase_s, "slo": SLO, "phases": phases,
               "results": [{**r, "goodput": goodput(r)} for r in results]}
    print(json.dumps(summary))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
