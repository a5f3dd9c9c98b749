"""The engine alone on `pdserve bench`'s workload: the reference a served run's delivered tokens/s
is put against (the serving path's share is the difference).

    python -m pdserve.benchmarks.engine_workload cluster.yaml --concurrency 64 256 512

Builds the engine a colocated replica of cluster.yaml runs (same settings, in this process), then
for each C keeps C requests in flight as `pdserve bench --rate inf --max-concurrency C
--num-prompts 2C` does: 2C random prompts of --input-len token ids, --output-len tokens each
(`ignore_eos`), a new one added as soon as one finishes. Output tokens/s over the whole run, as the
bench counts them (prefill included: the served run pays it too) — unlike `bench-engine`'s decode
figure, a steady batch of decode steps only.
"""

import argparse
import json
import random
import time

from pdserve.config import load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams


def run(engine: Engine, concurrency: int, n: int, input_len: int, output_len: int, rng: random.Random) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    vocab = engine.args.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(input_len)] for _ in range(n)]
    live, sent, tokens = set(), 0, 0
    t0 = time.perf_counter()
    while sent < n or live:
        while sent < n and len(live) < concurrency:
            rid = f"c{concurrency}-{sent}"
            engine.add_request(rid, prompts[sent], params)
            live.add(rid)
            sent += 1
        for out in engine.step():
            tokens += len(out.token_ids)
            if out.finished:
                live.discard(out.request_id)
    dt = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": n, "output_tokens": tokens, "seconds": round(dt, 3),
            "output_tok_s": round(tokens / dt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args()
    engine = Engine(load_cluster_config(a.config).engine_config("colocated"))
    rng = random.Random(0)
    run(engine, 16, 16, a.input_len, 16, rng)  # warm-up: kernels, graphs
    rows = []
    for c in a.concurrency:
        rows.append(run(engine, c, 2 * c, a.input_len, a.output_len, rng))
        print(rows[-1], flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"input_len": a.input_len, "output_len": a.output_len, "rows": rows}, f)


if __name__ == "__main__":
    main()
