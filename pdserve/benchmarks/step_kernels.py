"""Where one engine step's time goes: host time, GPU kernel time, kernel count, the top kernels.

`profile_step(fn, device)` runs `fn` once under torch.profiler and sums what the device ran. A
step whose host time is well above its GPU time is launch-bound (the host cannot queue kernels
as fast as the GPU runs them); one whose GPU time is near its host time is GPU-bound, and the
top kernels say which to make faster. bench_engine's `--profile` prints one line per step shape.
"""

import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def profile_step(fn: Callable[[], Any], device: torch.device, trace: Path | None = None, top: int = 8
                 ) -> dict[str, Any]:
    """Run fn() once, profiled. -> {host_ms, gpu_ms, kernels, top: [[name, ms, calls], ...]};
    `trace` also gets a Chrome trace (open in https://ui.perfetto.dev)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        host_s = time.perf_counter() - t0
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    gpu_us = kernels = 0
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.time_range.elapsed_us()
        gpu_us += us
        kernels += 1
        slot = by_name[ev.name[:80]]
        slot[0] += us
        slot[1] += 1
    if trace is not None:
        trace.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace))
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"host_ms": round(host_s * 1e3, 3), "gpu_ms": round(gpu_us / 1e3, 3), "kernels": kernels,
            "top": [[name, round(us / 1e3, 3), n] for name, (us, n) in ranked]}


def summary(label: str, p: dict[str, Any]) -> str:
    """One line: host vs GPU time, kernel count, the three heaviest kernels."""
    heavy = "; ".join(f"{name[:40]} {ms} ms x{n}" for name, ms, n in p["top"][:3])
    return (f"profile {label}: host {p['host_ms']} ms, GPU busy {p['gpu_ms']} ms over {p['kernels']} kernels"
            f"{' — ' + heavy if heavy else ''}")
