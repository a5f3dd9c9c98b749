"""A light load's first token and decode step on a fresh engine, and again after a heavy load, in one
process: does a busy spell leave the engine slower for the light load that follows?

    python -m pdserve.benchmarks.after_load cluster.yaml [--heavy 1024 --concurrency 512 --len 256]

Builds the engine a colocated replica of cluster.yaml runs, then: `--reps` lone 128-token prompts
(50 tokens each, `--gap-s` idle before each), timing each one's first token and its decode steps;
then `--heavy` prompts of `--len` tokens with `--len`-token answers, at most `--concurrency` at a
time; then the lone prompts again. With each round it prints the CUDA caching allocator's counters
over it (torch.cuda.memory_stats: cudaMalloc calls, frees, retries after freeing the cache — a
retry synchronizes the device and frees every cached segment) and the memory it holds reserved.
"""

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.config import load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams

_COUNTERS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_ooms")


def _counters(device: torch.device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    s = torch.cuda.memory_stats(device)
    out = {k: s.get(k, 0) for k in _COUNTERS}
    out["reserved_GB"] = round(s.get("reserved_bytes.all.current", 0) / 2**30, 2)
    return out


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def light(engine: Engine, rng: random.Random, reps: int, gap_s: float, tag: str) -> dict:
    """`reps` lone 128-token prompts of 50 tokens: first-token ms, and the longest step of each."""
    vocab = engine.args.vocab_size
    before = _counters(engine.device)
    first, steps, longest = [], [], []
    for i in range(reps):
        _sync(engine)
        time.sleep(gap_s)
        rid = f"{tag}-{i}"
        t0 = time.perf_counter()
        engine.add_request(rid, [rng.randrange(3, vocab) for _ in range(128)],
                           SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        got, mine = None, []
        while engine.has_unfinished():
            s = time.perf_counter()
            outs = engine.step()
            mine.append(time.perf_counter() - s)
            if got is None and any(o.request_id == rid for o in outs):
                got = time.perf_counter() - t0
        first.append(got * 1e3)
        steps += mine[2:]
        longest.append(max(mine) * 1e3)
    after = _counters(engine.device)
    return {"first_token_ms_p50": round(statistics.median(first), 2), "first_token_ms": [round(x, 2) for x in first],
            "step_ms_p50": round(statistics.median(steps) * 1e3, 3), "longest_step_ms": [round(x, 1) for x in longest],
            "allocator": {k: after[k] - before[k] if k in _COUNTERS else after[k] for k in after}}


def heavy(engine: Engine, rng: random.Random, n: int, concurrency: int, length: int) -> dict:
    vocab = engine.args.vocab_size
    before = _counters(engine.device)
    t0 = time.perf_counter()
    sent = done = 0
    while done < n:
        while sent < n and sent - done < concurrency:
            engine.add_request(f"heavy-{sent}", [rng.randrange(3, vocab) for _ in range(length)],
                               SamplingParams(max_tokens=length, temperature=0, ignore_eos=True))
            sent += 1
        done += sum(1 for o in engine.step() if o.finished)
    while engine.has_unfinished():
        engine.step()
    after = _counters(engine.device)
    return {"seconds": round(time.perf_counter() - t0, 1),
            "allocator": {k: after[k] - before[k] if k in _COUNTERS else after[k] for k in after}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=0.5)
    ap.add_argument("--heavy", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=512)
    ap.add_argument("--len", type=int, default=256, help="the heavy load's prompt and answer tokens")
    ap.add_argument("--json")
    a = ap.parse_args()
    engine = Engine(load_cluster_config(a.config).engine_config("colocated"))
    rng = random.Random(0)
    out = {"fresh": light(engine, rng, a.reps, a.gap_s, "fresh")}
    print("fresh", json.dumps(out["fresh"]), flush=True)
    out["heavy"] = heavy(engine, rng, a.heavy, a.concurrency, a.len)
    print("heavy", json.dumps(out["heavy"]), flush=True)
    out["after"] = light(engine, rng, a.reps, a.gap_s, "after")
    print("after", json.dumps(out["after"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
