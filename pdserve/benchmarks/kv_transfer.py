"""KV transfer between two GPUs in two processes, against the raw GPU0 -> GPU1 copy rate.

    python -m pdserve.benchmarks.kv_transfer [--backends nixl] [--sizes 1024 4096 16384 65536]
                                             [--ttft 16384] [--json out.json]
    python -m pdserve.benchmarks.kv_transfer --backends cuda_ipc --sizes 4096 --ttft 0 \\
        --presets qwen3-30b-a3b deepseek-v2-lite --kv-cache-dtypes auto fp8_e4m3
    python -m pdserve.benchmarks.kv_transfer --backends nixl nixl-blocks cuda_ipc --sizes 4096 16384 --ttft 0
    python -m pdserve.benchmarks.kv_transfer --cpu --backends nixl nixl-blocks tcp --sizes 4096 16384 --ttft 0

`--backends`: each in turn, in the same run, against the same reference. nixl: through staging
slots (kvtransfer/staging.py: gathered, written as one descriptor per run of layers, scattered by
the decode end at the finish notice); nixl-blocks: NIXL without slots, a descriptor per run of
blocks (the path before the slots); tcp; cuda_ipc. `--cpu`: CPU memory in both processes, the
reference a 1 GiB copy in one process (what one core's memory bandwidth allows).

Part 1: one request's KV moved by the connector — all layers in one post, for fresh (one run),
fragmented (runs of 8 blocks) and scattered (runs of 1 block) allocations on both sides, and fresh
posted layer by layer as layer-wise streaming posts it — for each preset's cache layout
(`KVLayout.for_model`, as the engine builds it: K/V planes of the KV heads, or DeepSeek's one latent
plane) in each `--kv-cache-dtypes` (auto: the model's bf16; fp8_e4m3: one byte a value), each pair
with a decode process of its own. Reference: a 1 GiB cudaMemcpy peer copy, same run. Besides
the prefill end's clock (finish notice sent), `landed`: until the decode process's poll has the KV
in its blocks (a staged transfer's scatter included; an upper bound: the parent's pipe wakes it).
For cuda_ipc also where the time goes: the posting calls' host time, the copy stream's time, the
copy kernel alone on the same blocks, and the host cost of a post's pieces (`post costs`).
Part 2: TTFT of a prompt prefilled by the real engine (dummy weights) with layer-wise streaming
into the decode process, against the same prefill with no transfer.
"""

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import time

import torch

from pdserve.messages import Request
from pdserve.forward.kv_cache import KV_CACHE_DTYPES, KVLayout, allocate_kv_cache
from pdserve.models import resolve_model_args
from pdserve.models.loader import model_fingerprint

PRESET = "qwen3-30b-a3b"
KV_CACHE_DTYPE = "auto"  # ModelConfig.kv_cache_dtype: the model's bf16, or fp8_e4m3
BLOCK = 16


def layout_for(num_blocks: int) -> KVLayout:
    """The engine's layout for PRESET's cache in KV_CACHE_DTYPE (an FP8 one with its unit scales)."""
    dtype = KV_CACHE_DTYPES.get(KV_CACHE_DTYPE, torch.bfloat16)
    return KVLayout.for_model(resolve_model_args(PRESET), num_blocks, BLOCK, dtype)


def fill_random(kv: torch.Tensor) -> None:
    """N(0, 1) values (an FP8 cache through bfloat16, layer by layer: it has no normal_)."""
    if kv.dtype.itemsize > 1:
        kv.normal_()
        return
    for layer in kv:
        layer.copy_(torch.randn(layer.shape, device=layer.device, dtype=torch.bfloat16))


def fingerprint() -> str:
    return model_fingerprint(PRESET, resolve_model_args(PRESET), torch.bfloat16, "dummy", 0)


def blocks_for(n_blocks: int, pattern: str, offset: int = 0) -> list[int]:
    """Block ids of a request: one run, runs of 8 with gaps, or every other block."""
    if pattern == "fresh":
        return list(range(offset, offset + n_blocks))
    run = 8 if pattern == "fragmented" else 1
    return [offset + (i // run) * 2 * run + i % run for i in range(n_blocks)]


def _decode_main(conn, backend: str, num_blocks: int, device: str, preset: str, kv_cache_dtype: str,
                 kw: dict) -> None:
    from pdserve.kvtransfer import make_connector

    global PRESET, KV_CACHE_DTYPE
    PRESET, KV_CACHE_DTYPE = preset, kv_cache_dtype  # a spawned child does not see the parent's assignment
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    kv = allocate_kv_cache(layout_for(num_blocks), torch.device(device))
    conn_ = make_connector("decode", backend, "bench-decode", kv, layout_for(num_blocks), fingerprint(), **kw)
    while True:
        while not conn.poll(0.0005):  # like a decode worker with reservations pending
            conn_.progress()
        cmd, *args = conn.recv()
        if cmd == "meta":
            conn.send(conn_.metadata())
        elif cmd == "add_peer":
            conn.send(conn_.add_peer(args[0]))
        elif cmd == "reserve":
            rid, ids = args
            conn.send(conn_.reserve(rid, ids, 600.0).pack())
        elif cmd == "checksum":  # of the blocks a request landed in: compared with the source's
            conn.send(kv[:, :, args[0]].float().sum().item())
        elif cmd == "wait":  # -> (done, failed, perf_counter once the KV is in its blocks)
            deadline = time.time() + 120
            while time.time() < deadline:
                p = conn_.poll()
                if p.done or p.failed:
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()  # a staged transfer's scatter, queued by poll()
                    conn.send((len(p.done), len(p.failed), time.perf_counter()))
                    break
                time.sleep(0.0002)
            else:
                conn.send((0, 0, 0.0))
        elif cmd == "exit":
            conn_.close()
            conn.send(None)
            return


def raw_copy_gbs(nbytes: int = 1 << 30, reps: int = 10, cpu: bool = False) -> float:
    """GPU0 -> GPU1 copy rate (GB/s), median of reps, the link's ceiling for part 1 (`cpu`: a copy
    between two CPU buffers of one process)."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device="cpu" if cpu else "cuda:0")
    dst = torch.empty_like(src, device="cpu" if cpu else "cuda:1")
    if cpu:
        times = []
        for _ in range(reps + 2):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return nbytes / statistics.median(times[2:]) / 1e9
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(0)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[2:]) / 1e9


def move_once(prefill, decode, rid: str, n_tokens: int, pattern: str, layout: KVLayout,
              kv: torch.Tensor | None = None, post: str = "whole", split: dict | None = None
              ) -> tuple[float, float, float]:
    """Seconds from the first post until (a) the finish notice is on its way to the decode
    process — every byte written; the connector's own clock (`delivered()`), which starts before
    the first post's host work — and (b) the caller, waiting on the prefill end, has been told
    (a thread wake-up later). post "whole": all layers in one send_layers call (KV that is
    complete already); "layers": one send_layer per layer, as layer-wise streaming posts.

    `split` (cuda_ipc): gets where the time went — `post_us`, the host time of the posting calls;
    `stream_ms`, the copy stream's time from the first post's arrival to the last copy's end (the
    posting's launch latency and the copies); `waited_ms`, from the first post until the
    completion thread's wait for the copy returned (its excess over `stream_ms` is the detection
    lag); `notify_us`, the finish notice's send. Third: seconds until the decode process's poll
    had the KV in its blocks (see the module's docstring)."""
    from pdserve.kvtransfer import ReserveHandle

    n_blocks = -(-n_tokens // BLOCK)
    handle = ReserveHandle.unpack(decode_call(decode, "reserve", rid, blocks_for(n_blocks, pattern, 1)))
    src = blocks_for(n_blocks, pattern, 3)
    stream = getattr(prefill.backend, "stream", None) if split is not None else None
    if stream is not None:
        marks = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks[0].record(stream)
        stamps = _stamp_completion(prefill.backend)
    t0 = time.perf_counter()
    if post == "whole":
        prefill.send_layers(rid, 0, layout.num_layers, src, handle)
    else:
        for layer in range(layout.num_layers):
            prefill.send_layer(rid, layer, src, handle)
    t_posted = time.perf_counter()
    if stream is not None:
        marks[1].record(stream)
    prefill.finish(rid, 0)
    while True:
        done, failed = prefill.poll()
        if done or failed:
            break
        prefill.wait(0.001)
    dt = time.perf_counter() - t0
    assert done == [rid], (done, failed)
    (_, notice_s), = prefill.delivered()
    *counts, landed = decode_call(decode, "wait")
    assert counts == [1, 0], counts
    if kv is not None:  # the bytes arrived where they belong
        got = decode_call(decode, "checksum", handle.block_ids)
        want = kv[:, :, src].float().sum().item()
        assert got == want, f"{rid}: destination checksum {got} != source {want}"
    if stream is not None:
        del prefill.backend.wait, prefill.backend.notify  # the class's own again
        split.setdefault("post_us", []).append(1e6 * (t_posted - t0))
        split.setdefault("stream_ms", []).append(marks[0].elapsed_time(marks[1]))
        split.setdefault("waited_ms", []).append(1e3 * (stamps["waited"] - t0))
        split.setdefault("notify_us", []).append(1e6 * (stamps["sent"] - stamps["send"]))
    return notice_s, dt, landed - t0


def _stamp_completion(backend) -> dict:
    """Host clock stamps of the completion thread's steps for one transfer: shadows the
    backend's wait and notify on the instance (undone by deleting the attributes)."""
    stamps: dict = {}
    wait, notify = backend.wait, backend.notify

    def timed_wait(token):
        ok = wait(token)
        stamps["waited"] = time.perf_counter()
        return ok

    def timed_notify(peer, payload):
        stamps["send"] = time.perf_counter()
        notify(peer, payload)
        stamps["sent"] = time.perf_counter()

    backend.wait, backend.notify = timed_wait, timed_notify
    return stamps


def kernel_only_ms(prefill, peer: str, n_tokens: int, pattern: str, layout: KVLayout, reps: int,
                   ids: str = "gpu") -> float:
    """cuda_ipc: the copy kernel alone (CUDA events around the launch), the same blocks as a whole
    post: the in-run ceiling of the connector's figure. ids "gpu": read from device memory;
    "pinned": from pinned host memory, as the connector's posts read them."""
    n_blocks = -(-n_tokens // BLOCK)
    dev = prefill.backend.kv.device if ids == "gpu" else "cpu"
    src = torch.tensor(blocks_for(n_blocks, pattern, 3), dtype=torch.int32, device=dev)
    dst = torch.tensor(blocks_for(n_blocks, pattern, 1), dtype=torch.int32, device=dev)
    if ids == "pinned":
        src, dst = src.pin_memory(), dst.pin_memory()
    copy = prefill.backend._peer_copy(peer)
    times = []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        copy(0, layout.num_layers, src, dst)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def backend_kw(args) -> dict:
    """The backend's options for args.variant: nixl with staging slots large enough for the
    largest request (one for a post, one for a lease), nixl-blocks with none."""
    if args.backend != "nixl":
        return {}
    slot_mb = max(args.sizes + [args.ttft]) * layout_for(1).bytes_per_token / 2**20
    return {"num_workers": args.nixl_workers, "progress_thread": args.nixl_progress_thread,
            "staging_slots": 2 if args.variant == "nixl" else 0, "staging_slot_mb": slot_mb}


def decode_call(decode, *msg):
    decode[0].send(msg)
    return decode[0].recv()


def post_costs(prefill, peer: str, layout: KVLayout, n_tokens: int = 4096, reps: int = 50) -> dict:
    """cuda_ipc: host microseconds (median) of the pieces of one whole post of a fresh request,
    each timed alone (the stream synchronised between calls, so no queue builds up), and the
    wake-up of a thread waiting on a threading.Event — what the connector pays around the copy."""
    import threading

    b = prefill.backend
    n_blocks = -(-n_tokens // BLOCK)
    src, dst = blocks_for(n_blocks, "fresh", 3), blocks_for(n_blocks, "fresh", 1)
    copy = b._peer_copy(peer)
    sid = torch.tensor(src, dtype=torch.int32, device=b.kv.device)
    did = torch.tensor(dst, dtype=torch.int32, device=b.kv.device)

    def stage():
        b._staged = None  # no reuse: a new request's ids
        b._stage(src, dst, copy.dst_num_blocks)

    def write_range():
        b._staged = None
        b.write_range(peer, 0, layout.num_layers, src, dst)

    def jit_launch():  # the same kernel through Triton's JIT, as before BlockCopy kept the compiled one
        kernel, copy._kernel = copy._kernel, None
        copy(0, 1, sid, did)
        copy._kernel = kernel

    pieces = {"launch (kernel, 1 layer)": lambda: copy(0, 1, sid, did, stream=b._raw_stream),
              "launch through the JIT": jit_launch,
              "event record": lambda: torch.cuda.Event().record(b.stream),
              "stage ids": stage, "write_range": write_range}
    out = {}
    for name, fn in pieces.items():
        times = []
        for _ in range(reps + 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = round(1e6 * statistics.median(times[5:]), 1)
    torch.cuda.synchronize()
    woke, go = [], threading.Event()

    def waiter():
        go.wait()
        woke.append(time.perf_counter())

    wakes = []
    for _ in range(20):
        go.clear()
        th = threading.Thread(target=waiter)
        th.start()
        time.sleep(0.002)
        t0 = time.perf_counter()
        go.set()
        th.join()
        wakes.append(woke[-1] - t0)
    out["thread wake-up"] = round(1e6 * statistics.median(wakes), 1)
    print("post costs (host us): " + json.dumps(out), flush=True)
    return out


def part1(args, decode, prefill, layout, kv, peer: str) -> list[dict]:
    rows = []
    cases = [("fresh", "whole"), ("fragmented", "whole"), ("scattered", "whole"), ("fresh", "layers")]
    for n in args.sizes:
        nbytes = n * layout.bytes_per_token
        for pattern, post in cases:
            name = f"{args.variant}-{PRESET}-{KV_CACHE_DTYPE}-{pattern}-{post}-{n}"
            move_once(prefill, decode, f"{name}-check", n, pattern, layout, kv=kv, post=post)  # also warms up
            split: dict = {}
            both = [move_once(prefill, decode, f"{name}-{i}", n, pattern, layout, post=post, split=split)
                    for i in range(args.reps)]
            times, seen, landed = ([b[i] for b in both] for i in range(3))
            t, c, land = statistics.median(times), statistics.median(seen), statistics.median(landed)
            rows.append({"backend": args.variant, "preset": PRESET, "kv": KV_CACHE_DTYPE,
                         "bytes_per_token": layout.bytes_per_token,
                         "tokens": n, "pattern": pattern, "post": post, "MB": round(nbytes / 1e6, 1),
                         "ms": round(t * 1e3, 3), "GB/s": round(nbytes / t / 1e9, 3),
                         "ms_all": [round(x * 1e3, 3) for x in times],
                         "caller_ms": round(c * 1e3, 3), "caller_GB_s": round(nbytes / c / 1e9, 3),
                         "landed_ms": round(land * 1e3, 3), "landed_GB_s": round(nbytes / land / 1e9, 3)})
            if split:
                rows[-1].update({k: round(statistics.median(v), 3 if k.endswith("ms") else 1)
                                 for k, v in split.items()})
            if args.backend == "cuda_ipc" and post == "whole":
                k = kernel_only_ms(prefill, peer, n, pattern, layout, args.reps)
                kp = kernel_only_ms(prefill, peer, n, pattern, layout, args.reps, ids="pinned")
                rows[-1].update(kernel_ms=round(k, 3), kernel_GB_s=round(nbytes / k / 1e6, 1),
                                kernel_pinned_ms=round(kp, 3), kernel_pinned_GB_s=round(nbytes / kp / 1e6, 1))
            print(rows[-1], flush=True)
    return rows


def one_layout(args, dev0: str, dev1: str, num_blocks: int, first: bool) -> tuple[list[dict], dict | None, dict | None]:
    """Part 1 (and, for the first layout, the post costs and part 2) for PRESET's cache in
    KV_CACHE_DTYPE, against a decode process of its own."""
    from pdserve.kvtransfer import make_connector

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_main, args=(child, args.backend, num_blocks, dev1, PRESET, KV_CACHE_DTYPE,
                                                  backend_kw(args)), daemon=True)
    proc.start()
    decode = (parent, proc)
    layout = layout_for(num_blocks)
    kv = allocate_kv_cache(layout, torch.device(dev0))
    fill_random(kv)
    prefill = make_connector("prefill", args.backend, "bench-prefill", kv, layout, fingerprint(), **backend_kw(args))
    peer = prefill.add_peer(decode_call(decode, "meta"))
    decode_call(decode, "add_peer", prefill.metadata())
    costs = post_costs(prefill, peer, layout) if args.backend == "cuda_ipc" and first else None
    rows = part1(args, decode, prefill, layout, kv, peer)
    prefill.close()
    del kv
    if not args.cpu:
        torch.cuda.empty_cache()
    ttft = part2_with_engine(args, decode, dev0) if args.ttft and first else None
    decode_call(decode, "exit")
    proc.join(30)
    return rows, costs, ttft


def main() -> None:
    global PRESET, KV_CACHE_DTYPE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", "--backend", nargs="+", default=["nixl"],
                    choices=["nixl", "nixl-blocks", "tcp", "cuda_ipc"],
                    help="each in turn, same run (nixl-blocks: NIXL without staging slots)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--ttft", type=int, default=16384, help="prompt tokens for part 2 (first layout); 0 skips it")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--nixl-workers", type=int, default=1, help="UCX workers of each NIXL agent")
    ap.add_argument("--nixl-progress-thread", action="store_true", help="NIXL's own (spinning) progress thread")
    ap.add_argument("--model", default=PRESET, help="preset whose KV shape and weights are used")
    ap.add_argument("--presets", nargs="+",
                    help="several presets' cache layouts, one after the other (default: --model)")
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["auto"], choices=["auto", *KV_CACHE_DTYPES],
                    help="the cache's dtype: auto (the model's, bf16) and/or fp8_e4m3")
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU memory (checks the script, not a figure)")
    args = ap.parse_args()
    dev0, dev1 = ("cpu", "cpu") if args.cpu else ("cuda:0", "cuda:1")
    if not args.cpu:
        torch.cuda.set_device(0)
    raw = raw_copy_gbs(cpu=args.cpu)
    print(f"raw {'CPU' if args.cpu else 'GPU0->GPU1'} copy: {raw:.1f} GB/s", flush=True)

    # Scattered allocations need twice the blocks of the request; +8 for the offsets.
    num_blocks = 2 * -(-max(args.sizes + [args.ttft]) // BLOCK) + 8
    rows, costs, ttft = [], None, {}
    layouts = [(p, d) for p in (args.presets or [args.model]) for d in args.kv_cache_dtypes]
    for args.variant in args.backends:
        args.backend = args.variant.removesuffix("-blocks")
        for i, (PRESET, KV_CACHE_DTYPE) in enumerate(layouts):
            r, c, t = one_layout(args, dev0, dev1, num_blocks, first=i == 0)
            rows += r
            costs = costs or c
            if t:
                ttft[args.variant] = t

    meta = {"date": datetime.date.today().isoformat(),
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
            "backends": args.backends, "nixl_workers": args.nixl_workers,
            "nixl_progress_thread": args.nixl_progress_thread, "torch": torch.__version__, "raw_copy_GB/s": round(raw, 1)}
    print(f"\nraw {'CPU' if args.cpu else 'GPU0->GPU1'} copy {raw:.1f} GB/s ({meta['device']})")
    print("ms / % raw: first post -> finish notice sent (every byte written); caller: -> the waiting caller told; "
          "landed: -> the decode process's poll has the KV in its blocks")
    print(f"{'backend':>11} {'preset':>16} {'kv':>8} {'B/token':>8} {'tokens':>7} {'pattern':>10} {'post':>6} {'MB':>8}"
          f" {'ms':>9} {'GB/s':>7} {'% raw':>6} {'caller %':>8} {'landed ms':>9} {'landed %':>8}"
          f" {'post us':>8} {'stream ms':>9} {'waited ms':>9}"
          f" {'notify us':>9} {'kernel ms':>9} {'kernel %':>8} {'pinned %':>8}")
    for r in rows:
        r["pct_raw"] = round(100 * r["GB/s"] / raw, 1)
        r["caller_pct_raw"] = round(100 * r["caller_GB_s"] / raw, 1)
        r["landed_pct_raw"] = round(100 * r["landed_GB_s"] / raw, 1)
        if "kernel_GB_s" in r:
            r["kernel_pct_raw"] = round(100 * r["kernel_GB_s"] / raw, 1)
            r["kernel_pinned_pct_raw"] = round(100 * r["kernel_pinned_GB_s"] / raw, 1)
        print(f"{r['backend']:>11} {r['preset']:>16} {r['kv']:>8} {r['bytes_per_token']:>8} {r['tokens']:>7}"
              f" {r['pattern']:>10} {r['post']:>6} {r['MB']:>8} {r['ms']:>9} {r['GB/s']:>7} "
              f"{r['pct_raw']:>6} {r['caller_pct_raw']:>8} {r['landed_ms']:>9} {r['landed_pct_raw']:>8}"
              f" {r.get('post_us', ''):>8} {r.get('stream_ms', ''):>9}"
              f" {r.get('waited_ms', ''):>9} {r.get('notify_us', ''):>9} {r.get('kernel_ms', ''):>9}"
              f" {r.get('kernel_pct_raw', ''):>8} {r.get('kernel_pinned_pct_raw', ''):>8}")
    if costs:
        print("post costs (host us): " + json.dumps(costs))
    for variant, t in ttft.items():
        print(f"TTFT {t['tokens']} tokens ({variant}): prefill only {t['prefill_only_ms']} ms, with streaming "
              f"{t['prefill_streamed_ms']} ms, overhead {t['overhead_pct']} %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "transfer": rows, "post_costs_us": costs, "ttft": ttft}, f, indent=1)


def part2_with_engine(args, decode, device: str) -> dict:
    """Build the prefill engine, connect its KV allocation to the decode process, measure TTFT."""
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine

    from pdserve.kvtransfer import make_connector

    n = args.ttft
    model = ModelConfig(path=PRESET, load_format="dummy", dtype="bfloat16", kv_cache_dtype=KV_CACHE_DTYPE)
    cfg = EngineConfig(model=model, role="prefill", device=device,
                       num_kv_blocks=-(-n // BLOCK) + 8, max_num_batched_tokens=n, chunk_size=n,
                       enable_prefix_cache=False)
    engine = Engine(cfg, log=lambda m: print(m, flush=True))
    conn = make_connector("prefill", args.backend, "bench-prefill-engine", engine.kv_cache, engine.layout,
                          engine.fingerprint, **backend_kw(args))
    conn.add_peer(decode_call(decode, "meta"))
    decode_call(decode, "add_peer", conn.metadata())
    out = part2_run(args, decode, engine, conn)
    conn.close()
    return out


def part2_run(args, decode, engine, conn) -> dict:
    from pdserve.protocol import SamplingParams
    from pdserve.prefill.kv_stream import KVStreamer

    from pdserve.kvtransfer import ReserveHandle

    n = args.ttft
    prompt = torch.randint(0, min(engine.args.vocab_size, 150000), (n,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0)

    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)

    def plain(i: int) -> float:
        sync()
        t0 = time.perf_counter()
        engine.add_request(f"plain-{i}", prompt, params)
        while not engine.step():
            pass
        dt = time.perf_counter() - t0
        engine.release(f"plain-{i}")
        return dt

    streamer = KVStreamer(engine, conn)

    def streamed(i: int) -> float:
        rid = f"stream-{i}"
        handle = ReserveHandle.unpack(decode_call(decode, "reserve", rid, list(range(1, 1 + -(-n // BLOCK)))))
        sync()
        t0 = time.perf_counter()
        streamer.add(Request(rid, prompt, params), handle)
        while True:
            _, done, failed = streamer.step()
            if done or failed:
                break
        dt = time.perf_counter() - t0
        assert done == [rid], (done, failed)
        assert decode_call(decode, "wait")[:2] == (1, 0)
        return dt

    hook, engine.layer_hook = engine.layer_hook, None
    plain(-1)  # warm-up
    plain_t = [plain(i) for i in range(args.reps)]
    engine.layer_hook = hook
    streamed(-1)
    stream_t = [streamed(i) for i in range(args.reps)]
    p, s = statistics.median(plain_t), statistics.median(stream_t)
    return {"tokens": n, "prefill_only_ms": round(p * 1e3, 1), "prefill_streamed_ms": round(s * 1e3, 1),
            "overhead_pct": round((s / p - 1) * 100, 2), "plain_all": [round(x * 1e3, 1) for x in plain_t],
            "streamed_all": [round(x * 1e3, 1) for x in stream_t]}


if __name__ == "__main__":
    main()
