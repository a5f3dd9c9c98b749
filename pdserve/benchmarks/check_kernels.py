"""Checks and times the GPU kernels (pdserve/ops) on qwen3-30b-a3b shapes, bf16, on one GPU.

    python -m pdserve.benchmarks.check_kernels [--json out.json] [--sweep] [--only moe,decode,...]
    python -m pdserve.benchmarks.check_kernels --preset deepseek-v2-lite     (MLA, MoE, routing, norms)

First the two ceilings of this GPU, measured in the same run: the HBM copy rate (a 1 GiB
device-to-device copy, read + write counted) and the bf16 matmul rate (8192^3, random data).
Then, per kernel and shape: ‖out − ref‖ / ‖ref‖ against the torch reference run in float32 on the
same (upcast) inputs, the median time of ours and of the torch reference in bf16
(triton.testing.do_bench; inputs rotated over several copies where one would sit in L2), and the
floor max(bytes / copy rate, flops / matmul rate), bytes being each input read once and each
output written once. Rows marked "graph" time the calls replayed from a CUDA graph (as the decode step
runs them: no host launch overhead; the eager time is in the note); the small-batch rows show the old
path (separate KV write / moe_align fused MoE) beside the new one (fused KV write / GEMV MoE). Every
check runs inside its own try/except: a failure prints its traceback
and the rest still run. The table comes last; --json (default $OUT/check_kernels.json when $OUT
is set) keeps every number.
"""

import argparse
import copy
import itertools
import json
import math
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.models import resolve_model_args
from pdserve.ops.testing import random_moe_inputs, random_paged_case, rel_err

BLOCK = 16
L2_BYTES = 256 << 20  # rotate inputs over copies until they span this much: well past any L2


@dataclass
class Row:
    kernel: str
    shape: str
    err: float | None = None  # ours against the float32 reference
    ours_us: float | None = None
    torch_us: float | None = None
    floor_us: float | None = None
    bytes: float = 0.0
    flops: float = 0.0
    note: str = ""


class Checker:
    def __init__(self, device: torch.device):
        self.device = device
        self.rows: list[Row] = []
        self.failures: list[str] = []
        self.copy_rate = self.matmul_rate = float("nan")
        self.last_graph = None

    # -- measuring -----------------------------------------------------------------------------

    def bench(self, fn: Callable[[], object]) -> float:
        """Median microseconds of fn (device events, warm-up first)."""
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3

    def bench_graph(self, fn: Callable[[], object], calls: int = 1) -> float:
        """Median microseconds per call of fn replayed from a CUDA graph; fn makes `calls` calls.
        Warm-up (compiles) on a side stream first, as torch.cuda.graph requires."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        t = self.bench(graph.replay) / calls
        self.last_graph = graph  # kept until the next capture: a check can replay it
        return t

    def ceilings(self) -> None:
        n = 1 << 29  # 1 GiB of bf16
        src = torch.randn(n, device=self.device, dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t = self.bench(lambda: dst.copy_(src))
        self.copy_rate = 2 * n * 2 / (t * 1e-6)
        del src, dst
        a = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=self.device, dtype=torch.bfloat16)
        t = self.bench(lambda: a @ b)
        self.matmul_rate = 2 * 8192 ** 3 / (t * 1e-6)
        print(f"HBM copy {self.copy_rate / 1e12:.2f} TB/s, bf16 matmul {self.matmul_rate / 1e12:.0f} TFLOP/s")

    def floor_us(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.copy_rate, flops / self.matmul_rate) * 1e6

    def add(self, row: Row) -> None:
        row.floor_us = self.floor_us(row.bytes, row.flops)
        self.rows.append(row)
        print(_fmt(row), flush=True)

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.failures.append(name)
            print(f"!! {name} failed:\n{traceback.format_exc()}", flush=True)
        torch.cuda.empty_cache()


def _fmt(r: Row) -> str:
    def num(x, f):
        return f"{x:{f}}" if x is not None and not math.isnan(x) else "-"
    ratio = r.ours_us / r.floor_us if r.ours_us and r.floor_us else None
    speed = r.torch_us / r.ours_us if r.ours_us and r.torch_us else None
    return (f"{r.kernel:<22} {r.shape:<26} {num(r.err, '.1e'):>8} {num(r.ours_us, '.1f'):>9} "
            f"{num(r.torch_us, '.1f'):>9} {num(r.floor_us, '.1f'):>8} {num(ratio, '.2f'):>7} "
            f"{num(speed, '.2f'):>7}  {r.note}")


HEADER = (f"{'kernel':<22} {'shape':<26} {'rel err':>8} {'ours us':>9} {'torch us':>9} {'floor us':>8} "
          f"{'x floor':>7} {'vs torch':>7}")


def _copies(nbytes: float) -> int:
    return max(1, min(32, math.ceil(L2_BYTES / max(nbytes, 1))))


def _cycle(fn: Callable[[int], object], n: int) -> Callable[[], object]:
    it = itertools.cycle(range(n))
    return lambda: fn(next(it))


def _gen(device, seed):
    return torch.Generator(device=device).manual_seed(seed)


# -- attention ---------------------------------------------------------------------------------------

def check_write_kv(c: Checker, a, tokens: int) -> None:
    from pdserve.ops.attention import write_kv
    from pdserve.ops.kv_write import write_kv_triton

    g, dev, kvh, d = _gen(c.device, 1), c.device, a.num_kv_heads, a.head_dim
    blocks = math.ceil(tokens / BLOCK) * 4
    cache = torch.randn(2, blocks, BLOCK, kvh, d, generator=g, device=dev).to(torch.bfloat16)
    slots = torch.randperm(blocks * BLOCK, device=dev)[:tokens]
    nbytes = 2 * 2 * tokens * kvh * d * 2 + tokens * 8
    n = _copies(nbytes)
    ks = [torch.randn(tokens, kvh, d, generator=g, device=dev).to(torch.bfloat16) for _ in range(n)]
    ref = cache.clone()
    write_kv(ref, ks[0], ks[0], slots)
    write_kv_triton(cache, ks[0], ks[0], slots)
    err = 0.0 if torch.equal(cache, ref) else rel_err(cache, ref)
    c.add(Row("write_kv", f"T={tokens}", err,
              c.bench(_cycle(lambda i: write_kv_triton(cache, ks[i], ks[i], slots), n)),
              c.bench(_cycle(lambda i: write_kv(ref, ks[i], ks[i], slots), n)), bytes=nbytes))


def _attention_step(c: Checker, a, seqs: list[tuple[int, int]], name: str, splits: int | None = None,
                    note: str = "", backend=None, graph: bool = False, torch_us: float | None = None) -> float:
    from pdserve.ops.attention import TorchAttention
    from pdserve.ops.triton_attention import TritonAttention

    h, kvh, d = a.num_heads, a.num_kv_heads, a.head_dim
    case = random_paged_case(seqs, h, kvh, d, BLOCK, torch.bfloat16, c.device, _gen(c.device, 2))
    scale = d ** -0.5
    ours_backend = backend or TritonAttention(decode_splits=splits)
    # Correctness: ours on the NaN-poisoned cache against the reference in float32.
    ref_cache = case.ref_batch.kv_cache.float()
    ref_batch = ForwardBatch(**{**case.ref_batch.__dict__, "kv_cache": ref_cache})
    ref = TorchAttention().forward(0, case.q.float(), case.k.float(), case.v.float(), ref_batch, scale)
    out = ours_backend.forward(0, case.q, case.k, case.v, case.batch, scale)
    err = rel_err(out, ref)
    del ref_cache, ref_batch, ref
    # Timing: the whole backend step (KV write + attention) over a cache of several layers.
    t = case.q.shape[0]
    ctx_tokens = sum(ctx for ctx, _ in seqs)
    kv_read = 2 * ctx_tokens * kvh * d * 2
    nbytes = kv_read + 2 * t * h * d * 2 + 2 * t * kvh * d * 2
    flops = sum(4 * h * d * (n * (n + 1) // 2 + n * (ctx - n)) for ctx, n in seqs)
    layers = _copies(kv_read)
    cache = torch.randn((layers,) + tuple(case.batch.kv_cache.shape[1:]), device=c.device, dtype=torch.bfloat16)
    batch = ForwardBatch(**{**case.ref_batch.__dict__, "kv_cache": cache})
    q, k, v = case.q, case.k, case.v
    ours = c.bench(_cycle(lambda i: ours_backend.forward(i, q, k, v, batch, scale), layers))
    if graph:  # every layer's call in one graph: the launch gaps of a captured decode step
        eager, ours = ours, c.bench_graph(lambda: [ours_backend.forward(i, q, k, v, batch, scale)
                                                   for i in range(layers)], layers)
        note = f"graph; eager {eager:.1f}" + (f"; {note}" if note else "")
    theirs = torch_us if torch_us is not None else c.bench(
        _cycle(lambda i: TorchAttention().forward(i, q, k, v, batch, scale), layers))
    c.add(Row(name, _seq_shape(seqs), err, ours, theirs, bytes=nbytes, flops=flops, note=note))
    return theirs


def _seq_shape(seqs: list[tuple[int, int]]) -> str:
    kinds = sorted(set(seqs))
    if len(kinds) == 1:
        ctx, n = kinds[0]
        return f"{len(seqs)}x(ctx {ctx}, new {n})"
    return ", ".join(f"({ctx},{n})" for ctx, n in seqs[:3]) + ("..." if len(seqs) > 3 else "")


def check_decode(c: Checker, a, batch: int, ctx: int, splits: int | None = None) -> None:
    note = f"splits={splits}" if splits else ""
    _attention_step(c, a, [(ctx, 1)] * batch, "decode attn+write", splits, note)


def check_decode_old_new(c: Checker, a, batch: int, ctx: int) -> None:
    """The old decode path (separate KV write launch, splits of >= 256 keys) beside the new one
    (KV write fused into the decode kernel, splits of >= 64 keys), both replayed from a CUDA graph."""
    from pdserve.ops.decode_attention import decode_num_splits
    from pdserve.ops.triton_attention import TritonAttention

    seqs = [(ctx, 1)] * batch
    old_splits = decode_num_splits(batch, a.num_kv_heads, ctx, c.device, min_keys_per_split=256)
    new_splits = decode_num_splits(batch, a.num_kv_heads, ctx, c.device)
    theirs = _attention_step(c, a, seqs, "decode OLD write+attn", graph=True, note=f"splits={old_splits}",
                             backend=TritonAttention(fuse_kv_write=False, min_keys_per_split=256))
    _attention_step(c, a, seqs, "decode NEW fused write", graph=True, note=f"splits={new_splits}",
                    backend=TritonAttention(), torch_us=theirs)


def sweep_decode(c: Checker, a, batch: int, ctx: int) -> None:
    from pdserve.ops.triton_attention import TritonAttention

    theirs = None
    for splits in (1, 2, 4, 8, 16, 32):
        if ctx / splits < 32:
            continue
        theirs = _attention_step(c, a, [(ctx, 1)] * batch, "sweep decode fused", graph=True,
                                 note=f"splits={splits}", backend=TritonAttention(decode_splits=splits),
                                 torch_us=theirs)


def check_prefill(c: Checker, a, seqs: list[tuple[int, int]]) -> None:
    _attention_step(c, a, seqs, "prefill attn+write")


def check_mla(c: Checker, a, seqs: list[tuple[int, int]], splits: int | None = None, graph: bool = False) -> None:
    """TritonAttention.forward_mla (a decode step: q absorbed, the latent kernel with its fused
    write, W_UV; other steps: their rows absorbed or expanded) over a latent cache, against
    TorchAttention.forward_mla (the latents up-projected every step)."""
    from pdserve.models.mla import MLAttention
    from pdserve.ops.attention import TorchAttention
    from pdserve.ops.triton_attention import TritonAttention

    g = _gen(c.device, 3)
    dim, qk = a.kv_lora_rank + a.qk_rope_head_dim, a.qk_nope_head_dim + a.qk_rope_head_dim
    layer = MLAttention(a, 0, TorchAttention(), None).to(c.device, torch.bfloat16)
    layer.kv_b_proj.weight.data.normal_(0, a.kv_lora_rank ** -0.5, generator=g)
    case = random_paged_case(seqs, a.num_heads, 1, dim, BLOCK, torch.bfloat16, c.device, g, planes=1, q_dim=qk)
    q, latent, scale = case.q, case.latent, qk ** -0.5
    ours = TritonAttention(decode_splits=splits)
    ref_batch = ForwardBatch(**{**case.ref_batch.__dict__, "kv_cache": case.ref_batch.kv_cache.float()})
    ref = TorchAttention().forward_mla(0, q.float(), latent.float(), ref_batch, scale, copy.deepcopy(layer).float())
    err = rel_err(ours.forward_mla(0, q, latent, case.batch, scale, layer), ref)
    del ref_batch, ref
    ctx_tokens = sum(ctx for ctx, _ in seqs)
    kv_read = ctx_tokens * dim * 2
    t = q.shape[0]
    nbytes = kv_read + layer.kv_b_proj.weight.numel() * 2 + t * (a.num_heads * (qk + a.v_head_dim) + dim) * 2
    decode = all(n == 1 for _, n in seqs)
    # Useful FLOPs of the form each row runs in: absorbed (q·[c, k_rope] and p·c per head and key,
    # plus W_UK and W_UV per query) or expanded (kv_b over the context, then q·k and p·v).
    rank, h = a.kv_lora_rank, a.num_heads
    flops = sum(2 * h * ctx * (dim + rank) + 2 * h * rank * (a.qk_nope_head_dim + a.v_head_dim) if n == 1 else
                2 * ctx * rank * h * (a.qk_nope_head_dim + a.v_head_dim)
                + 2 * h * (qk + a.v_head_dim) * (n * (n + 1) // 2 + n * (ctx - n)) for ctx, n in seqs)
    layers = _copies(kv_read)
    cache = torch.randn((layers,) + tuple(case.batch.kv_cache.shape[1:]), device=c.device, dtype=torch.bfloat16)
    batch = ForwardBatch(**{**case.ref_batch.__dict__, "kv_cache": cache})
    mine = c.bench(_cycle(lambda i: ours.forward_mla(i, q, latent, batch, scale, layer), layers))
    note = f"splits={splits}" if splits else ""
    if graph and decode:
        eager, mine = mine, c.bench_graph(lambda: [ours.forward_mla(i, q, latent, batch, scale, layer)
                                                   for i in range(layers)], layers)
        note = f"graph; eager {eager:.1f}" + (f"; {note}" if note else "")
    theirs = c.bench(_cycle(lambda i: TorchAttention().forward_mla(i, q, latent, batch, scale, layer), layers))
    c.add(Row("mla decode" if decode else "mla step", _seq_shape(seqs), err, mine, theirs, bytes=nbytes, flops=flops,
              note=note))


# -- MoE ---------------------------------------------------------------------------------------------

def check_moe(c: Checker, a, tokens: int) -> None:
    from pdserve.ops.fused_moe import fused_moe
    from pdserve.ops.gemv_moe import gemv_moe
    from pdserve.ops.grouped_mm_moe import grouped_mm_moe
    from pdserve.ops.moe import TorchMoE, route
    from pdserve.ops.triton_moe import TritonMoE

    e, k, hid, inter = a.num_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size
    g = _gen(c.device, 3)
    x, w13, w2, logits = random_moe_inputs(tokens, e, hid, inter, torch.bfloat16, c.device, g)
    weights, ids = route(logits, k, True)
    ref = TorchMoE().forward(x.float(), w13.float(), w2.float(), weights, ids)
    touched = int(torch.unique(ids).numel())
    nbytes = touched * 3 * inter * hid * 2 + 2 * tokens * hid * 2
    flops = 2 * tokens * k * 3 * inter * hid
    # A second copy of the weights: one layer's touched experts can sit in L2 at small T.
    w13b, w2b = w13.clone(), w2.clone()
    sets = [(w13, w2), (w13b, w2b)]
    backend = TritonMoE()
    theirs = c.bench(_cycle(lambda i: TorchMoE().forward(x, *sets[i], weights, ids), 2))
    # Triton paths: timed from a CUDA graph (both weight copies in one graph), the error read from
    # the graph's own output (poisoned before the replay); grouped_mm eager, as before.
    fns = [("moe fused (triton)", fused_moe, True)]
    if tokens <= 16:
        fns.append(("moe gemv (triton)", gemv_moe, True))
    if tokens >= 64:
        fns.append(("moe grouped_mm", grouped_mm_moe, False))
    for name, fn, graph in fns:
        note = f"{touched} experts touched"
        if graph:
            outs = [torch.empty_like(x) for _ in sets]
            eager = c.bench(_cycle(lambda i, fn=fn: fn(x, *sets[i], weights, ids, out=outs[i]), 2))
            ours = c.bench_graph(lambda fn=fn: [fn(x, *sets[i], weights, ids, out=outs[i]) for i in range(2)], 2)
            outs[0].fill_(float("nan"))  # the captured graph must fill it again
            c.last_graph.replay()
            torch.cuda.synchronize()
            err = rel_err(outs[0], ref)
            note = f"graph; eager {eager:.1f}; " + note
        else:
            out = torch.full_like(x, float("nan"))
            fn(x, w13, w2, weights, ids, out=out)
            err = rel_err(out, ref)
            ours = c.bench(_cycle(lambda i, fn=fn: fn(x, *sets[i], weights, ids), 2))
        c.add(Row(name, f"T={tokens} E={e} k={k}", err, ours, theirs, bytes=nbytes, flops=flops, note=note))
    path = backend.path(tokens, x.dtype)
    c.add(Row("moe TritonMoE", f"T={tokens} E={e} k={k}", rel_err(backend.forward(x, w13, w2, weights, ids), ref),
              c.bench(_cycle(lambda i: backend.forward(x, *sets[i], weights, ids), 2)), theirs,
              bytes=nbytes, flops=flops, note=f"eager; takes {path}"))


def sweep_gemv_moe(c: Checker, a, tokens: int) -> None:
    """A few GEMV-MoE configs (graph-timed): tile widths, K chunk, pairs per w2 program (EPP)."""
    from pdserve.ops.gemv_moe import gemv_config, gemv_moe
    from pdserve.ops.moe import route

    e, k, hid, inter = a.num_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size
    x, w13, w2, logits = random_moe_inputs(tokens, e, hid, inter, torch.bfloat16, c.device, _gen(c.device, 4))
    weights, ids = route(logits, k, True)
    touched = int(torch.unique(ids).numel())
    sets = [(w13, w2), (w13.clone(), w2.clone())]
    outs = [torch.empty_like(x) for _ in sets]
    default = gemv_config(tokens, k, hid, inter, c.device)
    cfgs = [default] + [dict(BLOCK_N13=bn13, BLOCK_K13=bk13, BLOCK_N2=bn2, BLOCK_K2=bk2, EPP=epp, num_warps=w)
                        for bn13, bk13, bn2, bk2, epp, w in [
                            (8, 256, 8, 256, 1, 4), (16, 256, 16, 256, 1, 4), (16, 256, 16, 256, 2, 4),
                            (16, 256, 16, 256, 8, 4), (32, 128, 16, 256, 1, 4), (16, 512, 16, 256, 2, 8),
                            (8, 512, 32, 128, 1, 4), (16, 128, 8, 256, 4, 2),
                            (32, 256, 32, 256, 1, 4), (16, 256, 32, 256, 1, 4), (16, 256, 8, 256, 1, 4),
                            (16, 512, 16, 256, 1, 4), (32, 256, 16, 256, 1, 8), (8, 256, 16, 256, 1, 4),
                            (16, 256, 16, 128, 1, 4), (16, 128, 16, 256, 1, 4)]]
    for cfg in cfgs:
        if k % cfg["EPP"]:
            continue
        t = c.bench_graph(lambda: [gemv_moe(x, *sets[i], weights, ids, config=cfg, out=outs[i])
                                   for i in range(2)], 2)
        c.add(Row("sweep gemv_moe", f"T={tokens}", None, t, None, bytes=touched * 3 * inter * hid * 2,
                  flops=2 * tokens * k * 3 * inter * hid,
                  note=("default " if cfg is default else "") + " ".join(f"{n}={v}" for n, v in cfg.items())))


def linear_shapes(a) -> dict[str, tuple[int, int]]:
    """The dense projections of a decode step: name -> (out_features, in_features)."""
    if a.is_mla:
        q = a.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        return {"q+kv_a": (q + a.kv_lora_rank + a.qk_rope_head_dim, a.hidden_size),
                "o_proj": (a.hidden_size, a.num_heads * a.v_head_dim)}
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    return {"qkv": (q + 2 * kv, a.hidden_size), "o_proj": (a.hidden_size, q)}


def check_linear(c: Checker, a, tokens: int, sweep: bool) -> None:
    """The small-row GEMV (pdserve/ops/gemv_linear.py) against cuBLAS (torch.mm), both replayed from
    graphs, weights rotated past L2. (Graph-timed alone: the PDL overlap with the kernels around it
    is the engine's step to show, `bench-engine` with PDSERVE_GEMV_LINEAR=0 the reference.)"""
    from pdserve.ops.gemv_linear import gemv_linear, gemv_linear_config

    for name, (n, k) in linear_shapes(a).items():
        g = _gen(c.device, 11)
        x = torch.randn(tokens, k, generator=g, device=c.device).to(torch.bfloat16)
        copies = _copies(n * k * 2)
        ws = [(torch.randn(n, k, generator=g, device=c.device) * k ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        outs = [x.new_empty(tokens, n) for _ in ws]
        ref = F.linear(x.float(), ws[0].float())
        theirs = c.bench_graph(lambda: [torch.mm(x, w.t(), out=o) for w, o in zip(ws, outs)], copies)
        default = gemv_linear_config(tokens, k)
        cfgs = [default]
        if sweep:
            cfgs += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn, bk, w in [
                (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 256, 4), (16, 512, 4), (16, 512, 8),
                (32, 256, 4), (32, 128, 4), (64, 128, 8)]]
        for cfg in cfgs:
            t = c.bench_graph(lambda: [gemv_linear(x, w, config=cfg, out=o) for w, o in zip(ws, outs)], copies)
            err = rel_err(gemv_linear(x, ws[0], config=cfg), ref)
            c.add(Row("linear gemv" if cfg is default else "sweep linear", f"{name} T={tokens} {n}x{k}", err, t,
                      theirs, bytes=n * k * 2 + tokens * (n + k) * 2, flops=2 * tokens * n * k,
                      note=("graph; default " if cfg is default else "graph; ")
                      + " ".join(f"{kk}={v}" for kk, v in cfg.items())))


def check_routing(c: Checker, a, tokens: int) -> None:
    from pdserve.ops.moe import route
    from pdserve.ops.routing import fused_topk

    e, k = a.num_experts, a.num_experts_per_tok
    logits = torch.randn(tokens, e, generator=_gen(c.device, 5), device=c.device)
    ref_w, ref_ids = route(logits, k, True)
    w, ids = fused_topk(logits, k, True)
    same = bool(torch.equal(ids, ref_ids))
    # bf16 logits (what the router gives) tie: the chosen probabilities must still be the top k.
    lb = logits.to(torch.bfloat16)
    rb, _ = route(lb, k, False)
    wb, idb = fused_topk(lb, k, False)
    probs = torch.softmax(lb, -1, dtype=torch.float32)
    ties_ok = bool(torch.equal(probs.gather(1, idb), rb))
    id_diff = int((idb != route(lb, k, False)[1]).any(1).sum())
    note = f"fp32 ids equal: {same}; bf16 top-k values equal: {ties_ok} ({id_diff} rows differ by ties)"
    c.add(Row("routing softmax+topk", f"T={tokens} E={e} k={k}", rel_err(w, ref_w),
              c.bench(lambda: fused_topk(lb, k, True)), c.bench(lambda: route(lb, k, True)),
              bytes=tokens * e * 2 + tokens * k * 12, note=note))
    if not (same and ties_ok):
        raise AssertionError(note)


def check_grouped_routing(c: Checker, a, tokens: int) -> None:
    """DeepSeek's routing: grouped_topk (one launch, the shared experts' slots appended) against
    grouped_route (the reference's ops), on float32 logits as the router gives them."""
    from pdserve.ops.moe import grouped_route
    from pdserve.ops.routing import grouped_topk

    e, k = a.num_experts, a.num_experts_per_tok
    g = _gen(c.device, 5)
    logits = torch.randn(tokens, e, generator=g, device=c.device)
    bias = 0.1 * torch.randn(e, generator=g, device=c.device) if a.topk_method == "noaux_tc" else None
    kw = dict(scoring=a.scoring_func, method=a.topk_method, n_group=a.n_group, topk_group=a.topk_group,
              correction_bias=bias, renormalize=a.norm_topk_prob, scaling=a.routed_scaling_factor)
    ref_w, ref_ids = grouped_route(logits, k, **kw)
    shared = a.shared_expert_intermediate_size // a.moe_intermediate_size
    w, ids = grouped_topk(logits, k, num_shared=shared, **kw)
    order, ref_order = ids[:, :k].argsort(1), ref_ids.argsort(1)
    same = bool(torch.equal(ids[:, :k].gather(1, order), ref_ids.gather(1, ref_order)))
    note = f"{a.topk_method}, {shared} shared slots; ids equal: {same}"
    err = rel_err(w[:, :k].gather(1, order), ref_w.gather(1, ref_order))
    c.add(Row("routing grouped", f"T={tokens} E={e} k={k}", err,
              c.bench(lambda: grouped_topk(logits, k, num_shared=shared, **kw)),
              c.bench(lambda: grouped_route(logits, k, **kw)), bytes=tokens * e * 4 + tokens * (k + shared) * 12,
              note=note))
    if not same:
        raise AssertionError(note)


# -- norm, RoPE, activation ------------------------------------------------------------------------

def check_rms_norm(c: Checker, a, tokens: int) -> None:
    from pdserve.models.layers import RMSNorm
    from pdserve.ops.rms_norm import fused_add_rms_norm, rms_norm

    g, dim = _gen(c.device, 6), a.hidden_size
    norm = RMSNorm(dim, a.rms_norm_eps).to(c.device)
    norm.weight.data = 1 + 0.1 * torch.randn(dim, generator=g, device=c.device)
    x = torch.randn(tokens, dim, generator=g, device=c.device).to(torch.bfloat16)
    res = torch.randn(tokens, dim, generator=g, device=c.device).to(torch.bfloat16)
    ref = norm(x.float())
    norm_bf = RMSNorm(dim, a.rms_norm_eps).to(c.device, torch.bfloat16)
    norm_bf.weight.data = norm.weight.data.to(torch.bfloat16)
    w = norm_bf.weight.data
    nbytes = 2 * tokens * dim * 2
    c.add(Row("rms_norm", f"T={tokens} H={dim}", rel_err(rms_norm(x, w, a.rms_norm_eps), ref),
              c.bench(lambda: rms_norm(x, w, a.rms_norm_eps)), c.bench(lambda: norm_bf(x)), bytes=nbytes))
    out, _ = fused_add_rms_norm(x, res, w, a.rms_norm_eps)
    c.add(Row("add+rms_norm", f"T={tokens} H={dim}", rel_err(out, norm((x + res).float())),
              c.bench(lambda: fused_add_rms_norm(x, res, w, a.rms_norm_eps)),
              c.bench(lambda: norm_bf(x + res)), bytes=nbytes * 2))


def check_qk_norm_rope(c: Checker, a, tokens: int) -> None:
    from pdserve.models.layers import RMSNorm, RotaryEmbedding
    from pdserve.ops.norms import apply_rotary
    from pdserve.ops.rotary import qk_norm_rope

    g, h, kvh, d = _gen(c.device, 7), a.num_heads, a.num_kv_heads, a.head_dim
    rot = RotaryEmbedding(d, a.max_position_embeddings, a.rope_theta, a.rope_scaling).to(c.device)
    rot.build_cache()
    pos = torch.randint(0, a.max_position_embeddings, (tokens,), generator=g, device=c.device)
    q = torch.randn(tokens, h, d, generator=g, device=c.device).to(torch.bfloat16)
    k = torch.randn(tokens, kvh, d, generator=g, device=c.device).to(torch.bfloat16)
    qn, kn = RMSNorm(d, a.rms_norm_eps).to(c.device), RMSNorm(d, a.rms_norm_eps).to(c.device)
    for n in (qn, kn):
        n.weight.data = 1 + 0.1 * torch.randn(d, generator=g, device=c.device)
    cos, sin = rot(pos, torch.float32)
    ref_q = apply_rotary(qn(q.float()), cos, sin)
    qw, kw = qn.weight.data.to(torch.bfloat16), kn.weight.data.to(torch.bfloat16)
    oq, ok = qk_norm_rope(q, k, pos, rot.cos, rot.sin, qw, kw, a.rms_norm_eps)
    err = max(rel_err(oq, ref_q), rel_err(ok, apply_rotary(kn(k.float()), cos, sin)))
    qn_bf, kn_bf = qn.to(torch.bfloat16), kn.to(torch.bfloat16)

    def torch_path():
        c_, s_ = rot(pos, torch.bfloat16)
        return apply_rotary(qn_bf(q), c_, s_), apply_rotary(kn_bf(k), c_, s_)

    c.add(Row("qk_norm+rope", f"T={tokens} {h}/{kvh}x{d}", err,
              c.bench(lambda: qk_norm_rope(q, k, pos, rot.cos, rot.sin, qw, kw, a.rms_norm_eps)),
              c.bench(torch_path), bytes=2 * tokens * (h + kvh) * d * 2 + tokens * d * 8))


def check_mla_rope(c: Checker, a, tokens: int) -> None:
    """MLA's RoPE and cache entry (one launch) against the reference's ops (TorchNorms.mla_rope)."""
    from pdserve.models.layers import RotaryEmbedding
    from pdserve.ops.mla_rope import mla_rope
    from pdserve.ops.norms import TorchNorms

    g, h, rank, rope = _gen(c.device, 9), a.num_heads, a.kv_lora_rank, a.qk_rope_head_dim
    qk = a.qk_nope_head_dim + rope
    rot = RotaryEmbedding(rope, a.max_position_embeddings, a.rope_theta, a.rope_scaling).to(c.device)
    rot.build_cache()
    pos = torch.randint(0, a.max_position_embeddings, (tokens,), generator=g, device=c.device)
    proj = torch.randn(tokens, h * qk + rank + rope, generator=g, device=c.device).to(torch.bfloat16)
    q = proj[:, :h * qk].view(tokens, h, qk)
    c_kv, k_rope = proj[:, h * qk:].split([rank, rope], -1)
    cos, sin = rot(pos, torch.float32)  # V2 rotates in float32
    ref_q, ref_lat = TorchNorms().mla_rope(q.float(), c_kv.float(), k_rope.float(), (cos, sin), a.rope_interleave)
    oq, olat = mla_rope(q, c_kv, k_rope, cos, sin, a.rope_interleave)
    c.add(Row("mla_rope", f"T={tokens} {h}x{qk} + {rank}+{rope}", max(rel_err(oq, ref_q), rel_err(olat, ref_lat)),
              c.bench(lambda: mla_rope(q, c_kv, k_rope, cos, sin, a.rope_interleave)),
              c.bench(lambda: TorchNorms().mla_rope(q, c_kv, k_rope, (cos, sin), a.rope_interleave)),
              bytes=2 * tokens * (h * qk + rank + rope) * 2 + tokens * rope * 8))


def check_silu_and_mul(c: Checker, a, rows: int) -> None:
    from pdserve.ops.activation import silu_and_mul

    inter = a.moe_intermediate_size
    x = torch.randn(rows, 2 * inter, generator=_gen(c.device, 8), device=c.device).to(torch.bfloat16)
    gate, up = x.float().chunk(2, -1)

    def torch_path():
        g_, u_ = x.chunk(2, -1)
        return F.silu(g_) * u_

    c.add(Row("silu_and_mul", f"rows={rows} I={inter}", rel_err(silu_and_mul(x), F.silu(gate) * up),
              c.bench(lambda: silu_and_mul(x)), c.bench(torch_path), bytes=3 * rows * inter * 2))


# -- main ----------------------------------------------------------------------------------------------

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--json", default=None)
    p.add_argument("--sweep", action="store_true",
                   help="also time decode split counts and GEMV-MoE configs (the fused MoE's tiles: "
                        "python -m pdserve.benchmarks.moe_tiles)")
    p.add_argument("--only", default="",
                   help="comma-separated groups: write,decode,prefill,mla,moe,linear,routing,norm; "
                        "small = the small-batch old/new rows only (decode B=1/8/64/256, MoE T=1..16)")
    args = p.parse_args()
    assert torch.cuda.is_available(), "check_kernels needs a CUDA GPU"
    device = torch.device("cuda")
    torch.manual_seed(0)
    a = resolve_model_args(args.preset)
    default = ({"mla", "moe", "linear", "routing", "norm"} if a.is_mla else
               {"write", "decode", "prefill", "moe", "linear", "routing", "norm", "small"})
    groups = set(filter(None, args.only.split(","))) or default
    c = Checker(device)
    start = time.time()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}  {args.preset}: hidden {a.hidden_size}, "
          f"{a.num_heads}/{a.num_kv_heads} heads x {a.head_dim}, "
          f"{a.num_experts} experts top-{a.num_experts_per_tok}, "
          f"moe_intermediate {a.moe_intermediate_size}, bf16")
    c.run("ceilings", c.ceilings)
    print(HEADER)
    with torch.inference_mode():
        if "write" in groups:
            for t in (256, 4096):
                c.run(f"write_kv T={t}", lambda t=t: check_write_kv(c, a, t))
        if "small" in groups:
            for b in (1, 8, 64, 256):
                c.run(f"decode old/new B={b}", lambda b=b: check_decode_old_new(c, a, b, 1024))
            for t in (1, 2, 4, 8, 16):
                c.run(f"moe T={t}", lambda t=t: check_moe(c, a, t))
            if args.sweep:
                for b in (1, 8, 64):
                    c.run(f"sweep decode B={b}", lambda b=b: sweep_decode(c, a, b, 1024))
                for t in (1, 2, 8):
                    c.run(f"sweep gemv moe T={t}", lambda t=t: sweep_gemv_moe(c, a, t))
        if "decode" in groups:
            for b in (1, 64, 256):
                c.run(f"decode B={b}", lambda b=b: check_decode(c, a, b, 1024))
            c.run("decode mixed ctx", lambda: _attention_step(
                c, a, [(int(n), 1) for n in torch.randint(1, 5000, (64,)).tolist()], "decode attn+write",
                note="ctx 1..5000"))
            if args.sweep:
                for b, s in ((1, 1), (1, 16), (64, 1), (64, 4), (256, 2)):
                    c.run(f"decode B={b} splits={s}", lambda b=b, s=s: check_decode(c, a, b, 1024, s))
        if "prefill" in groups:
            for seqs in ([(4096, 4096)], [(4096, 2048)], [(1024, 1024)] * 4, [(4096, 512), (300, 300), (2000, 1)]):
                c.run(f"prefill {seqs}", lambda seqs=seqs: check_prefill(c, a, seqs))
        if "mla" in groups:
            assert a.is_mla, f"--only mla needs a Multi-head Latent Attention preset, not {args.preset}"
            for b in (1, 64, 256):
                c.run(f"mla decode B={b}", lambda b=b: check_mla(c, a, [(1024, 1)] * b, graph=True))
            c.run("mla decode mixed ctx", lambda: check_mla(
                c, a, [(int(n), 1) for n in torch.randint(1, 5000, (64,)).tolist()]))
            for seqs in ([(4096, 4096)], [(4096, 512), (300, 300), (2000, 1)]):
                c.run(f"mla step {seqs}", lambda seqs=seqs: check_mla(c, a, seqs))
            if args.sweep:
                for b, s in ((1, 4), (1, 16), (1, 32), (64, 1), (64, 2), (64, 4), (128, 1), (128, 2),
                             (192, 1), (192, 2), (256, 1), (256, 2)):
                    c.run(f"mla decode B={b} splits={s}",
                          lambda b=b, s=s: check_mla(c, a, [(1024, 1)] * b, splits=s, graph=True))
        if "moe" in groups:
            for t in (1, 64, 256, 4096) if "small" not in groups else (64, 256, 4096):
                c.run(f"moe T={t}", lambda t=t: check_moe(c, a, t))
        if "linear" in groups:
            for t in (1, 2):  # (the GEMV takes at most two rows)
                c.run(f"linear T={t}", lambda t=t: check_linear(c, a, t, args.sweep))
        if "routing" in groups:
            for t in (1, 256, 4096):
                c.run(f"routing T={t}", lambda t=t: check_routing(c, a, t))
                if a.is_mla:  # DeepSeek's own routing
                    c.run(f"routing grouped T={t}", lambda t=t: check_grouped_routing(c, a, t))
        if "norm" in groups:
            for t in (1, 256, 4096):
                c.run(f"rms_norm T={t}", lambda t=t: check_rms_norm(c, a, t))
                if a.is_mla:
                    c.run(f"mla_rope T={t}", lambda t=t: check_mla_rope(c, a, t))
                else:
                    c.run(f"qk_norm_rope T={t}", lambda t=t: check_qk_norm_rope(c, a, t))
            for r in (8, 2048, 32768):
                c.run(f"silu_and_mul rows={r}", lambda r=r: check_silu_and_mul(c, a, r))

    print(f"\n=== {args.preset} bf16 on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"copy {c.copy_rate / 1e12:.2f} TB/s, matmul {c.matmul_rate / 1e12:.0f} TFLOP/s; "
          f"{time.time() - start:.0f} s ===")
    print(HEADER)
    for r in c.rows:
        print(_fmt(r))
    bad = [r for r in c.rows if r.err is not None and not r.err <= 2e-2]
    print(f"checks failed to run: {', '.join(c.failures) or 'none'}; rows over 2e-2 error: "
          f"{', '.join(f'{r.kernel} {r.shape}' for r in bad) or 'none'}")
    path = args.json or (os.path.join(os.environ["OUT"], "check_kernels.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "copy_rate": c.copy_rate, "matmul_rate": c.matmul_rate, "failures": c.failures,
                       "rows": [asdict(r) for r in c.rows]}, f, indent=1)


if __name__ == "__main__":
    main()
