"""A prompt's first token fresh and again with its prefix cached, in-process: what a multi-turn
chat's next turn waits for against a new conversation's first.

    python -m pdserve.benchmarks.cached_prefix cluster.yaml [--prompt-len 128 --reps 6 --gap-s 0.2]

Builds the engine a colocated replica of cluster.yaml runs, sends `--reps` distinct prompts one at
a time (each after `--gap-s` idle), then the same prompts again: all but their last block is then
cached, so the step computes only the rest (a `varlen` prefill graph on a GPU, engine/prefill_graphs.py).
Prints both first-token times and, on a GPU, the graphs replayed. The cached prompt should be no
slower than the fresh one (docs/benchmarks.md, "A light load's first token, hop by hop").
"""

import argparse
import json
import random
import statistics

from pdserve.benchmarks.lone_prompt import first_token_ms
from pdserve.config import load_cluster_config
from pdserve.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--gap-s", type=float, default=0.2)
    ap.add_argument("--json")
    a = ap.parse_args()
    engine = Engine(load_cluster_config(a.config).engine_config("colocated"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, engine.args.vocab_size) for _ in range(a.prompt_len)] for _ in range(a.reps)]
    first_token_ms(engine, prompts[0][::-1], "warm-up", a.gap_s)
    fresh = [first_token_ms(engine, p, f"fresh-{i}", a.gap_s) for i, p in enumerate(prompts)]
    cached = [first_token_ms(engine, p, f"cached-{i}", a.gap_s) for i, p in enumerate(prompts)]
    graphs = engine.runner.prefill_graphs
    out = {"prompt_len": a.prompt_len, "fresh_ms_p50": round(statistics.median(fresh), 2),
           "cached_ms_p50": round(statistics.median(cached), 2), "fresh_ms": [round(x, 2) for x in fresh],
           "cached_ms": [round(x, 2) for x in cached],
           "replays": {f"{b} {layout}": n for (b, layout), n in graphs.replays.items()} if graphs else {}}
    out["cached_over_fresh"] = round(out["cached_ms_p50"] / out["fresh_ms_p50"], 3)
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
