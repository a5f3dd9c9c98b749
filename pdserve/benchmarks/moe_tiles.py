"""Tile choices of the Triton MoE and MLA kernels on one GPU: the sweeps behind their fixed tables.

    python -m pdserve.benchmarks.moe_tiles --part gemm  --preset deepseek-v2-lite --tokens 128 192 256
    python -m pdserve.benchmarks.moe_tiles --part gemm  --preset qwen3-30b-a3b --tokens 1024 2048 --large
    python -m pdserve.benchmarks.moe_tiles --part align
    python -m pdserve.benchmarks.moe_tiles --part whole --tokens 1024 2048 3072 4096
    python -m pdserve.benchmarks.moe_tiles --part mla   --batches 256

- `gemm`: each fused-MoE GEMM alone (gate/up with SiLU-and-mul, then down) over tile configs
  (BLOCK_M / N / K, warps, stages), against `fused_moe._gemm_config`'s pick and the floor (the
  touched experts' weights once, at the copy rate measured first); the best pair is checked
  against the float32 reference. `--large` sweeps the prefill-sized tiles.
- `align`: `moe_align`'s one program by warps and chunk, graph-replayed, its output checked equal.
- `whole`: the whole MoE, `fused_moe` (its table) against `torch._grouped_mm`, both shapes: where
  `triton_moe.GROUPED_MM_MIN_TOKENS` belongs.
- `mla`: the MLA decode kernel (DeepSeek-V2-Lite's 16 heads, 1k contexts) by splits, BLOCK_N,
  warps and stages, against `mla_num_splits`' pick and its floor (the latents read once).

Weights rotate over three copies (one layer's experts can sit in L2 at small batches); times are
medians of `triton.testing.do_bench`. The summary comes last.
"""

import argparse
import itertools

import torch
import triton
from triton.testing import do_bench

from pdserve.models.args import resolve_model_args

COPIES = 3


def copy_rate(dev: torch.device) -> float:
    """HBM copy rate in bytes/s (read + write counted), measured now."""
    n = 1 << 29
    src = torch.randn(n, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return 4 * n / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def _median_us(fn) -> float:
    return do_bench(fn, warmup=10, rep=80, return_mode="median") * 1e3


def _moe_inputs(preset: str, tokens: int, dev: torch.device, seed: int = 0):
    from pdserve.ops.moe import route
    from pdserve.ops.testing import random_moe_inputs

    a = resolve_model_args(preset)
    e, k, hid, inter = a.num_experts, a.num_experts_per_tok, a.hidden_size, a.moe_intermediate_size
    g = torch.Generator(device=dev).manual_seed(seed)
    x, w13, w2, logits = random_moe_inputs(tokens, e, hid, inter, torch.bfloat16, dev, g)
    weights, ids = route(logits, k, True)
    sets = [(w13, w2)] + [(w13.clone(), w2.clone()) for _ in range(COPIES - 1)]
    return (e, k, hid, inter), x, sets, weights, ids


def _rotating(fn):
    """fn(i) over the weight copies in turn."""
    i = [0]

    def call():
        i[0] = (i[0] + 1) % COPIES
        fn(i[0])
    return call


def tile_configs(large: bool):
    if large:
        for bm, bn, bk, w, s in itertools.product((64, 128), (64, 128, 256), (32, 64, 128), (4, 8), (3, 4)):
            if bm * bk * 2 + bk * bn * 4 <= 100_000 // s * 2:  # a rough shared-memory bound
                yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)
        return
    for bm, bn, bk, w, s in itertools.product((16, 32, 64), (32, 64, 128), (64, 128, 256), (4, 8), (3, 4)):
        if bm * bk + bk * bn * 2 <= 64 * 256 + 256 * 128 and not (bm == 64 and bn == 128 and bk == 256):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s)


def _tag(c: dict) -> str:
    return f"BM{c['BLOCK_M']} BN{c['BLOCK_N']} BK{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"


def part_gemm(args, dev, rate) -> list[str]:
    from pdserve.ops.fused_moe import _gemm_config, _launch_gemm, moe_align, moe_sum
    from pdserve.ops.moe import TorchMoE

    lines = []
    for tokens in args.tokens:
        (e, k, hid, inter), x, sets, weights, ids = _moe_inputs(args.preset, tokens, dev)
        pairs = tokens * k
        touched = int(torch.unique(ids).numel())
        floor13, floor2 = (touched * n * inter * hid * 2 / rate * 1e6 for n in (2, 1))
        mid = torch.empty(pairs, inter, dtype=x.dtype, device=dev)
        y = torch.empty(pairs, hid, dtype=x.dtype, device=dev)
        default = _gemm_config(pairs, e, x.dtype)
        rows = []
        for cfg in [default] + list(tile_configs(args.large)):
            try:
                sid, eid, npad = moe_align(ids, e, cfg["BLOCK_M"])
                t13 = _median_us(_rotating(lambda i: _launch_gemm(x, sets[i][0], mid, weights, sid, eid, npad, pairs,
                                                                  inter, hid, k, True, cfg)))
                t2 = _median_us(_rotating(lambda i: _launch_gemm(mid, sets[i][1], y, weights, sid, eid, npad, pairs,
                                                                 hid, inter, 1, False, cfg)))
            except Exception as exc:  # out of shared memory, registers
                print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
                continue
            rows.append((t13, t2, cfg))
            print(f"T={tokens} {' '.join(str(v) for v in cfg.values()):>16}: gate/up {t13:7.1f} us  down {t2:7.1f} us"
                  f"{'  (the table)' if cfg is default else ''}", flush=True)
        best13 = min(rows, key=lambda r: r[0])
        best2 = min(rows, key=lambda r: r[1])
        d = rows[0]
        lines.append(f"{args.preset} T={tokens} ({pairs / e:.0f} rows an expert): floors {floor13:.1f} / {floor2:.1f} us;"
                     f" the table ({_tag(d[2])}) {d[0]:.1f} / {d[1]:.1f}; best gate/up {best13[0]:.1f} ({_tag(best13[2])}),"
                     f" best down {best2[1]:.1f} ({_tag(best2[2])})")
        if best13[2]["BLOCK_M"] == best2[2]["BLOCK_M"]:  # one alignment serves both: check the pair
            ref = TorchMoE().forward(x.float(), sets[0][0].float(), sets[0][1].float(), weights, ids)
            sid, eid, npad = moe_align(ids, e, best13[2]["BLOCK_M"])
            mid.fill_(float("nan"))
            y.fill_(float("nan"))
            _launch_gemm(x, sets[0][0], mid, weights, sid, eid, npad, pairs, inter, hid, k, True, best13[2])
            _launch_gemm(mid, sets[0][1], y, weights, sid, eid, npad, pairs, hid, inter, 1, False, best2[2])
            out = moe_sum(y, tokens, k, ids=ids, num_experts=e)
            lines.append(f"  the best pair against float32: rel err {((out.float() - ref).norm() / ref.norm()).item():.1e}")
        del x, sets
    return lines


def part_align(args, dev, rate) -> list[str]:
    from pdserve.ops.fused_moe import ALIGN_CHUNK, ALIGN_WARPS, _moe_align_kernel, _padded_len

    lines = []
    for tokens, e, k, bm in [(64, 64, 6, 16), (256, 64, 6, 32), (256, 128, 8, 32), (1024, 128, 8, 64),
                             (1536, 128, 8, 64)]:
        ids = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(tokens)])
        pairs = ids.numel()
        padded = _padded_len(pairs, e, bm)
        sorted_ids = torch.empty(padded, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(padded // bm, dtype=torch.int32, device=dev)
        num_padded = torch.empty(1, dtype=torch.int32, device=dev)
        block_e = triton.next_power_of_2(e)
        cursor = torch.empty(block_e, dtype=torch.int32, device=dev)
        first, times = None, {}
        for warps, chunk in itertools.product((4, 8, 16), (256, 512, 1024, 2048)):
            def launch():
                _moe_align_kernel[(1,)](ids, sorted_ids, expert_ids, num_padded, cursor, pairs, e, padded,
                                        padded // bm, BLOCK_M=bm, BLOCK_E=block_e, CHUNK=chunk, num_warps=warps,
                                        USE_PDL=False)
            launch()
            got = (int(num_padded), expert_ids.clone())
            assert first is None or (got[0] == first[0] and torch.equal(got[1], first[1])), (warps, chunk)
            first = first or got
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                launch()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    launch()
            times[warps, chunk] = _median_us(graph.replay) / 10
        best = min(times, key=times.get)
        lines.append(f"{pairs} pairs, {e} experts, BLOCK_M {bm}: 4 warps / chunk 1024 {times[4, 1024]:.2f} us, "
                     f"the module's ({ALIGN_WARPS}, {ALIGN_CHUNK}) {times[ALIGN_WARPS, ALIGN_CHUNK]:.2f} us, "
                     f"best {times[best]:.2f} us {best}")
    return lines


def part_whole(args, dev, rate) -> list[str]:
    from pdserve.ops.fused_moe import fused_moe
    from pdserve.ops.grouped_mm_moe import grouped_mm_moe

    lines = []
    for preset in ("qwen3-30b-a3b", "deepseek-v2-lite"):
        for tokens in args.tokens:
            _, x, sets, weights, ids = _moe_inputs(preset, tokens, dev)
            fused = _median_us(_rotating(lambda i: fused_moe(x, *sets[i], weights, ids)))
            grouped = _median_us(_rotating(lambda i: grouped_mm_moe(x, *sets[i], weights, ids)))
            ref = grouped_mm_moe(x, *sets[0], weights, ids).float()
            diff = ((fused_moe(x, *sets[0], weights, ids).float() - ref).norm() / ref.norm()).item()
            lines.append(f"{preset:18s} T={tokens:5d}: fused {fused:7.1f} us, grouped_mm {grouped:7.1f} us, "
                         f"fused/grouped {fused / grouped:.2f} (outputs {diff:.1e} apart)")
            print(lines[-1], flush=True)
            del x, sets
    return lines


def part_mla(args, dev, rate) -> list[str]:
    from pdserve.ops.mla_decode import mla_num_splits, paged_mla_decode

    heads, rank, rope, page = 16, 512, 64, 16
    lines = []
    for batch in args.batches:
        ctx = torch.randint(1000, 1078, (batch,), device=dev, dtype=torch.int32)
        per = (int(ctx.max()) + page - 1) // page
        blocks = batch * per + 1
        kv = torch.randn(1, blocks, page, 1, rank + rope, device=dev, dtype=torch.bfloat16)
        tables = torch.randperm(blocks - 1, device=dev, dtype=torch.int32)[: batch * per].view(batch, per)
        last = (ctx - 1).long()
        slots = tables.gather(1, (last // page).view(-1, 1)).view(-1).long() * page + last % page
        q_latent = torch.randn(heads, batch, rank, device=dev, dtype=torch.bfloat16).transpose(0, 1)
        q_rope = torch.randn(batch, heads, 128 + rope, device=dev, dtype=torch.bfloat16)[..., 128:]
        new = torch.randn(batch, rank + rope, device=dev, dtype=torch.bfloat16)
        out = torch.empty(heads, batch, rank, device=dev, dtype=torch.bfloat16).transpose(0, 1)
        floor = int(ctx.sum()) * (rank + rope) * 2 / rate * 1e6
        picked = mla_num_splits(batch, heads, int(ctx.max()), dev)

        def call(splits, bn, w, s):
            paged_mla_decode(q_latent, q_rope, kv, tables, ctx, 0.1, splits, out=out, latent_new=new,
                             slot_mapping=slots, block_n=bn, num_warps=w, num_stages=s)
        call(picked, None, 4, 2)
        ref = out.float().clone()
        times = {}
        for splits, bn, w, s in itertools.product(sorted({1, 2, picked}), (16, 32, 64), (4, 8), (1, 2, 3, 4)):
            try:
                call(splits, bn, w, s)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                times[splits, bn, w, s] = (_median_us(lambda: call(splits, bn, w, s)), err)
            except Exception as exc:
                print(f"  skip {(splits, bn, w, s)}: {type(exc).__name__}", flush=True)
        best = min(times, key=lambda c: times[c][0])
        d = times[picked, 32, 4, 2][0]
        lines.append(f"MLA decode B={batch} (1k contexts): floor {floor:.1f} us; the module's pick (splits {picked}, "
                     f"BLOCK_N 32, 4 warps, 2 stages) {d:.1f} us; best {times[best][0]:.1f} us (splits, BLOCK_N, "
                     f"warps, stages = {best}, {times[best][1]:.0e} from the pick's output)")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["gemm", "align", "whole", "mla"], required=True)
    p.add_argument("--preset", default="deepseek-v2-lite", help="the MoE shape of --part gemm")
    p.add_argument("--tokens", type=int, nargs="+", default=[256])
    p.add_argument("--batches", type=int, nargs="+", default=[256], help="--part mla's decode batches")
    p.add_argument("--large", action="store_true", help="--part gemm: the prefill-sized tiles")
    args = p.parse_args()
    assert torch.cuda.is_available(), "moe_tiles needs a CUDA GPU"
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rate = copy_rate(dev)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"HBM copy {rate / 1e12:.3f} TB/s", flush=True)
    lines = {"gemm": part_gemm, "align": part_align, "whole": part_whole, "mla": part_mla}[args.part](args, dev, rate)
    print(f"\n=== {args.part} on {torch.cuda.get_device_name()} ===")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
