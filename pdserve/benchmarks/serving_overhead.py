"""What the serving path adds, on CPU: latency through `pdserve up` against `pdserve generate`
for the same work, and the token rate one decode replica streams through one router.

    pdserve up &                                   # the embedded default (tiny-moe, 1 + 1)
    python -m pdserve.benchmarks.serving_overhead --url http://127.0.0.1:8000

Part 1: N requests one at a time (prompt 32 tokens, 16 new tokens, greedy), end-to-end latency
over HTTP, against the same request run alone by an in-process colocated engine (the reference,
measured in the same run). Part 2: C concurrent streams of long generations; client-side
tokens/s and the router process's CPU use (from /proc), for growing C.
"""

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import time

import httpx

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def router_pid() -> int | None:
    out = subprocess.run(["pgrep", "-f", "ray::Router"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def part1(url: str, n: int) -> dict:
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=512))
    prompt = "The quick brown fox jumps over the lazy do"  # 43 bytes: 44 tokens with BOS
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    local, served = [], []
    with httpx.Client(timeout=60) as http:
        for i in range(n + 3):  # the first three warm both up
            t0 = time.perf_counter()
            engine.generate([prompt], params)
            t1 = time.perf_counter()
            r = http.post(f"{url}/v1/completions", json=body)
            t2 = time.perf_counter()
            r.raise_for_status()
            if i >= 3:
                local.append(t1 - t0)
                served.append(t2 - t1)
    return {"requests": n, "generate_p50_ms": round(1e3 * pct(local, 50), 2),
            "generate_p99_ms": round(1e3 * pct(local, 99), 2),
            "served_p50_ms": round(1e3 * pct(served, 50), 2), "served_p99_ms": round(1e3 * pct(served, 99), 2),
            "overhead_p50_ms": round(1e3 * (pct(served, 50) - pct(local, 50)), 2),
            "overhead_p99_ms": round(1e3 * (pct(served, 99) - pct(local, 99)), 2)}


async def stream_load(url: str, concurrency: int, max_tokens: int) -> tuple[int, float]:
    body = {"model": "tiny-moe", "prompt": "Stream me", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0

    async def one(client: httpx.AsyncClient):
        nonlocal tokens
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*[one(client) for _ in range(concurrency)])
        return tokens, time.perf_counter() - t0


def part2(url: str, levels: list[int], max_tokens: int) -> list[dict]:
    pid = router_pid()
    rows = []
    for c in levels:
        c0 = cpu_seconds(pid) if pid else 0.0
        tokens, dt = asyncio.run(stream_load(url, c, max_tokens))
        cpu = (cpu_seconds(pid) - c0) / dt if pid else float("nan")
        rows.append({"streams": c, "tokens_per_s": round(tokens / dt, 1), "router_cpu_pct": round(100 * cpu, 1),
                     "tokens_per_router_cpu_s": round(tokens / dt / cpu, 1) if cpu else None})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    lat = part1(args.url, args.requests)
    print(lat, flush=True)
    rate = part2(args.url, args.streams, args.max_tokens)
    meta = {"date": datetime.date.today().isoformat(), "cpus": os.cpu_count()}
    print(f"\nlatency (ms)   generate p50 {lat['generate_p50_ms']} p99 {lat['generate_p99_ms']} | "
          f"through pdserve up p50 {lat['served_p50_ms']} p99 {lat['served_p99_ms']} | "
          f"overhead p50 {lat['overhead_p50_ms']} p99 {lat['overhead_p99_ms']}")
    print(f"{'streams':>8} {'tokens/s':>9} {'router CPU %':>13} {'tokens per router CPU-s':>24}")
    for r in rate:
        print(f"{r['streams']:>8} {r['tokens_per_s']:>9} {r['router_cpu_pct']:>13} {r['tokens_per_router_cpu_s']!s:>24}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "latency": lat, "stream_rate": rate}, f, indent=1)


if __name__ == "__main__":
    main()
