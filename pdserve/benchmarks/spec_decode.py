"""What speculative decoding costs and buys in the engine (engine/spec_decode.py): a verify step of
k draft tokens per sequence against a plain decode step, and the speed-up of greedy generation on a
repetitive workload at the acceptance it measures there.

    python -m pdserve.benchmarks.spec_decode --model qwen3-30b-a3b --device cuda \\
        --batches 1 8 32 --k 1 2 3 4 5 6 7 8 --json spec_decode.json
    python -m pdserve.benchmarks.spec_decode --smoke        # tiny-moe on the CPU: checks it runs

One engine (dummy weights, no overlap while timing steps). Verify cost: B sequences of --context
random tokens brought to decoding, then --steps timed steps each (median) of the decoders alone —
the decode graph's replay where one is captured, and eagerly — and with k drafts each (random
tokens, so nearly all rejected: the step's cost, not its yield; verify steps run eagerly). The
drafts come from a fixed drafter, not the n-gram lookup, so every sequence checks exactly k.

Speed-up: B prompts, each a random --period-token passage repeated to --context tokens (text that
repeats itself, n-gram drafting's case), generated greedily for --tokens tokens with speculation off
(overlap scheduling as the engine defaults it) and on (num_tokens = the largest k), in the same
engine: tokens per second of each, their ratio, the acceptance (accepted / drafted), and whether the
tokens were identical (they must be)."""

import argparse
import json
import random
import statistics
import time

import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.messages import Request
from pdserve.protocol import SamplingParams


def _sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _median_step(engine: Engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        _sync(engine)
        t0 = time.perf_counter()
        engine.step()
        _sync(engine)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def verify_cost(engine: Engine, batch: int, ks: list[int], context: int, steps: int, rng: random.Random) -> dict:
    """Seconds of a plain decode step (graphed where captured, and eager) and of a verify step of
    each k, at this batch; the engine's sequences are aborted after."""
    vocab = engine.args.vocab_size
    params = SamplingParams(max_tokens=1_000_000, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add(Request(f"b{batch}-{i}", [rng.randrange(vocab) for _ in range(context)], params))
    engine.scheduler.drafter = None
    while any(q.num_tokens - q.num_computed_tokens > 1 for q in engine.seqs.values()):
        engine.step()
    row = {"batch": batch, "plain_s": _median_step(engine, steps)}
    graphs, engine.runner.graphs = engine.runner.graphs, None
    row["plain_eager_s"] = _median_step(engine, steps)
    engine.runner.graphs = graphs
    for k in ks:
        engine.scheduler.drafter = lambda seq, room, k=k: [rng.randrange(vocab) for _ in range(min(k, room))]
        row[f"verify_k{k}_s"] = _median_step(engine, steps)
    engine.scheduler.drafter = None
    for rid in list(engine.seqs):
        engine.abort(rid)
    return row


def speed_up(engine: Engine, batch: int, context: int, period: int, tokens: int, rng: random.Random,
             overlap_off: bool) -> dict:
    """Greedy generation of repetitive prompts with speculation off and on, in the same engine."""
    vocab = engine.args.vocab_size
    prompts = []
    for _ in range(batch):
        passage = [rng.randrange(vocab) for _ in range(period)]
        prompts.append((passage * (context // period + 1))[:context])
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    # Warm-up prompts of their own (the timed ones then hit no cached prefix): each mode's first
    # generation at this batch pays its first uses (the verify rows of every draft length the
    # lookup proposes, not only the k timed above) outside the timing.
    warm = [[rng.randrange(vocab) for _ in range(period)] * (context // period + 1) for _ in range(batch)]
    warm_params = SamplingParams(max_tokens=min(tokens, 32), temperature=0, ignore_eos=True)
    out = {"batch": batch}
    results = {}
    for name, speculate in (("off", False), ("on", True)):
        engine.scheduler.drafter = engine.drafting.propose if speculate else None
        engine.overlap = False if speculate else overlap_off
        engine.generate([w[:context] for w in warm], warm_params)
        before = engine.profile.snapshot()
        _sync(engine)
        t0 = time.perf_counter()
        done = engine.generate(prompts, params)
        _sync(engine)
        seconds = time.perf_counter() - t0
        after = engine.profile.snapshot()
        results[name] = [c.token_ids for c in done]
        out[f"{name}_tokens_per_s"] = batch * tokens / seconds
        # Where the wall time went: the engine's steps by kind (their seconds as the engine times
        # them, host work of the step included) against the whole generation.
        for kind in ("decode", "verify", "prefill"):
            rows = [[a - b for a, b in zip(row, before[kind].get(bucket, [0] * len(row)))]
                    for bucket, row in after[kind].items()]
            out[f"{name}_{kind}_steps"] = sum(r[0] for r in rows)
            out[f"{name}_{kind}_s"] = sum(r[-1] for r in rows)
        out[f"{name}_wall_s"] = seconds
        if speculate:
            drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            out["drafted"], out["accepted"] = drafted, accepted
            out["acceptance"] = accepted / drafted if drafted else 0.0
    out["speed_up"] = out["on_tokens_per_s"] / out["off_tokens_per_s"]
    out["identical"] = results["on"] == results["off"]
    engine.scheduler.drafter = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a preset or checkpoint (dummy weights)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--k", type=int, nargs="+", default=list(range(1, 9)))
    ap.add_argument("--context", type=int, default=512, help="prompt tokens of each sequence")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per figure (median)")
    ap.add_argument("--period", type=int, default=64, help="the repeated passage's length (speed-up)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per sequence (speed-up)")
    ap.add_argument("--smoke", action="store_true", help="tiny-moe on the CPU, small sizes: checks the script runs")
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.smoke:
        a.model, a.device, a.batches, a.k, a.context, a.steps, a.period, a.tokens = \
            "tiny-moe", "cpu", [1, 2], [1, 2], 32, 2, 8, 8
    engine = Engine(EngineConfig(
        model=ModelConfig(path=a.model, load_format="dummy"), device=a.device, overlap_scheduling=False,
        max_num_seqs=max(a.batches), speculative={"method": "ngram", "num_tokens": max(a.k)}))
    default_overlap = engine.device.type == "cuda"  # what the engine does without speculation
    rng = random.Random(0)
    report = {"model": a.model, "device": torch.cuda.get_device_name(engine.device) if a.device.startswith("cuda")
              else "cpu", "context": a.context, "verify": [], "speed_up": []}
    for b in a.batches:
        row = verify_cost(engine, b, a.k, a.context, a.steps, rng)
        report["verify"].append(row)
        ratios = "  ".join(f"k={k} {row[f'verify_k{k}_s'] * 1e3:.2f} ms ({row[f'verify_k{k}_s'] / row['plain_s']:.2f}x)"
                           for k in a.k)
        print(f"batch {b}: plain {row['plain_s'] * 1e3:.2f} ms (eager {row['plain_eager_s'] * 1e3:.2f} ms); {ratios}",
              flush=True)
    for b in a.batches:
        row = speed_up(engine, b, a.context, a.period, a.tokens, rng, default_overlap)
        report["speed_up"].append(row)
        print(f"batch {b}: off {row['off_tokens_per_s']:.1f} tok/s, on {row['on_tokens_per_s']:.1f} tok/s "
              f"({row['speed_up']:.2f}x), acceptance {row['acceptance']:.2f} ({row['accepted']}/{row['drafted']}), "
              f"identical: {row['identical']}", flush=True)
        for m in ("off", "on"):
            steps = ", ".join(f"{kind} {row[f'{m}_{kind}_steps']} in {row[f'{m}_{kind}_s'] * 1e3:.1f} ms"
                              for kind in ("prefill", "decode", "verify") if row[f"{m}_{kind}_steps"])
            print(f"  {m}: {row[f'{m}_wall_s'] * 1e3:.1f} ms in all; steps: {steps}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
