"""What a prompt's chunk costs a decode replica's decoders: the numbers the TPOT guard
(engine/tpot_guard.py) and the adaptive prefill site (router/prefill_site.py) model.

    python -m pdserve.benchmarks.mixed_step deploy/bench/adaptive/1p1d-adaptive50.yaml \\
        --decoders 32 96 --context 4096 --chunks 0 64 256 1024 2048 --modes mixed split

Builds the decode engine of cluster.yaml (in this process; no overlap, so that a step's wall time is
its own), brings D sequences of --context-token prompts to decoding, then times the decoders'
interval (the time between two of their tokens): the D decoders alone (a CUDA graph on a GPU);
with one prompt's chunk of P tokens beside them in one step (mixed: the step runs eagerly); or
with the chunk in a step of its own before theirs (split: what a guarded engine does where the
decoders replay graphs); median over the chunk's steps. Also prints what the guard's model
forecasts for each (pdserve/step_cost.py MixedCost, fitted from these steps at each D and mode),
so that the model's error is read off the same run.
"""

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.config import load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.engine.tpot_guard import TPOTGuard
from pdserve.messages import Request
from pdserve.protocol import SamplingParams
from pdserve.step_cost import fit_mixed, fit_phases


def timed_step(engine: Engine) -> float:
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.step()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--decoders", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 64, 256, 1024, 2048])
    ap.add_argument("--modes", nargs="+", choices=["mixed", "split"], default=["mixed", "split"])
    ap.add_argument("--json")
    a = ap.parse_args()
    cfg = load_cluster_config(a.config)
    ec = cfg.engine_config("decode").model_copy(update={"overlap_scheduling": False, "tpot_guard_ms": None})
    engine = Engine(ec)
    sched = engine.scheduler
    graphs = sched.decode_graph_max
    vocab = engine.args.vocab_size
    rng = random.Random(0)
    rows, n = [], 0
    for d in a.decoders:
        for _ in range(d - len(engine.seqs)):
            n += 1
            engine.add(Request(f"dec{n}", [rng.randrange(3, vocab) for _ in range(a.context)],
                               SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)))
        while any(q.num_tokens - q.num_computed_tokens > 1 for q in engine.seqs.values()):
            engine.step()
        for mode in a.modes:
            # split: a guard with no bound (chunks of --chunks tokens) and the decode graphs a GPU has
            # (on a CPU, as if it had them: the step pattern is what is timed).
            sched.guard = TPOTGuard(engine.profile, 1e3, 16) if mode == "split" else None
            sched.decode_graphs(graphs or (d if mode == "split" else 0))
            engine.profile.reset()
            for p in a.chunks:
                if p == 0:
                    if mode == "split":
                        continue
                    times = [timed_step(engine) for _ in range(12)][2:]
                else:
                    n += 1
                    rid = f"chunk{n}"
                    sched.chunk_size = p
                    engine.add(Request(rid, [rng.randrange(3, vocab) for _ in range(p * 5)],
                                       SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
                    times, t = [], 0.0
                    while rid in engine.seqs and engine.seqs[rid].num_tokens - engine.seqs[rid].num_computed_tokens > 1:
                        t += timed_step(engine)
                        if mode == "mixed" or not sched.apart_decoders:  # the decoders' token came
                            times.append(t)
                            t = 0.0
                    while rid in engine.seqs:
                        engine.step()
                    times = times[1:-1] or times
                rows.append({"decoders": d, "mode": mode, "chunk": p, "interval_ms": round(1e3 * statistics.median(times), 2)})
                print(rows[-1], flush=True)
            snap = engine.profile.snapshot()
            mixed = fit_mixed(snap, fit_phases(snap)[0])
            for r in rows:
                if r["decoders"] == d and r["mode"] == mode and mixed:
                    r["model_ms"] = round(1e3 * mixed.time(d, r["chunk"]), 2)
            print(f"D={d} {mode}: fit {mixed}", flush=True)
    sched.guard = None
    print(f"{'D':>4} {'mode':>6} {'P':>5} {'interval ms':>11} {'model ms':>9}")
    for r in rows:
        print(f"{r['decoders']:>4} {r['mode']:>6} {r['chunk']:>5} {r['interval_ms']:>11} {r.get('model_ms', '-'):>9}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
