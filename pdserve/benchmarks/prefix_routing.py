"""Routing policies on a multi-turn workload: prefill tokens computed, KV bytes moved, TTFT.

    python -m pdserve.benchmarks.prefix_routing                       # CPU: tiny-moe, 2 prefill + 2 decode
    python -m pdserve.benchmarks.prefix_routing --rate 2 --num-prompts 96 --turns 6 --json out.json
    python -m pdserve.benchmarks.prefix_routing --cluster FILE.yaml   # another cluster (its policy is replaced)
    python -m pdserve.benchmarks.prefix_routing --cluster deploy/bench/colocated2.gpu.yaml --policies \
        prefix-aware kv-aware round-robin   # two GPUs: the prefill side alone (no KV moves)

For each variant in turn — the policies `prefix-aware`, `kv-aware` and `round-robin`, and
`kv-aware-whole-kv`: kv-aware with the decode replicas' prefix cache off (decode.prefix_cache: false),
so that every turn moves its whole history's KV, as every policy did before a decode reservation
looked in its own cache — `pdserve up` of the same cluster with the variant's keys set, `pdserve bench --workload multi-turn` against it (the same seeded sessions
for every policy: sessions of --turns turns over a shared --prefix-len system prompt, each turn
--input-len new tokens and an answer of --output-len, Poisson session starts at --rate / --turns),
then the cluster's counters from the router's /metrics: prompt tokens the prefill replicas
computed (looked up less found in their prefix caches), KV bytes moved from prefill to decode, and
decode blocks reused. Each variant's figures are then given against --reference's, measured in the
same run. A table last."""

import argparse
import asyncio
import datetime
import json
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.benchmarks.load.records import Slo, Workload
from pdserve.benchmarks.load.sweep import run_sweep
from pdserve.benchmarks.up_process import UpProcess

VARIANTS = {  # the keys each sets in the cluster
    "prefix-aware": {"router": {"policy": "prefix-aware"}},
    "kv-aware": {"router": {"policy": "kv-aware"}},
    "round-robin": {"router": {"policy": "round-robin"}},
    "kv-aware-whole-kv": {"router": {"policy": "kv-aware"}, "decode": {"prefix_cache": False}},
}
DEFAULT_CLUSTER = {
    "model": {"path": "tiny-moe"},
    "router": {"host": "127.0.0.1", "http_port": 0, "grpc_port": None},
    "prefill": {"replicas": 2, "num_kv_blocks": 1024},
    "decode": {"replicas": 2, "num_kv_blocks": 1024},
}


def log(msg: str) -> None:
    print(f"[prefix_routing] {msg}", flush=True)


def counters(url: str) -> dict[str, float]:
    out = {"computed": 0.0, "moved": 0.0, "reused_blocks": 0.0}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in family.samples:
            # the replicas that compute prompts: prefill, or colocated in a colocated cluster
            prefill = (s.labels.get("role") in ("prefill", "colocated")
                       or any(r in s.labels.get("replica", "") for r in ("prefill", "colocated")))
            if s.name == "pdserve_prefix_cache_queries_total" and prefill:
                out["computed"] += s.value
            elif s.name == "pdserve_prefix_cache_hits_total" and prefill:
                out["computed"] -= s.value
            elif s.name == "pdserve_kv_bytes_moved_total":
                out["moved"] += s.value
            elif s.name.startswith("pdserve_kv_blocks_reused") and s.name.endswith("_total"):
                out["reused_blocks"] += s.value
            elif s.name == "pdserve_replica_requests_total":  # how the policy spread them
                key = "placed " + s.labels["replica"].removeprefix("pdserve-")
                out[key] = out.get(key, 0.0) + s.value
    return out


def run_policy(policy: str, cluster: dict, workload: Workload, rates: list[float], log_dir: Path) -> list[dict]:
    """One cluster for the variant, the rates in turn on it; a row per rate, its counters' own."""
    cfg = json.loads(json.dumps(cluster))
    for section, keys in VARIANTS[policy].items():
        cfg.setdefault(section, {}).update(keys)
    path = log_dir / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    up = UpProcess(path, log_dir / f"pdserve-up.{policy}.log")
    marks: list[dict[str, float]] = []

    def mark(_sweep=None) -> None:
        time.sleep(1.5)  # the router's stats polls (every 0.5 s) bring the replicas' last counts
        marks.append(counters(url))

    try:
        url = up.wait_healthy(None, 300, progress=lambda m: log(f"{policy}: {m}"))
        log(f"{policy}: serving at {url}")
        marks.append(counters(url))
        # One sweep: its one prompt generator gives each rate sessions of its own, so what a rate
        # finds cached is only the shared system prompt and its own sessions' turns.
        sweep = asyncio.run(run_sweep(url, rates, workload, Slo(), log=lambda m: log(f"{policy}: {m}"),
                                      on_run=mark))
    finally:
        code, how = up.stop(60)
        log(f"{policy}: stopped ({how}, exit {code})")
    rows = []
    for run, before, after in zip(sweep.runs, marks, marks[1:]):
        s = run.summary
        rows.append({"policy": policy, "rate": run.summary.rate, "completed": s.completed, "failed": s.failed,
                     "ttft_p50_ms": s.ttft_ms.p50, "ttft_p90_ms": s.ttft_ms.p90,
                     # the decode side's part: where a policy herds turns onto few decode replicas
                     "tpot_p50_ms": s.tpot_ms.p50, "tpot_p90_ms": s.tpot_ms.p90,
                     **{k: after[k] - before.get(k, 0.0) for k in after}})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", help="a cluster.yaml (default: tiny-moe on CPU, 2 prefill + 2 decode)")
    ap.add_argument("--policies", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--reference", choices=list(VARIANTS), default="kv-aware", help="the ratios' denominator")
    ap.add_argument("--rate", "--rates", dest="rates", type=float, nargs="+", default=[2.0],
                    help="requests/s (sessions start at rate / turns); several: each on the same cluster, in turn")
    ap.add_argument("--replicas", type=int, nargs=2, metavar=("PREFILL", "DECODE"),
                    help="the default cluster's replicas (default: 2 2)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=256, help="the shared system prompt")
    ap.add_argument("--input-len", type=int, default=64, help="each turn's new user tokens")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--think-time", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.cluster and a.replicas:
        ap.error("--replicas sets the default cluster's; give them in --cluster's file instead")
    cluster = yaml.safe_load(Path(a.cluster).read_text()) if a.cluster else json.loads(json.dumps(DEFAULT_CLUSTER))
    if a.replicas:
        cluster["prefill"]["replicas"], cluster["decode"]["replicas"] = a.replicas
    workload = Workload(a.input_len, a.output_len, a.num_prompts, seed=a.seed, warmup=0, kind="multi-turn",
                        prefix_len=a.prefix_len, turns=a.turns, think_s=a.think_time)
    log_dir = Path(tempfile.mkdtemp(prefix="prefix-routing-"))
    log(f"clusters' configs and `pdserve up` logs in {log_dir}")
    rows = [row for p in a.policies for row in run_policy(p, cluster, workload, a.rates, log_dir)]

    print(f"\nmulti-turn: {a.num_prompts} requests per rate, {a.turns} turns, system {a.prefix_len}, "
          f"input {a.input_len}, output {a.output_len}, think {a.think_time} s; ratios against {a.reference} "
          f"at the same rate")
    print(f"{'rate':>5} {'variant':17} {'ok':>4} {'TTFT p50':>9} {'p90':>9} {'p90 x':>6} {'TPOT p90':>9} {'computed':>9} {'x':>5} "
          f"{'KV MB moved':>11} {'x':>5} {'reused blk':>10}")
    for r in sorted(rows, key=lambda r: (r["rate"], a.policies.index(r["policy"]))):
        ref = next((x for x in rows if x["policy"] == a.reference and x["rate"] == r["rate"]), r)

        def ratio(k):
            return r[k] / ref[k] if ref[k] else float("nan")

        print(f"{r['rate']:>5g} {r['policy']:17} {r['completed']:>4} {r['ttft_p50_ms']:>9.1f} {r['ttft_p90_ms']:>9.1f} "
              f"{ratio('ttft_p90_ms'):>6.2f} {r['tpot_p90_ms']:>9.1f} {r['computed']:>9.0f} {ratio('computed'):>5.2f} "
              f"{r['moved'] / 1e6:>11.2f} {ratio('moved'):>5.2f} {r['reused_blocks']:>10.0f}  "
              + " ".join(f"{k.removeprefix('placed ')}={v:.0f}" for k, v in r.items() if k.startswith("placed ")))
    if a.json:
        Path(a.json).write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                            "args": vars(a), "cluster": cluster, "rows": rows}, indent=1))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
