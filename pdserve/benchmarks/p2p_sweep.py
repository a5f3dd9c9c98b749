"""Variants of the peer copy of one request's KV (qwen3-30b-a3b layout, every layer), GPU0 -> GPU1:
the cuda_ipc copy kernel's launch shapes, contiguous copy-engine memcpys per (layer, K/V), and
both at once on two streams (half the layers each). Reference: the raw 1 GiB peer copy.

    python -m pdserve.benchmarks.p2p_sweep
"""

import statistics

import torch

from pdserve.kvtransfer.backends.block_copy import copy_blocks


def timed(fn, reps: int = 15) -> float:
    """Median seconds, CUDA events on both devices' work via a final synchronize."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out[3:])


def main() -> None:
    L, NB, BS, H, D = 48, 4200, 16, 4, 128
    torch.cuda.set_device(0)
    src = torch.randn(L, 2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda:1")
    a = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda:0")
    b = torch.empty_like(a, device="cuda:1")
    raw = (1 << 30) / timed(lambda: b.copy_(a)) / 1e9
    print(f"raw {raw:.1f} GB/s", flush=True)
    side = torch.cuda.Stream()
    rows = []
    for nblk in (64, 256, 1024, 4096):
        nbytes = L * 2 * nblk * BS * H * D * 2
        sid = torch.arange(3, 3 + nblk, dtype=torch.int32, device="cuda:0")
        did = torch.arange(1, 1 + nblk, dtype=torch.int32, device="cuda:0")
        variants = {}
        for warps in (4, 8, 16):
            for chunk in (512, 1024, 2048):
                variants[f"kernel w{warps} c{chunk}"] = (lambda w=warps, c=chunk:
                                                         copy_blocks(src, dst, 0, L, sid, did, num_warps=w, chunk=c))

        def ce(lo=0, hi=L):
            for layer in range(lo, hi):
                for kv in (0, 1):
                    dst[layer, kv, 1:1 + nblk].copy_(src[layer, kv, 3:3 + nblk], non_blocking=True)
        variants["copy engine per (layer, kv)"] = ce

        def mixed(frac):
            k = int(L * frac)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                ce(0, k)
            copy_blocks(src, dst, k, L - k, sid, did)
            torch.cuda.current_stream().wait_stream(side)
        for frac in (0.25, 0.5, 0.75):
            variants[f"mixed ce {frac:.2f} + kernel"] = (lambda f=frac: mixed(f))
        for name, fn in variants.items():
            dst.zero_()
            torch.cuda.synchronize(1)  # the zeros land before the copy starts (another device's stream)
            fn()
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            ok = torch.equal(dst[:, :, 1:1 + nblk].to("cuda:0"), src[:, :, 3:3 + nblk])
            t = timed(fn)
            rows.append((nblk * BS, name, nbytes / t / 1e9, ok))
            print(f"{nblk * BS:>6} {name:<28} {nbytes / t / 1e9:7.1f} GB/s {100 * nbytes / t / 1e9 / raw:5.1f} % {'ok' if ok else 'WRONG'}",
                  flush=True)
    print(f"\nraw {raw:.1f} GB/s; best per size:")
    for n in sorted({r[0] for r in rows}):
        best = sorted([r for r in rows if r[0] == n and r[3]], key=lambda r: -r[2])[:3]
        print(n, "; ".join(f"{r[1]} {100 * r[2] / raw:.1f} %" for r in best))


if __name__ == "__main__":
    main()
