"""Cold start: `pdserve up` to ready on a real-layout checkpoint, its parts, and the weights' rate
against the disk's.

    python -m pdserve.benchmarks.cold_start --model qwen3-30b-a3b --dir /nvme/qwen3-dummy --device cuda
    python -m pdserve.benchmarks.cold_start --checkpoint /models/Qwen3-30B-A3B --device cuda
    python -m pdserve.benchmarks.cold_start --model qwen3-30b-a3b --num-layers 2 --device cpu   # 3.7 GB

1. The checkpoint: written by `pdserve write-checkpoint` (a preset's dummy weights, or a
   config.json's; timed) into --dir, or an existing one (--checkpoint).
2. `dd` (bs 64 MiB to /dev/null) of the same files, one after another: the disk's sequential rate,
   the reference; and (with several files) as many `dd`s at once as the loader has readers: the
   disk's rate for parallel streams. Before each timed read every file is evicted from this host's
   page cache (posix_fadvise DONTNEED: no root needed; what stays resident is measured with mincore and
   reported as `cached_before`). A cache below this host — a VM's host, a network file system's
   server — is out of reach and not accounted for.
3. The loader in this process (`load_model` onto --device): bytes, seconds, GB/s (cold, then again
   from the page cache: the loader's own ceiling beside dd's from the cache); on a GPU with
   several files, again with one reader thread (the A/B of weight_stream.READERS). Its other ceiling,
   without a disk: on a GPU the pinned host-to-device copy rate; on the CPU the first write to
   new memory (page faults), which reading into freshly allocated parameters pays.
4. `pdserve up` on the checkpoint (one colocated replica on --device, or --cluster FILE with its
   model.path set to the checkpoint), files evicted first, with model.prefetch on and off
   (--prefetch; --warm-first: after one start on dummy weights): the wall time from the command to
   /health 200, and the parts as `pdserve up` prints them (Ray, each worker's process start,
   weights and GB/s, CUDA graphs, engine; all workers; KV handshake; routers). One request checks
   that it serves; then Ctrl-C.
"""

import argparse
import ctypes
import datetime
import json
import mmap
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
import yaml

from pdserve.benchmarks.up_process import UpProcess
from pdserve.models import weight_stream
from pdserve.models.checkpoint_writer import DTYPE_NAMES, parse_size, write_checkpoint
from pdserve.models.loader import load_model, safetensors_files

DD_BLOCK = "64M"


def evict(files: list[Path]) -> None:
    """Drop the files' pages from this host's page cache (clean pages: no root needed)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(files: list[Path]) -> float | None:
    """The share of the files' pages resident in this host's page cache (mincore); None where unknown."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = -(-size // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        # A private mapping (ctypes needs a writable buffer to take its address); nothing is written
        # and mapping reads nothing in.
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                                              prot=mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            view = (ctypes.c_char * 1).from_buffer(mm)
            try:
                failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(view)), ctypes.c_size_t(size),
                                      vec.ctypes.data_as(ctypes.c_void_p))
            finally:
                del view
        if failed:
            return None
        resident += int((vec & 1).sum())
        total += pages
    return resident / total if total else None


def dd_read(files: list[Path]) -> dict:
    """`dd` of every file to /dev/null, one after another: seconds and GB/s."""
    size = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    for path in files:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}", "status=none"], check=True)
    s = time.perf_counter() - t0
    return {"bytes": size, "s": round(s, 3), "gb_per_s": round(size / s / 1e9, 3)}


def dd_parallel(files: list[Path], n: int) -> dict:
    """Up to `n` `dd`s at once, one file each: what the disk gives several sequential streams."""
    size = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    running: list[subprocess.Popen] = []
    for path in files:
        if len(running) == n:
            running.pop(0).wait()
        running.append(subprocess.Popen(["dd", f"if={path}", "of=/dev/null", f"bs={DD_BLOCK}", "status=none"]))
    for proc in running:
        proc.wait()
    s = time.perf_counter() - t0
    return {"bytes": size, "s": round(s, 3), "gb_per_s": round(size / s / 1e9, 3), "streams": n}


def loader_read(checkpoint: Path, dtype: torch.dtype, device: str, readers: int | None = None) -> dict:
    """load_model onto the device: the loader's own figures (LoadStats); `readers`: the GPU
    reader's threads for this read (weight_stream.READERS otherwise)."""
    default = weight_stream.READERS
    weight_stream.READERS = readers or default
    try:
        model, _ = load_model(str(checkpoint), dtype, device)
    finally:
        weight_stream.READERS = default
    st = model.load_stats
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"bytes": st.bytes, "s": round(st.weights_s, 3), "gb_per_s": round(st.gb_per_s, 3),
            "model_s": round(st.total_s, 3)}


def memory_ceiling(nbytes: int, device: str) -> dict:
    """What the weights' way into memory costs without any disk: on a GPU the copy from pinned host
    memory to the device (1 GiB in 64 MiB pieces, as the loader copies); on the CPU the first write
    to freshly allocated memory of the checkpoint's size (its page faults), which every loader into
    new parameters pays."""
    if device.startswith("cuda"):
        src = torch.empty(64 * 2**20, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(2**30, dtype=torch.uint8, device=device)
        for _ in range(2):  # the first round warms the copy engine up
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for k in range(16):
                dst[k * src.numel():(k + 1) * src.numel()].copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            s = time.perf_counter() - t0
        what, size = "pinned host to device copy", dst.numel()
        del src, dst
        torch.cuda.empty_cache()
    else:
        t0 = time.perf_counter()
        fresh = torch.empty(nbytes, dtype=torch.uint8)
        fresh[::4096].zero_()
        s, what, size = time.perf_counter() - t0, "first touch of new memory", nbytes
        del fresh
    return {"what": what, "bytes": size, "s": round(s, 3), "gb_per_s": round(size / s / 1e9, 3)}


# What `pdserve up` prints (pdserve/control/commands.py and controller.py), parsed into parts.
_LINES = {
    "ray_s": re.compile(r"\] Ray (?:started|joined) in ([\d.]+) s"),
    "workers_s": re.compile(r" workers ready in ([\d.]+) s"),
    "handshake_s": re.compile(r" KV handshake done \([^)]*\) in ([\d.]+) s"),
    "routers_s": re.compile(r" routers ready in ([\d.]+) s"),
    "prefetch_s": re.compile(r" checkpoint prefetch done: [\d.]+ GB into the page cache in ([\d.]+) s"),
    "up_s": re.compile(r"\] up in ([\d.]+) s"),
}
_WORKER = re.compile(
    r" (\S+) ready \(\d+/\d+\) in (?P<ready>[\d.]+) s: process up in (?P<process>[-\d.]+) s, weights "
    r"(?P<gb>[\d.]+) GB (?P<source>from \d+ files|dummy) in (?P<weights>[\d.]+) s \((?P<gbps>[\d.]+) GB/s\), "
    r"model (?P<model>[\d.]+) s(?:, CUDA graphs (?P<graphs>[\d.]+) s)?(?:, warm-up (?P<warm>[\d.]+) s)?, "
    r"engine ready in (?P<engine>[\d.]+) s")


def parse_up(output: str) -> dict:
    """The parts of `pdserve up`'s start from what it printed."""
    parts: dict = {}
    for key, pattern in _LINES.items():
        if m := pattern.search(output):
            parts[key] = float(m[1])
    workers = []
    for m in _WORKER.finditer(output):
        workers.append({"name": m[1], "ready_s": float(m["ready"]), "process_s": float(m["process"]),
                        "weights_gb": float(m["gb"]), "source": m["source"], "weights_s": float(m["weights"]),
                        "weights_gb_per_s": float(m["gbps"]), "model_s": float(m["model"]),
                        "graphs_s": float(m["graphs"]) if m["graphs"] else None,
                        "warm_up_s": float(m["warm"]) if m["warm"] else None, "engine_s": float(m["engine"])})
    parts["workers"] = workers
    return parts


def cluster_file(checkpoint: Path, device: str, dtype: str, base: Path | None, out: Path, prefetch: bool = True
                 ) -> Path:
    """The cluster to start: --cluster's file with model.path set to the checkpoint, or one
    colocated replica on the device; routers on any free port."""
    cfg = yaml.safe_load(base.read_text()) if base else {
        "colocated": {"replicas": 1, "gpus": 1 if device.startswith("cuda") else 0}}
    cfg.setdefault("model", {}).update({"path": str(checkpoint), "load_format": "auto", "dtype": dtype,
                                        "prefetch": prefetch})
    cfg.setdefault("router", {}).update({"host": "127.0.0.1", "http_port": 0, "grpc_port": None})
    path = out / f"cluster{'' if prefetch else '.no-prefetch'}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def up_to_ready(cluster: Path, out: Path, timeout_s: float) -> dict:
    """`pdserve up` from its command to /health 200; the parts it printed; one request served."""
    t0 = time.perf_counter()
    up = UpProcess(cluster, out / "pdserve-up.log")
    try:
        url = up.wait_healthy(None, timeout_s, progress=lambda m: print(f"[cold_start] {m}", file=sys.stderr))
        wall = time.perf_counter() - t0
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        served = r.json()["usage"]["completion_tokens"]
    finally:
        code, how = up.stop(120)
    return {"wall_to_healthy_s": round(wall, 3), "served_tokens": served, "stopped": how, "exit_code": code,
            **parse_up(up.output())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", default="tiny-moe",
                     help="write dummy weights of this preset or config.json (default tiny-moe)")
    src.add_argument("--checkpoint", type=Path, help="an existing HF checkpoint directory instead")
    p.add_argument("--dir", type=Path, help="where to write the checkpoint (default: a new temporary directory)")
    p.add_argument("--dtype", default="bfloat16", choices=list(DTYPE_NAMES))
    p.add_argument("--shard-size", default="5GB")
    p.add_argument("--num-layers", type=int, help="write only the model's first N layers")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cluster", type=Path, help="cluster.yaml to start (its model.path is replaced)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds `pdserve up` may take to serve")
    p.add_argument("--no-loader-reads", action="store_true",
                   help="skip the loader's reads in this process (dd, the reference, still runs): a full-size "
                        "checkpoint's `pdserve up` runs in less time")
    p.add_argument("--warm-first", action="store_true",
                   help="one `pdserve up` on dummy weights before the timed ones: Triton's kernel cache and Ray's "
                        "files are then warm for both, as for any start after the first on a host (the first pays "
                        "for compiling kernels; it is reported too)")
    p.add_argument("--prefetch", choices=["on", "off", "both"], default="both",
                   help="model.prefetch of the `pdserve up` runs: both = one of each, files evicted before each")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)

    dtype = DTYPE_NAMES[a.dtype]
    out = Path(tempfile.mkdtemp(prefix="pdserve-cold-start-"))
    result: dict = {"date": datetime.date.today().isoformat(), "device": _device_name(a.device), "dtype": a.dtype}
    if a.checkpoint:
        ck = a.checkpoint
    else:
        ck = a.dir or out / "checkpoint"
        t0 = time.perf_counter()
        write_checkpoint(a.model, ck, dtype, parse_size(a.shard_size), 0, "cuda" if a.device.startswith("cuda") else "cpu",
                         a.num_layers, log=lambda m: print(f"[cold_start] {m}", file=sys.stderr))
        s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in safetensors_files(ck))
        result["write"] = {"s": round(s, 3), "gb_per_s": round(size / s / 1e9, 3)}
    files = safetensors_files(ck)
    result["checkpoint"] = {"dir": str(ck), "files": len(files), "bytes": sum(f.stat().st_size for f in files)}

    result["memory"] = memory_ceiling(result["checkpoint"]["bytes"], a.device)
    streams = min(weight_stream.READERS, len(files))
    reads = [("dd", lambda: dd_read(files))]
    if not a.no_loader_reads:
        reads.append(("loader", lambda: loader_read(ck, dtype, a.device)))
    if streams > 1:  # the parallel reads beside the one-stream ones: what more streams add
        reads.append(("dd_parallel", lambda: dd_parallel(files, streams)))
        if a.device.startswith("cuda") and not a.no_loader_reads:  # (the CPU's reader is one stream of scatter reads)
            reads.append(("loader_one_reader", lambda: loader_read(ck, dtype, a.device, readers=1)))
    for name, read in reads:
        evict(files)
        cached = cached_fraction(files)
        result[name] = {**read(), "cached_before": None if cached is None else round(cached, 4)}
        result[f"{name}_page_cache"] = {**read(), "cached_before": _round(cached_fraction(files))}
    if a.warm_first:
        cfg = yaml.safe_load(cluster_file(ck, a.device, a.dtype, a.cluster, out, False).read_text())
        cfg["model"]["load_format"] = "dummy"
        (warm := out / "cluster.warm.yaml").write_text(yaml.safe_dump(cfg))
        result["up_first_dummy"] = {"prefetch": False, **up_to_ready(warm, out, a.timeout)}
    for key, prefetch in (("up", True), ("up_no_prefetch", False)):
        if a.prefetch != "both" and prefetch != (a.prefetch == "on"):
            continue
        evict(files)
        result[key] = {"cached_before": _round(cached_fraction(files)), "prefetch": prefetch,
                       **up_to_ready(cluster_file(ck, a.device, a.dtype, a.cluster, out, prefetch), out, a.timeout)}
    _report(result)
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({os.cpu_count()} cores)"


def _report(r: dict) -> None:
    ck = r["checkpoint"]
    print(f"cold start on {r['device']}, {r['dtype']}, {r['date']}: {ck['dir']} ({ck['bytes'] / 1e9:.2f} GB, "
          f"{ck['files']} files)")
    if "write" in r:
        print(f"  written by write-checkpoint in {r['write']['s']:.2f} s ({r['write']['gb_per_s']:.2f} GB/s)")
    for name in ("dd", "dd_parallel", "loader", "loader_one_reader"):
        if name not in r:
            continue
        cold, warm = r[name], r[f"{name}_page_cache"]
        print(f"  {name:17s}  from disk {cold['s']:7.2f} s {cold['gb_per_s']:6.2f} GB/s (cached before: "
              f"{cold['cached_before']}),  from the page cache {warm['s']:6.2f} s {warm['gb_per_s']:6.2f} GB/s")
    m = r["memory"]
    print(f"  {m['what']}: {m['gb_per_s']:.2f} GB/s (no disk: the loader's other ceiling)")
    if "dd_parallel" in r and "loader" in r:
        print(f"  loader / {r['dd_parallel']['streams']} dd at once from disk: "
              f"{r['loader']['gb_per_s'] / r['dd_parallel']['gb_per_s']:.2f}")
    if "loader" in r:
        print(f"  loader / dd from disk: {r['loader']['gb_per_s'] / r['dd']['gb_per_s']:.2f}; loader / min(dd, memory): "
              f"{r['loader']['gb_per_s'] / min(r['dd']['gb_per_s'], m['gb_per_s']):.2f}")
    for key in ("up_first_dummy", "up", "up_no_prefetch"):
        if key in r:
            if key == "up_first_dummy":
                print("  first, on dummy weights (compiles the kernels; warms Triton's cache and Ray's files):")
            _report_up(r[key])


def _report_up(up: dict) -> None:
    prefetch = f", prefetch {up['prefetch_s']} s" if up.get("prefetch_s") is not None else ""
    print(f"  pdserve up (model.prefetch: {str(up['prefetch']).lower()}) to /health 200: {up['wall_to_healthy_s']:.2f} s "
          f"(its own count: {up.get('up_s')} s); Ray {up.get('ray_s')} s, workers {up.get('workers_s')} s, "
          f"KV handshake {up.get('handshake_s', '-')} s, routers {up.get('routers_s')} s{prefetch}")
    for w in up["workers"]:
        graphs = "" if w["graphs_s"] is None else f", graphs {w['graphs_s']:.2f} s"
        graphs += "" if w.get("warm_up_s") is None else f", warm-up {w['warm_up_s']:.2f} s"
        print(f"    {w['name']}: process up {w['process_s']:.2f} s, weights {w['weights_gb']:.2f} GB in "
              f"{w['weights_s']:.2f} s ({w['weights_gb_per_s']:.2f} GB/s), model {w['model_s']:.2f} s{graphs}, "
              f"engine {w['engine_s']:.2f} s")
    print(f"    served: {up['served_tokens']} tokens; stopped: {up['stopped']}")


if __name__ == "__main__":
    sys.exit(main())
