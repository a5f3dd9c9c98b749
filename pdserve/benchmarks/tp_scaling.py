"""Tensor parallelism on the GPUs of one host: a replica of TP = 2 (or more) against one GPU, the
same engine code, measured in the same run.

    python -m pdserve.benchmarks.tp_scaling [--models deepseek-v2-lite qwen3-30b-a3b] [--tp-sizes 1 2]
        [--prefill 4096] [--batches 1 64 256] [--context 1024] [--json out.json]
    python -m pdserve.benchmarks.tp_scaling --cpu     # dry run: tiny-moe over gloo, tiny sizes

Each (model, tp) is one replica in processes of its own (pdserve/worker/tp_local.py: rank 0's
engine schedules and broadcasts every step, the other ranks follow, NCCL all-reduces inside the
decode CUDA graphs), one colocated engine with dummy bf16 weights:

- prefill: one `--prefill`-token prompt in one step (chunk and budget that size; prefill graphs
  off: a TP rank runs such steps eagerly, and one GPU's graphs stop at 2k tokens), host clock from
  add_request to the first token out, device synchronised on both sides; median of --reps after a
  warm-up.
- decode: B requests placed straight into decode state (`reserve` + `start_decode`, no prefill)
  over `--context` tokens of random KV (every rank's cache filled), a few untimed steps, then
  --steps engine steps back to back (overlap scheduling, as served); the figure is their mean.

The reference is the TP = 1 row of the same model in the same run: `x tp1` is its time over this
row's (above 1: faster). A KV cache sized for the largest batch that does not fit one GPU (the
qwen3-30b-a3b shape on an 80 GB card) falls back to the engine's own sizing; batches it cannot
hold are reported as such.
"""

import argparse
import datetime
import json
import statistics
import time

import torch

from pdserve.messages import Request
from pdserve.benchmarks.step_kernels import profile_step, summary
from pdserve.config import EngineConfig, ModelConfig
from pdserve.protocol import SamplingParams
from pdserve.worker.tp_local import run_replica

BLOCK = 16
_UNTIMED_STEPS = 4  # decode steps before the timed ones (the graphs' buckets, the overlap's first step)
_PREFILL_WARMUP = 3  # untimed prefills first (a TP rank's first few ran 10-20 ms slower on H200s)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(o: dict, num_kv_blocks: int | None) -> EngineConfig:
    longest = max(o["batches"])
    return EngineConfig(
        model=ModelConfig(path=o["model"], dtype=o["dtype"], load_format="dummy", seed=o["seed"]), role="colocated",
        block_size=BLOCK, num_kv_blocks=num_kv_blocks, max_num_seqs=longest,
        max_num_batched_tokens=max(o["prefill"], longest), chunk_size=o["prefill"], enable_prefix_cache=False,
        prefill_graph_max_tokens=0, warm_up=False)


def _lead(replica, o: dict) -> dict:
    """Rank 0 of one replica: both measurements on one engine."""
    t0 = time.perf_counter()
    per_seq = -(-(o["context"] + _UNTIMED_STEPS + o["steps"] + 2) // BLOCK)
    need = max(max(o["batches"]) * per_seq, -(-(o["prefill"] + 1) // BLOCK)) + 1
    engine, sizing = None, "exact"
    try:
        engine = replica.engine(_config(o, need), fill_kv=o["seed"])
    except torch.OutOfMemoryError:
        if replica.size > 1:  # every rank would have to retry alike
            raise
        sizing = "auto"
    if engine is None:  # (outside the handler: its traceback no longer holds the failed engine's memory)
        replica.close(None)
        engine = replica.engine(_config(o, None), fill_kv=o["seed"])
    built_s = time.perf_counter() - t0
    out = {"tp": replica.size, "device": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda"
           else "cpu", "kv_blocks": engine.layout.num_blocks, "kv_sizing": sizing, "build_s": round(built_s, 1),
           "graphs": engine.runner.graphs is not None, "overlap": engine.overlap}
    out["prefill"] = _prefill(engine, o)
    out["decode"] = [_decode(engine, o, b) for b in o["batches"]]
    args = engine.args
    dtype = next(engine.model.parameters()).dtype
    replica.close(engine)
    del engine
    # The same run's reference for what tensor parallelism adds: the step's all-reduces alone (two a
    # layer, [tokens, hidden] in the model's dtype), back to back on the group, eagerly.
    if replica.size > 1:
        count = 2 * args.num_layers
        shape = (o["prefill"], args.hidden_size)
        out["prefill"]["all_reduce_ms"] = round(replica.time_all_reduce(shape, dtype, count), 3)
        for row in out["decode"]:
            row["all_reduce_ms"] = round(replica.time_all_reduce((row["batch"], args.hidden_size), dtype, count), 3)
    return out


def _prefill(engine, o: dict) -> dict:
    n, vocab = o["prefill"], engine.args.vocab_size
    prompt = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(o["seed"])).tolist()
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []

    def once(i):
        engine.add_request(f"prefill-{i}", prompt, params)
        while engine.has_unfinished():  # (overlap: the step after the forward hands the token out)
            engine.step()

    for i in range(_PREFILL_WARMUP + o["reps"]):
        _sync(engine.device)
        t0 = time.perf_counter()
        once(i)
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    times = times[_PREFILL_WARMUP:]
    row = {"tokens": n, "ms": round(statistics.median(times) * 1e3, 2), "all_ms": [round(t * 1e3, 2) for t in times]}
    if o.get("profile") and engine.device.type == "cuda":
        row["profile"] = profile_step(lambda: once("profile"), engine.device)
    return row


def _decode(engine, o: dict, batch: int) -> dict:
    vocab = engine.args.vocab_size
    gen = torch.Generator().manual_seed(o["seed"] + batch)
    prompts = torch.randint(0, vocab, (batch, o["context"]), generator=gen).tolist()
    firsts = torch.randint(0, vocab, (batch,), generator=gen).tolist()
    params = SamplingParams(max_tokens=_UNTIMED_STEPS + o["steps"] + 2, temperature=0, ignore_eos=True)
    row = {"batch": batch, "context": o["context"]}
    try:
        for i, p in enumerate(prompts):
            if engine.reserve(Request(f"d{batch}-{i}", p, params)) is None:
                row["error"] = f"KV cache holds {engine.layout.num_blocks} blocks: batch {batch} does not fit"
                return row
        for i, t in enumerate(firsts):  # the KV of these blocks is whatever the cache holds (random)
            engine.start_decode(f"d{batch}-{i}", t)
        for _ in range(_UNTIMED_STEPS):
            engine.step()
        _sync(engine.device)
        t0 = time.perf_counter()
        outs = [engine.step() for _ in range(o["steps"])]
        _sync(engine.device)
        dt = (time.perf_counter() - t0) / o["steps"]
        assert all(len(x) == batch for x in outs[1:]), "a decode step did not give every request a token"
        row.update(step_ms=round(dt * 1e3, 3), tokens_per_s=round(batch / dt, 1))
        if o.get("profile") and engine.device.type == "cuda":  # (the requests have two steps to go)
            row["profile"] = profile_step(engine.step, engine.device)
        return row
    finally:
        for rid in list(engine.seqs):
            engine.abort(rid)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["deepseek-v2-lite"])
    p.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2], help="the first is the reference")
    p.add_argument("--prefill", type=int, default=4096, help="prompt tokens of the prefill figure")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=1024, help="KV tokens per request when decoding")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps, back to back")
    p.add_argument("--reps", type=int, default=10, help="timed prefills (median)")
    p.add_argument("--profile", action="store_true", help="rank 0's kernels of one prefill and one decode step of each")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900, help="seconds one replica's run may take")
    p.add_argument("--json")
    p.add_argument("--cpu", action="store_true", help="dry run: tiny-moe on the CPU (checks the script, not a figure)")
    a = p.parse_args()
    if a.cpu:
        a.models, a.prefill, a.batches, a.context, a.steps, a.reps, a.dtype = \
            ["tiny-moe"], 64, [1, 4], 32, 4, 2, "float32"
    elif torch.cuda.device_count() < max(a.tp_sizes):
        p.error(f"--tp-sizes {a.tp_sizes} needs {max(a.tp_sizes)} GPUs; {torch.cuda.device_count()} visible")
    results = []
    for model in a.models:
        for tp in a.tp_sizes:
            o = dict(model=model, prefill=a.prefill, batches=a.batches, context=a.context, steps=a.steps,
                     reps=a.reps, dtype=a.dtype, seed=a.seed, profile=a.profile)
            devices = ["cpu"] * tp if a.cpu else [f"cuda:{r}" for r in range(tp)]
            t0 = time.perf_counter()
            try:
                r = run_replica(_lead, o, devices, timeout=a.timeout)
            except Exception as e:  # noqa: BLE001 — one setup failing must not lose the others
                r = {"tp": tp, "error": f"{type(e).__name__}: {e}"[-2000:]}
            r.update(model=model, wall_s=round(time.perf_counter() - t0, 1))
            print(json.dumps(r), flush=True)
            results.append(r)
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
            "device": "cpu" if a.cpu else torch.cuda.get_device_name(0), "args": vars(a)}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    _table(results, meta)


def _table(results: list[dict], meta: dict) -> None:
    print(f"\ntensor parallelism, {meta['device']}, {meta['date']}: ms "
          f"(x tp1 = the first TP size's time over this one's)")
    batches = meta["args"]["batches"]
    head = f"{'model':<18} {'tp':>3} {'prefill ' + str(meta['args']['prefill']):>16}" + \
        "".join(f" {'decode b' + str(b):>18}" for b in batches)
    print(head)
    ref: dict[str, dict] = {}
    for r in results:
        if "error" in r:
            print(f"{r['model']:<18} {r['tp']:>3}  failed: {r['error'].splitlines()[-1][:160]}")
            continue
        base = ref.setdefault(r["model"], r)

        def cell(ms, base_ms) -> str:
            return "-" if ms is None else f"{ms:.2f} (x{base_ms / ms:.2f})" if base_ms else f"{ms:.2f}"

        line = f"{r['model']:<18} {r['tp']:>3} {cell(r['prefill']['ms'], base['prefill']['ms']):>16}"
        for d, bd in zip(r["decode"], base["decode"]):
            line += f" {cell(d.get('step_ms'), bd.get('step_ms')):>18}"
        print(line)
        if "all_reduce_ms" in r["prefill"]:
            print(f"{'  all-reduces alone':<22} {r['prefill']['all_reduce_ms']:>16.2f}"
                  + "".join(f" {d.get('all_reduce_ms', float('nan')):>18.2f}" for d in r["decode"]))
    for r in results:
        for label, p in [("prefill", r.get("prefill", {}).get("profile"))] + \
                [(f"decode b{d['batch']}", d.get("profile")) for d in r.get("decode", [])]:
            if p:
                print(f"{r['model']} tp{r['tp']} " + summary(label, p))


if __name__ == "__main__":
    main()
