"""Peer-copy ceilings between two GPUs of one process, for the KV layout of qwen3-30b-a3b.

    python -m pdserve.benchmarks.p2p_probe

What a copy engine or copy kernel reaches for one request's KV: all layers of a run in one strided
copy, one copy per layer, runs of 8 blocks, gather + contiguous copy + scatter, and the cuda_ipc
backend's copy kernel (one launch, every layer; fresh and scattered); next to the raw 1 GiB peer copy. It bounds what the cuda_ipc KV backend can reach.
"""

import statistics
import time

import torch

from pdserve.kvtransfer.backends.block_copy import copy_blocks


def main() -> None:
    L, NB, BS, H, D = 48, 8200, 16, 4, 128
    torch.cuda.set_device(0)
    src = torch.randn(L, 2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda:0")
    dst = torch.zeros(L, 2, NB, BS, H, D, dtype=torch.bfloat16, device="cuda:1")
    print("p2p", torch.cuda.can_device_access_peer(0, 1))
    def t(fn, reps=7):
        ts = []
        for _ in range(reps):
            torch.cuda.synchronize(0); torch.cuda.synchronize(1)
            t0 = time.perf_counter(); fn(); torch.cuda.synchronize(0); torch.cuda.synchronize(1)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts[2:])
    a = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda:0"); b = torch.empty_like(a, device="cuda:1")
    raw = (1 << 30) / t(lambda: b.copy_(a)) / 1e9
    print(f"raw {raw:.1f} GB/s")
    for nblk in [64, 256, 1024, 4096]:
        nbytes = L * 2 * nblk * BS * H * D * 2
        whole = t(lambda: dst[:, :, 1:1 + nblk].copy_(src[:, :, 3:3 + nblk]))
        per_layer = t(lambda: [dst[l, :, 1:1 + nblk].copy_(src[l, :, 3:3 + nblk]) for l in range(L)])
        def runs8():
            for r in range(0, nblk, 8):
                dst[:, :, 1 + 2 * r:1 + 2 * r + 8].copy_(src[:, :, 3 + 2 * r:3 + 2 * r + 8])
        frag = t(runs8)
        sidx = torch.arange(3, 3 + 2 * nblk, 2, device="cuda:0"); didx = torch.arange(1, 1 + 2 * nblk, 2, device="cuda:1")
        def gather():
            stage = src.index_select(2, sidx)            # local HBM gather
            s1 = stage.to("cuda:1", non_blocking=True)   # one contiguous peer copy
            dst.index_copy_(2, didx, s1)                 # local HBM scatter
        g = t(gather)
        # The cuda_ipc backend's copy kernel: one launch for every layer, fresh and scattered.
        ids = [torch.arange(3, 3 + nblk, dtype=torch.int32, device="cuda:0"),
               torch.arange(1, 1 + nblk, dtype=torch.int32, device="cuda:0")]
        kfresh = t(lambda: copy_blocks(src, dst, 0, L, *ids))
        ids_s = [sidx.to(torch.int32), didx.to(device="cuda:0", dtype=torch.int32)]
        kscat = t(lambda: copy_blocks(src, dst, 0, L, *ids_s))
        assert torch.equal(dst[:, :, didx].to("cuda:0"), src[:, :, sidx]), "kernel copy is wrong"
        def pct(sec):
            return f"{nbytes / sec / 1e9:6.1f} GB/s ({100 * nbytes / sec / 1e9 / raw:.0f}%)"
        print(f"{nblk*16:>6} tok {nbytes/1e6:8.1f} MB: whole {pct(whole)}, per-layer {pct(per_layer)}, "
              f"runs-of-8 strided {pct(frag)}, scattered gather+copy+scatter {pct(g)}, "
              f"kernel fresh {pct(kfresh)}, kernel scattered {pct(kscat)}", flush=True)


if __name__ == "__main__":
    main()
