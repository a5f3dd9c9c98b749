"""What a decode replica's step costs when it mixes a prompt's chunk with its decoders: the numbers
the TPOT guard (engine/tpot_guard.py) and the adaptive prefill site (router/prefill_site.py) model.

    python -m pdserve.benchmarks.mixed_step deploy/bench/adaptive/1p1d-adaptive50.yaml \\
        --decoders 32 96 --context 4096 --chunks 0 64 256 1024 2048 [--graph-seqs 128] [--flat-eager]

Builds the decode engine of cluster.yaml (in this process; no overlap, so that a step's wall time is
its own), brings D sequences of --context-token prompts to decoding, then times steps of the D
decoders alone (CUDA graphs) and with one prompt's chunk of P tokens beside them (replayed from a
prefill graph where one holds the step — D + 1 sequences within decode.prefill_graph_max_seqs,
`--graph-seqs`, and D + P tokens within a bucket — else eagerly; the last column says which),
median of the chunk's steps. Also prints what the guard's model forecasts for each
(pdserve/step_cost.py MixedCost, fitted from these steps at each D), so that the model's error
is read off the same run.
"""

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.config import load_cluster_config
from pdserve.engine.engine import Engine
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
    ap.add_argument("--graph-seqs", type=int,
                    help="decode.prefill_graph_max_seqs: sequences a prefill graph holds (a step mixing a "
                         "chunk into more decoders runs eagerly); default: the config's")
    ap.add_argument("--flat-eager", action="store_true",
                    help="an eager mixed step of more than 33 sequences launches its attention over the "
                         "sequences' tiles only (ops/triton_attention.py FLAT_EAGER)")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.flat_eager:
        from pdserve.ops import triton_attention
        triton_attention.FLAT_EAGER = True
    cfg = load_cluster_config(a.config)
    update = {"overlap_scheduling": False, "tpot_guard_ms": None}
    if a.graph_seqs is not None:
        update["prefill_graph_max_seqs"] = a.graph_seqs
    ec = cfg.engine_config("decode").model_copy(update=update)
    engine = Engine(ec)
    vocab = engine.args.vocab_size
    rng = random.Random(0)
    rows, n = [], 0
    for d in a.decoders:
        live = [q for q in engine.seqs.values()]
        for _ in range(d - len(live)):
            n += 1
            engine.add(Request(f"dec{n}", [rng.randrange(3, vocab) for _ in range(a.context)],
                               SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)))
        while any(q.num_tokens - q.num_computed_tokens > 1 for q in engine.seqs.values()):
            engine.step()
        engine.profile.reset()
        for p in a.chunks:
            if p == 0:
                times = [timed_step(engine) for _ in range(12)][2:]
            else:
                n += 1
                rid = f"chunk{n}"
                engine.scheduler.chunk_size = p
                engine.add(Request(rid, [rng.randrange(3, vocab) for _ in range(p * 5)],
                                   SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
                times = []
                graphs = engine.runner.prefill_graphs
                replayed = sum(graphs.replays.values()) if graphs is not None else 0
                while rid in engine.seqs and engine.seqs[rid].num_tokens - engine.seqs[rid].num_computed_tokens > 1:
                    times.append(timed_step(engine))
                graphed = (sum(graphs.replays.values()) if graphs is not None else 0) - replayed
                while rid in engine.seqs:
                    engine.step()
                times = times[1:-1] or times
            rows.append({"decoders": d, "chunk": p, "step_ms": round(1e3 * statistics.median(times), 2),
                         "graphed": "-" if p == 0 else f"{graphed}/{len(times)} steps"})
            print(rows[-1], flush=True)
        snap = engine.profile.snapshot()
        mixed = fit_mixed(snap, fit_phases(snap)[0])
        for r in rows:
            if r["decoders"] == d and mixed:
                r["model_ms"] = round(1e3 * mixed.time(d, r["chunk"]), 2)
        print(f"D={d}: mixed-step fit {mixed}", flush=True)
    print(f"{'D':>4} {'P':>5} {'step ms':>8} {'model ms':>9}  prefill graph")
    for r in rows:
        print(f"{r['decoders']:>4} {r['chunk']:>5} {r['step_ms']:>8} {r.get('model_ms', '-'):>9}  {r['graphed']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
