"""NIXL's own ceiling between two GPUs: one WRITE of N descriptors of S bytes, two processes.

    python -m pdserve.benchmarks.nixl_probe

Separates what NIXL/UCX costs from what the connector adds (kv_transfer.py). Prints GB/s per
(descriptors x size) next to the raw peer copy.
"""

import multiprocessing as mp
import statistics
import time

import torch

TOTAL = 1 << 30
SHAPES = [(1, TOTAL), (16, TOTAL // 16), (96, TOTAL // 96 // 4096 * 4096), (2048, TOTAL // 2048)]


def _target(conn):
    from nixl._api import nixl_agent, nixl_agent_config

    torch.cuda.set_device(1)
    buf = torch.empty(TOTAL, dtype=torch.uint8, device="cuda:1")
    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(buf.data_ptr(), TOTAL, 1, "")], "VRAM")
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    conn.recv()


def main() -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child,), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    src = torch.randint(0, 255, (TOTAL,), dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(TOTAL, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(8):
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        t0 = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(1); torch.cuda.synchronize(0)
        times.append(time.perf_counter() - t0)
    raw = TOTAL / statistics.median(times[2:]) / 1e9
    del dst
    agent = nixl_agent("source", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(src.data_ptr(), TOTAL, 0, "")], "VRAM")
    meta, remote_base = parent.recv()
    agent.add_remote_agent(meta)
    print(f"raw peer copy {raw:.1f} GB/s")
    for n, size in SHAPES:
        local = agent.get_xfer_descs([(src.data_ptr() + i * size, size, 0) for i in range(n)], "VRAM")
        remote = agent.get_xfer_descs([(remote_base + i * size, size, 1) for i in range(n)], "VRAM")
        ts = []
        for _ in range(7):
            h = agent.initialize_xfer("WRITE", local, remote, "target")
            t0 = time.perf_counter()
            agent.transfer(h)
            while agent.check_xfer_state(h) == "PROC":
                pass
            ts.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
        t = statistics.median(ts[2:])
        print(f"{n:>5} x {size / 2**20:8.2f} MiB: {n * size / t / 1e9:7.1f} GB/s ({100 * n * size / t / 1e9 / raw:.0f} % raw)",
              flush=True)
    parent.send("exit")
    proc.join(10)


if __name__ == "__main__":
    main()
