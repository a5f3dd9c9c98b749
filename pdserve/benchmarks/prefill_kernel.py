"""The paged prefill attention kernel of one prompt with a cached prefix, on a GPU, against what
flash attention does for the same work: the cost a cached prefix adds to a long prompt.

    python -m pdserve.benchmarks.prefill_kernel [--ctx 4096] [--prefix 0 256 1024 2048 3840]
        [--against OLD.py] [--configs 128,64,8,3 128,128,8,2 ...] [--json out.json]

For each cached-prefix length P, the prompt's last ctx - P tokens attend to all ctx keys (the
prefix's through a shuffled block table, as in a real cache): Qwen3-30B-A3B's attention (32 query
heads, 4 KV heads, head dim 128, bf16, 16-token pages). Times, per layer (median of
triton.testing.do_bench): this build's kernel at its own tile config and at each of `--configs`
(BLOCK_M, BLOCK_N, warps, stages); `--against`'s kernel (a copy of pdserve/ops/prefill_attention.py
from another build); and PyTorch's SDPA over the same keys made contiguous (flash attention; causal
aligned to the last key), the reference. Each kernel's output is first checked against a float32
reference (relative error). The floor: 4 * heads * head_dim * (keys seen) flops over the GPU's bf16
matmul rate, measured here with torch.matmul.
"""

import argparse
import importlib.util
import json

import torch
import triton

from pdserve.ops.prefill_attention import paged_prefill_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 4, 128, 16


def _load(path: str):
    spec = importlib.util.spec_from_file_location("prefill_attention_against", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.paged_prefill_attention


def _case(ctx: int, prefix: int, g: torch.Generator):
    n = ctx - prefix
    blocks = triton.cdiv(ctx, PAGE)
    num_blocks = blocks * 2
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    cache = torch.randn(2, num_blocks, PAGE, KV_HEADS, HEAD_DIM, generator=g, device="cuda").to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=g, device="cuda")[:blocks].to(torch.int32).view(1, -1)
    ctx_t = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    qstart = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    # The keys and values in order, [ctx, kv_heads, D]: what SDPA reads.
    k = cache[0][table[0].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx]
    v = cache[1][table[0].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:ctx]
    return q, cache, table, ctx_t, qstart, k, v


def _reference(q, k, v, scale: float) -> torch.Tensor:
    n, ctx = q.shape[0], k.shape[0]
    kk = k.float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    vv = v.float().repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
    qq = q.float().transpose(0, 1)
    # Query j sits at position ctx - n + j and sees keys up to it.
    mask = torch.arange(ctx, device="cuda")[None, :] <= (ctx - n + torch.arange(n, device="cuda"))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _sdpa(q, k, v, scale: float):
    from torch.nn.attention.bias import causal_lower_right

    n, ctx = q.shape[0], k.shape[0]
    qq, kk, vv = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    kk = kk.repeat_interleave(HEADS // KV_HEADS, 1)
    vv = vv.repeat_interleave(HEADS // KV_HEADS, 1)
    if n == ctx:
        return lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=scale)
    bias = causal_lower_right(n, ctx)
    return lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=bias, scale=scale)


def _matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * 8192 ** 3 / ms / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--prefix", type=int, nargs="+", default=[0, 256, 1024, 2048, 3840])
    ap.add_argument("--against", help="another build's pdserve/ops/prefill_attention.py")
    ap.add_argument("--configs", nargs="*", default=["128,64,8,3", "128,64,4,3", "128,64,4,4",
                                                     "128,128,4,3", "64,64,4,3", "64,32,4,3"])
    ap.add_argument("--json")
    a = ap.parse_args()
    scale = HEAD_DIM ** -0.5
    tflops = _matmul_tflops()
    print(f"bf16 matmul 8192^3: {tflops:.0f} TFLOP/s ({torch.cuda.get_device_name()})", flush=True)
    variants = {"this": lambda *x, **kw: paged_prefill_attention(*x, **kw)}
    for c in a.configs:
        cfg = tuple(int(x) for x in c.split(","))
        variants[f"this@{c}"] = lambda *x, cfg=cfg, **kw: paged_prefill_attention(*x, config=cfg, **kw)
    if a.against:
        old = _load(a.against)
        variants["against"] = lambda *x, **kw: old(*x, **kw)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for prefix in a.prefix:
        q, cache, table, ctx_t, qstart, k, v = _case(a.ctx, prefix, g)
        n = q.shape[0]
        ref = _reference(q, k, v, scale)
        seen = n * a.ctx - n * (n - 1) / 2  # (query, key) pairs that attend
        floor_us = 4 * HEADS * HEAD_DIM * seen / (tflops * 1e12) * 1e6
        row = {"prefix": prefix, "queries": n, "floor_us": round(floor_us, 1)}
        sdpa = _sdpa(q, k, v, scale)
        err = ((sdpa()[0].transpose(0, 1).float() - ref).norm() / ref.norm()).item()
        row["sdpa_us"] = round(1e3 * triton.testing.do_bench(sdpa, warmup=50, rep=300, return_mode="median"), 1)
        row["sdpa_err"] = f"{err:.1e}"
        for name, fn in variants.items():
            out = torch.full_like(q, float("nan"))
            call = lambda fn=fn, out=out: fn(q, cache, table, ctx_t, qstart, n, scale, out=out)
            try:
                call()
                torch.cuda.synchronize()
            except Exception as e:  # a tile config this GPU cannot run (shared memory): say so, go on
                print(f"{name} at prefix {prefix}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                row[f"{name}_us"], row[f"{name}_err"] = float("nan"), "failed"
                continue
            err = ((out.float() - ref).norm() / ref.norm()).item()
            us = 1e3 * triton.testing.do_bench(call, warmup=50, rep=300, return_mode="median")
            row[f"{name}_us"] = round(us, 1)
            row[f"{name}_err"] = f"{err:.1e}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    names = ["sdpa"] + list(variants)
    print(f"\nper layer, us (x48 layers for a prompt); floor at {tflops:.0f} TFLOP/s")
    print(f"{'prefix':>6} {'queries':>7} {'floor':>7} " + " ".join(f"{n:>16}" for n in names))
    for r in rows:
        print(f"{r['prefix']:>6} {r['queries']:>7} {r['floor_us']:>7} "
              + " ".join(f"{r[n + '_us']:>9} {r[n + '_err']:>6}" for n in names))
    if a.json:
        json.dump({"device": torch.cuda.get_device_name(), "matmul_tflops": round(tflops), "rows": rows},
                  open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
