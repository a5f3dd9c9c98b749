"""Decode throughput of expert-parallel replicas (EP = N) against one single-GPU replica and two
independent single-GPU replicas, and the MoE exchange per layer against NCCL's all-to-all rate
measured in the same run.

    python -m pdserve.benchmarks.ep_decode [--ep-sizes 2 4] [--batches 64 128 256 512] [--json out.json]
    python -m pdserve.benchmarks.ep_decode --cpu     # dry run: tiny-moe, gloo, tiny batches

Every worker is an engine in the decode role fed through `reserve` + `start_decode` (no prefill:
the KV cache is filled with random values, which cost the same to read, and every request gets
random prompt and first-token ids, so that the requests' hidden states differ and the routers
spread them over the experts as a real batch does). `--kv zeros` keeps the cache zeroed, with the
same first token for every request, as the first runs did (docs/benchmarks-history.md): every request
then computes the same hidden state and all pick the same 8 experts per layer (the `experts_hit`
column says so). `--batches` are per GPU: the single replica and
each independent replica decode B requests, each EP rank B requests (N·B in the replica). Every
request has `--context` tokens of context and never finishes during the measurement. Shape:
qwen3-30b-a3b (dummy bf16 weights) on GPUs. Needs max(2, N) GPUs (the single replica uses the first).
Decode steps replay CUDA graphs up to batch --graph-max-batch per GPU (512, the engine default) unless --no-graphs:
single-GPU replicas always, EP ranks on the all-gather path (the graphs hold the exchange); the all-to-all path is eager.
Scaling: `epN_<path>_vs_linear` is the EP replica's tokens/s over N times the single GPU's.
"""

import argparse
import datetime
import json
import multiprocessing as mp
import time
import traceback

import torch
import torch.distributed as dist

from pdserve.messages import Request
from pdserve.config import EngineConfig, ModelConfig
from pdserve.protocol import SamplingParams

SETUPS = ("single", "pair", "ep")  # one GPU | two independent GPUs | one EP replica per --ep-sizes
# The EP replica decodes once with each exchange path forced (decode.ep_threshold 0 or "never").
PATHS = {"all_gather": 2**62, "all_to_all": 0}
_COUNT_STEPS = 2  # eager decode steps with the routers hooked, before the warm-up


def _size(setup: str) -> int:
    """Worker processes (GPUs) of a setup: single, pair, ep2, ep4, ..."""
    return {"single": 1, "pair": 2}.get(setup) or int(setup.removeprefix("ep"))


class _NoExperts:
    """A MoE backend that computes nothing: times the exchange alone."""

    def forward(self, x, w13, w2, topk_weights, topk_ids):
        return torch.zeros_like(x)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(opts, device: torch.device, ep=None):
    from pdserve.engine.engine import Engine

    max_len = opts.context + opts.warmup + opts.steps + 2
    blocks = max(opts.batches) * -(-max_len // 16) + 16
    model = ModelConfig(path=opts.model, dtype=opts.dtype, load_format="dummy")
    engine = Engine(EngineConfig(model=model, role="decode", device=str(device), num_kv_blocks=blocks,
                                 max_num_seqs=max(opts.batches), enable_prefix_cache=False,
                                 cuda_graphs=not opts.no_graphs, cuda_graph_max_batch=opts.graph_max_batch,
                                 overlap_scheduling={"auto": None, "on": True, "off": False}[opts.overlap]), ep=ep)
    if opts.kv == "random":  # each rank its own values: its requests' contexts differ from the others'
        rank = ep.rank if ep is not None else 0
        engine.kv_cache.normal_(generator=torch.Generator(device).manual_seed(opts.seed + rank))
    return engine


def _decode_rate(engine, group, batch: int, opts) -> dict:
    """Tokens per second of `batch` requests decoding together on this worker."""
    from pdserve.decode.ep_group import RUNNING

    from pdserve.benchmarks.bench_engine import experts_hit_per_layer

    args = engine.model.args
    params = SamplingParams(max_tokens=_COUNT_STEPS + opts.warmup + opts.steps + 2, temperature=0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    gen = torch.Generator().manual_seed(opts.seed + 1000 * batch + (group.rank if group else 0))
    vocab = min(args.vocab_size, 256)  # byte ids: every preset's tokenizer has them
    for i, rid in enumerate(ids):
        if opts.kv == "random":
            prompt = torch.randint(0, vocab, (opts.context,), generator=gen).tolist()
            first = int(torch.randint(0, vocab, (1,), generator=gen))
        else:
            prompt, first = [2 + i % 200] + [1] * (opts.context - 1), 1
        assert engine.reserve(Request(rid, prompt, params)) is not None, "KV cache too small"
        engine.start_decode(rid, first)

    def step():
        return group.step(engine, RUNNING) if group else engine.step()

    # A few steps run eagerly on every rank (the same steps: the ranks stay in lockstep) with the
    # routers hooked: how many distinct experts a step's batch hits per layer (a graph replay
    # runs no hooks).
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        hit = experts_hit_per_layer(engine.model, lambda: [step() for _ in range(_COUNT_STEPS)], batch,
                                    args.num_experts_per_tok, args.num_experts)
    finally:
        engine.runner.graphs = graphs
    for _ in range(opts.warmup):
        step()
    load0 = _served_per_rank(group) if group else None
    _sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(opts.steps):
        step()
    _sync(engine.device)
    dt = time.perf_counter() - t0
    out = {"tok_s": batch * opts.steps / dt, "step_ms": 1e3 * dt / opts.steps, "experts_hit": hit or 0.0}
    if group:
        served = _served_per_rank(group) - load0
        out["rank_load"] = (served.max() / served.mean()).item() if served.sum() else 0.0
    for rid in ids:
        engine.abort(rid)
    return out


def _served_per_rank(group) -> torch.Tensor:
    """(token, expert) pairs each rank's experts served since start, over all ranks' tokens and
    every MoE layer (float64, host). Their max over their mean is the replica's load imbalance:
    the busiest rank's expert work sets the lockstep step's pace."""
    ex = group.exchange
    routed = (ex.tokens_total + ex.tokens_step).double()  # this rank's tokens, per expert
    dist.all_reduce(routed)  # every rank's tokens
    homes = torch.tensor([ex.placement.home(e) for e in range(ex.placement.num_experts)], device=routed.device)
    return torch.zeros(group.size, dtype=torch.float64, device=routed.device).index_add_(0, homes, routed).cpu()


def _time_us(fn, device: torch.device, reps: int) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return 1e6 * (time.perf_counter() - t0) / reps


def _exchange_times(group, engine, batch: int, opts) -> dict:
    """One MoE layer of `batch` tokens per rank on each path: experts + exchange, exchange alone;
    and NCCL's (gloo's) all_to_all_single moving the same tokens, as the link's rate."""
    moe, ex, dev = engine.model.moe_layers()[0], group.exchange, engine.device
    h, dtype = moe.w13.shape[2], moe.w13.dtype
    g = torch.Generator(device=dev).manual_seed(group.rank)
    x = 0.1 * torch.randn(batch, h, generator=g, device=dev).to(dtype)
    weights, ids = moe.backend.route(torch.randn(batch, moe.num_experts, generator=g, device=dev), moe.top_k, True)
    out = {}
    for path in opts.paths:
        ex.threshold = PATHS[path]
        ex.begin_step(batch)  # eager: times the exchange's own launches
        for what, backend in (("moe", moe.backend), ("exchange", _NoExperts())):
            dist.barrier()
            out[f"{path}_{what}_us"] = _time_us(lambda: ex.forward(x, moe.w13, moe.w2, weights, ids, backend),
                                                dev, opts.reps)
    # The tokens themselves, B rows to each rank: what the all-to-all path's dispatch moves at most.
    send = x.repeat(group.size, 1)
    recv = torch.empty_like(send)
    dist.barrier()
    us = _time_us(lambda: dist.all_to_all_single(recv, send), dev, opts.reps)
    off_rank = batch * (group.size - 1) * h * x.element_size()
    out.update(a2a_us=us, a2a_gb_s=off_rank / us / 1e3)
    return out


def _worker(rank: int, setup: str, opts, store_port: int, results) -> None:
    try:
        torch.set_num_threads(opts.threads)
        device = torch.device("cpu" if opts.cpu else f"cuda:{rank}")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = None
        if setup.startswith("ep"):
            from pdserve.decode.ep_group import EPGroup, EPRank
            from pdserve.models import resolve_model_args

            # Created on the all-gather path: the engine captures its graphs below this threshold.
            group = EPGroup(EPRank(rank, _size(setup), "127.0.0.1", store_port, PATHS["all_gather"]),
                            resolve_model_args(opts.model).num_experts, device)
        engine = _engine(opts, device, group.exchange if group else None)
        rows = []
        for b in opts.batches:
            if group is None:
                rows.append({"batch": b, **_decode_rate(engine, None, b, opts)})
                continue
            row = {"batch": b}
            for path in opts.paths:
                threshold = PATHS[path]
                group.exchange.threshold = threshold
                row.update({f"{path}_{k}": v for k, v in _decode_rate(engine, group, b, opts).items()})
            rows.append({**row, **_exchange_times(group, engine, b, opts)})
        results.put((rank, rows))  # before close: see EPGroup.close
        if group:
            group.close()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def _run(setup: str, opts) -> list[list[dict]]:
    """Each worker's rows for one setup; the workers of a setup run at the same time."""
    from pdserve.worker.rendezvous import rendezvous_store

    n = _size(setup)
    store = rendezvous_store("127.0.0.1")  # the workers' rendezvous, held here (port 0) until they are done
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, setup, opts, store.port, results)) for r in range(n)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, rows = results.get()
        if isinstance(rows, str):
            for p in procs:
                p.kill()
            raise RuntimeError(f"{setup} worker {rank} failed:\n{rows}")
        got[rank] = rows
    for p in procs:
        p.join()
    return [got[r] for r in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="dry run on the CPU: tiny-moe, gloo, tiny batches")
    ap.add_argument("--model", help="preset or model directory (default: qwen3-30b-a3b; --cpu: tiny-moe)")
    ap.add_argument("--batches", type=int, nargs="+", help="requests per GPU (default 64 128 256 512; --cpu: 2 4)")
    ap.add_argument("--context", type=int, help="context tokens per request (default 1024; --cpu: 64)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32; --cpu: 4)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--reps", type=int, default=None, help="repetitions of each exchange timing (default 50; --cpu: 5)")
    ap.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    ap.add_argument("--ep-sizes", type=int, nargs="+", default=[2], help="ranks of each EP replica measured")
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS),
                    help="exchange paths each EP replica decodes with")
    ap.add_argument("--no-graphs", action="store_true", help="every replica decodes eagerly")
    ap.add_argument("--graph-max-batch", type=int, default=EngineConfig.model_fields["cuda_graph_max_batch"].default,
                    help="largest decode batch captured in CUDA graphs (default: the engine's, %(default)s)")
    ap.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                    help="the engines' overlap_scheduling (auto: on a GPU; default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker (CPU)")
    ap.add_argument("--kv", choices=["random", "zeros"], default="random",
                    help="random: random KV and token ids (realistic routing); zeros: the zeroed cache and "
                         "one first token for every request, as the first runs had (collapsed routing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    opts = ap.parse_args(argv)
    cpu = opts.cpu
    opts.model = opts.model or ("tiny-moe" if cpu else "qwen3-30b-a3b")
    opts.batches = opts.batches or ([2, 4] if cpu else [64, 128, 256, 512])
    opts.context = opts.context or (64 if cpu else 1024)
    opts.steps = opts.steps or (4 if cpu else 32)
    opts.reps = opts.reps or (5 if cpu else 50)
    opts.warmup = min(opts.warmup, 1) if cpu else opts.warmup
    opts.dtype = "float32" if cpu else "bfloat16"
    setups = [s for s in opts.setups if s != "ep"] + ([f"ep{n}" for n in opts.ep_sizes] if "ep" in opts.setups else [])
    need = max(_size(s) for s in setups)
    if not cpu and torch.cuda.device_count() < need:
        raise SystemExit(f"needs {need} GPUs, found {torch.cuda.device_count()} (or run --cpu)")

    per_setup = {}
    for setup in setups:
        print(f"{setup}: running ...", flush=True)
        per_setup[setup] = _run(setup, opts)
        print(f"{setup}: " + json.dumps([{k: round(v, 1) for k, v in r.items()} for r in per_setup[setup][0]]), flush=True)
    rows = [_row(i, b, per_setup, opts.paths) for i, b in enumerate(opts.batches)]
    meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "model": opts.model,
            "gpus": torch.cuda.device_count() if not cpu else 0,
            "dtype": opts.dtype, "context": opts.context, "kv": opts.kv, "steps": opts.steps, "graphs": not opts.no_graphs,
            "device": "cpu" if cpu else torch.cuda.get_device_name(0),
            "nccl": None if cpu else ".".join(map(str, torch.cuda.nccl.version()))}
    _print(rows, per_setup, opts.paths)
    print(json.dumps(meta))
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def _row(i: int, batch: int, per_setup: dict, paths: list[str]) -> dict:
    """Batch i's figures: tokens/s of each setup (summed over its workers), EP ratios, exchange times."""
    row = {"batch_per_gpu": batch}
    for setup, workers in per_setup.items():
        ep = setup.startswith("ep")
        for name in ([f"{p}_" for p in paths] if ep else [""]):
            label = f"{setup}_{name}".rstrip("_")
            row[f"{label}_tok_s"] = round(sum(w[i][f"{name}tok_s"] for w in workers), 1)
            row[f"{label}_step_ms"] = round(max(w[i][f"{name}step_ms"] for w in workers), 2)
            row[f"{label}_experts_hit"] = round(sum(w[i][f"{name}experts_hit"] for w in workers) / len(workers), 1)
            if ep:
                row[f"{label}_rank_load"] = round(workers[0][i][f"{name}rank_load"], 3)
            for base in ("single", "pair"):
                if ep and base in per_setup:
                    row[f"{label}_vs_{base}"] = round(row[f"{label}_tok_s"] / row[f"{base}_tok_s"], 2)
            if ep and "single" in per_setup:
                row[f"{label}_vs_linear"] = round(row[f"{label}_tok_s"] / (_size(setup) * row["single_tok_s"]), 2)
        if ep:  # the exchange as rank 0 of this replica sees it
            row.update({f"{setup}_{k}": round(v, 1) for k, v in workers[0][i].items() if k.endswith(("_us", "_gb_s"))})
    return row


def _print(rows: list[dict], per_setup: dict, paths: list[str]) -> None:
    cols = [c for c in rows[0] if c.endswith(("_tok_s", "_vs_single", "_vs_pair", "_vs_linear", "_experts_hit",
                                             "_rank_load"))]
    print("\n" + " ".join(f"{c:>{max(9, len(c))}}" for c in ["batch_per_gpu", *cols]))
    for r in rows:
        print(" ".join(f"{r[c]:>{max(9, len(c))}}" for c in ["batch_per_gpu", *cols]))
    for setup in (s for s in per_setup if s.startswith("ep")):
        print(f"\n{setup}: MoE layer on rank 0, per call (us): experts + exchange | exchange alone; "
              "all_to_all_single of the tokens (us, off-rank GB/s)")
        for r in rows:
            cells = "   ".join(f"{p} {r[f'{setup}_{p}_moe_us']:>9} | {r[f'{setup}_{p}_exchange_us']:>8}" for p in paths)
            print(f"{r['batch_per_gpu']:>9}  {cells}   a2a {r[f'{setup}_a2a_us']:>8} us {r[f'{setup}_a2a_gb_s']:>7} GB/s")


if __name__ == "__main__":
    main()
