"""A prefill worker and a decode worker in two real processes, driven over pipes by a test.

Each child owns an engine (tiny-moe unless a model is named) and a KV connector of the chosen
backend; the parent plays the router: it exchanges handshake metadata, reserves on the decode side
and hands the lease to the prefill side.
"""

import multiprocessing as mp
import time
import traceback

from pdserve.messages import Request
from pdserve.config import EngineConfig, ModelConfig
from pdserve.kvtransfer.backend import KVBackend
from pdserve.protocol import SamplingParams

NUM_BLOCKS = 160
# The children fork from one server process (multiprocessing's forkserver) that imported these once:
# a spawned child imported torch, NIXL and the engine itself (on 2 cores beside the suite, 10-12 s to
# start a pair) and tore its interpreter down on exit (4 s to stop one); forked, 2-5 s and 0.1 s. Each
# child is still a process of its own, killed and stopped as before; the server never runs a step (no
# thread pool, no CUDA), so what it hands down is imported modules only. Missing ones are skipped.
PRELOAD = ["torch", "nixl", "pdserve.engine.engine", "pdserve.kvtransfer", "pdserve.kvtransfer.backends.nixl",
           "pdserve.kvtransfer.backends.tcp", "pdserve.prefill.kv_stream", "pdserve.decode.kv_intake"]


def context():
    """The multiprocessing context the children of kv_pair (and test_nixl_backend) start from."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (read when the server starts: the first child of this process)
    return ctx


def engine_config(role: str, seed: int, device: str, model: str = "tiny-moe",
                  kv_cache_dtype: str = "auto", num_blocks: int = NUM_BLOCKS) -> EngineConfig:
    """`model` (tiny-moe) with the torch reference kernels everywhere: the test is about moving KV, and the
    colocated oracle must compute each decode row with the same kernel as the decode side. (The
    Triton path picks kernels by a step's shape — a decode row mixed into a prefill step takes the
    prefill kernel — and tiny-moe's random weights leave near-ties that rounding can flip;
    tests/test_gpu_engine.py checks the Triton path against this reference.)"""
    return EngineConfig(model=ModelConfig(path=model, seed=seed, kv_cache_dtype=kv_cache_dtype), role=role, device=device,
                        num_kv_blocks=num_blocks, chunk_size=256, max_num_batched_tokens=256,
                        attention_backend="torch", moe_backend="torch")


def _engine(role: str, seed: int, fragment: bool | str, device: str = "cpu", model: str = "tiny-moe",
            kv_cache_dtype: str = "auto"):
    import torch

    from pdserve.engine.engine import Engine

    torch.set_num_threads(1)  # the pair shares the test machine's cores (with the test and its neighbours)
    scattered = fragment == "scattered"  # twice the blocks, every second held: as many free as the others
    engine = Engine(engine_config(role, seed, device, model, kv_cache_dtype, NUM_BLOCKS * (2 if scattered else 1)))
    if scattered:
        # Hold every second block: each allocation afterwards is single blocks, none next to another.
        held = engine.pool.allocate(2 * NUM_BLOCKS)
        engine.pool.free([b for i, b in enumerate(held) if i % 2])
    elif fragment:
        # Hold every third block: each allocation afterwards is scattered over small runs.
        held = engine.pool.allocate(NUM_BLOCKS // 3 * 3)
        engine.pool.free([b for i, b in enumerate(held) if i % 3])
    return engine


def staging(backend: KVBackend) -> dict | None:
    """A NIXL backend's staging slots: idle, slots, leases given one, posts gathered into one and
    posts written block run by block run into the peer's slot; None for another backend."""
    pool = getattr(backend, "staging", None)
    if pool is None:
        return None
    return {"idle": pool.idle(), "slots": pool.slots, "given": backend.slots_given,
            "gathered": backend.posts_gathered, "direct": backend.posts_direct}


def _prefill_main(conn, backend: str, seed: int, fragment: bool, device: str, model: str = "tiny-moe",
                  kv_cache_dtype: str = "auto") -> None:
    from pdserve.kvtransfer import ReserveHandle, make_connector
    from pdserve.prefill.kv_stream import KVStreamer

    engine = _engine("prefill", seed, fragment, device, model, kv_cache_dtype)
    idle = engine.pool.num_free_blocks
    connector = make_connector("prefill", backend, f"prefill-{mp.current_process().pid}", engine.kv_cache,
                               engine.layout, engine.fingerprint)
    streamer = KVStreamer(engine, connector)
    results: dict[str, bool] = {}
    while True:
        cmd, *args = conn.recv()
        try:
            if cmd == "meta":
                conn.send(connector.metadata())
            elif cmd == "add_peer":
                conn.send(connector.add_peer(args[0]))
            elif cmd == "prefill":
                rid, prompt, params, handle = args
                streamer.add(Request(rid, prompt, SamplingParams(**params)), ReserveHandle.unpack(handle))
                conn.send(None)
            elif cmd == "abort":
                streamer.abort(args[0])
                results[args[0]] = False
                conn.send(None)
            elif cmd == "run":  # step until every transfer settled or timeout
                deadline = time.time() + args[0]
                while (streamer.busy() or engine.has_unfinished()) and time.time() < deadline:
                    _, done, failed = streamer.step()
                    results.update({r: True for r in done})
                    results.update({r: False for r in failed})
                    if not engine.has_unfinished():
                        time.sleep(0.002)
                conn.send((dict(results), engine.pool.num_free_blocks, idle))
                results.clear()
            elif cmd == "listen":  # keep polling for a while with nothing in flight: late notices
                deadline = time.time() + args[0]
                while time.time() < deadline:
                    _, done, failed = streamer.step()
                    results.update({r: True for r in done})
                    results.update({r: False for r in failed})
                    time.sleep(0.002)
                conn.send((dict(results), engine.pool.num_free_blocks, idle))
                results.clear()
            elif cmd == "notify":  # bytes sent as a notice to a peer over this worker's connection: a forgery
                conn.send(connector.backend.notify(*args))
            elif cmd == "delivered":  # (KV bytes, seconds) of each request delivered since the last call
                conn.send(connector.delivered())
            elif cmd == "staging":
                conn.send(staging(connector.backend))
            elif cmd == "profile":  # the engine's step profile (tokens computed, prefix-cache lookups)
                conn.send(engine.profile.snapshot())
            elif cmd == "exit":
                connector.close()
                conn.send(None)
                return
        except Exception as e:
            conn.send(RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _decode_main(conn, backend: str, seed: int, fragment: bool, device: str, model: str = "tiny-moe",
                 kv_cache_dtype: str = "auto") -> None:
    from pdserve.decode.kv_intake import KVIntake
    from pdserve.kvtransfer import make_connector

    engine = _engine("decode", seed, fragment, device, model, kv_cache_dtype)
    idle = engine.pool.num_free_blocks
    connector = make_connector("decode", backend, f"decode-{mp.current_process().pid}", engine.kv_cache,
                               engine.layout, engine.fingerprint)
    intake = KVIntake(engine, connector)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[list]] = {}  # per request: each output's logprob entries (TokenLogprob)
    failed: set[str] = set()
    while True:
        while not conn.poll(0.002):  # a live decode worker keeps polling: that moves the KV in
            connector.progress()
        cmd, *args = conn.recv()
        try:
            if cmd == "meta":
                conn.send(connector.metadata())
            elif cmd == "add_peer":
                conn.send(connector.add_peer(args[0]))
            elif cmd == "reserve":
                rid, prompt, params, lease_s, prefill_id = args
                intake.lease_s = lease_s
                h = intake.reserve(Request(rid, prompt, SamplingParams(**params)), prefill_id)
                if h is not None:
                    tokens[rid] = []
                conn.send(h.pack() if h else None)
            elif cmd == "abort":
                intake.abort(args[0])
                failed.add(args[0])
                conn.send(None)
            elif cmd == "run":  # decode until every reserved request finished or failed
                deadline = time.time() + args[0]
                finished: set[str] = set()
                # ... and until the blocks of every lease that ended without its KV are back
                while (len(finished | failed) < len(tokens) or intake.busy()) and time.time() < deadline:
                    failed.update(rid for rid, _ in intake.poll())
                    for out in engine.step():
                        tokens[out.request_id] += out.token_ids
                        logprobs.setdefault(out.request_id, []).append(out.logprobs)
                        if out.finished:
                            finished.add(out.request_id)
                    if not engine.scheduler.has_work():
                        time.sleep(0.002)
                conn.send(({r: ("failed" if r in failed else t) for r, t in tokens.items()},
                           engine.pool.num_free_blocks, idle))
                tokens.clear()
                failed.clear()
            elif cmd == "counters":  # blocks reused from its prefix cache, KV bytes received; one block's bytes
                conn.send((intake.blocks_reused, intake.bytes_received,
                           engine.layout.bytes_per_token * engine.layout.block_size))
            elif cmd == "dropped":  # notices dropped unread, by why
                conn.send(dict(connector.dropped))
            elif cmd == "staging":
                conn.send(staging(connector.backend))
            elif cmd == "logprobs":  # each output's logprob entries, per request, since the last call
                conn.send(dict(logprobs))
                logprobs.clear()
            elif cmd == "exit":
                connector.close()
                conn.send(None)
                return
        except Exception as e:
            conn.send(RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def assert_staging_idle(*workers: "Worker", used: str | None = None) -> None:
    """Every staging slot of these (NIXL) workers is back in its pool, as blocks are in theirs;
    `used`: a counter that must have moved on each (slots were held: "given", "gathered")."""
    for w in workers:
        s = w.call("staging")
        assert s is None or s["idle"] == s["slots"], s
        assert s is None or used is None or s[used] > 0, s


def assert_staged(p: "Worker", d: "Worker", fragment: bool | str) -> None:
    """A NIXL pair moved KV through staging slots where blocks are fragmented or scattered (leases
    got one, posts were gathered into one), and not where each request's blocks are one run."""
    ps, ds = p.call("staging"), d.call("staging")
    if fragment:
        assert ds["given"] > 0 and ps["gathered"] > 0, (ps, ds)
    else:
        assert ds["given"] == 0 and ps["gathered"] == 0, (ps, ds)


class Worker:
    """A child process and its command pipe."""

    def __init__(self, target, backend: str, seed: int = 0, fragment: bool | str = False, device: str = "cpu",
                 model: str = "tiny-moe", kv_cache_dtype: str = "auto"):
        ctx = context()
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, backend, seed, fragment, device, model, kv_cache_dtype),
                                daemon=True)
        self.proc.start()

    def call(self, *msg, timeout: float = 120):
        self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"worker did not answer {msg[0]!r} within {timeout} s")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=20)
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


def start_pair(backend: str, fragment: bool | str = False, prefill_seed: int = 0,
               devices: tuple[str, str] | None = None, model: str = "tiny-moe",
               kv_cache_dtype: str = "auto") -> tuple[Worker, Worker]:
    """A connected prefill/decode pair (handshake done both ways) of `model` (a preset or an HF
    directory) caching `kv_cache_dtype`; on two GPUs for cuda_ipc, on CPU memory otherwise, unless
    `devices` says."""
    devices = devices or (("cuda:0", "cuda:1") if backend == "cuda_ipc" else ("cpu", "cpu"))
    p = Worker(_prefill_main, backend, prefill_seed, fragment, devices[0], model, kv_cache_dtype)
    d = Worker(_decode_main, backend, 0, fragment, devices[1], model, kv_cache_dtype)
    pmeta, dmeta = p.call("meta"), d.call("meta")
    p.call("add_peer", dmeta)
    d.call("add_peer", pmeta)
    return p, d


class LoopbackBackend(KVBackend):
    """Both ends of a KV transfer in one process: a write copies blocks between the two engines'
    caches, a notice goes into the peer's inbox as bytes (packed and unpacked as on any wire)."""

    inline = False
    waits = False
    _ends: dict = {}

    def __init__(self, meta, kv_cache):
        self.meta, self.kv = meta, kv_cache
        self.inbox: list[bytes] = []
        LoopbackBackend._ends[meta.engine_id] = self

    def add_peer(self, peer) -> None:
        pass

    def remove_peer(self, engine_id: str) -> None:
        pass

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
        LoopbackBackend._ends[peer_id].kv[layer, :, dst_blocks] = self.kv[layer, :, src_blocks]

    @staticmethod
    def state(token) -> str:
        return "done"

    @staticmethod
    def release(token) -> None:
        pass

    def notify(self, peer_id: str, payload: bytes) -> None:
        LoopbackBackend._ends[peer_id].inbox.append(bytes(payload))

    def notifications(self) -> list[bytes]:
        out, self.inbox = self.inbox, []
        return out

    def progress(self) -> None:
        pass

    def close(self) -> None:
        LoopbackBackend._ends.pop(self.meta.engine_id, None)


def loopback_connectors(prefill, decode, prefill_backend=LoopbackBackend):
    """A PrefillConnector and a DecodeConnector of this process, joined over LoopbackBackend (the
    prefill end's over `prefill_backend`); `prefill`, `decode`: each end's (KV cache, KVLayout,
    model fingerprint)."""
    from pdserve.kvtransfer import DecodeConnector, KVAgentMetadata, PrefillConnector

    ends = []
    for cls, backend, (kv, layout, fingerprint) in ((PrefillConnector, prefill_backend, prefill),
                                                     (DecodeConnector, LoopbackBackend, decode)):
        meta = KVAgentMetadata.for_cache(f"{cls.__name__}-{id(kv)}", "loopback", kv, layout, fingerprint)
        ends.append(cls(backend(meta, kv), meta))
    p, d = ends
    p.add_peer(d.metadata())
    d.add_peer(p.metadata())
    return p, d


def tiny_kv(num_blocks: int = 8):
    """A small KV cache without an engine, for tests of the connectors alone: (cache, layout, fingerprint)."""
    import torch

    from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache

    layout = KVLayout(2, num_blocks, 4, 2, 8, torch.float32)
    return allocate_kv_cache(layout, torch.device("cpu")), layout, "tiny"


def loopback_pair(prefill_engine, decode_engine, prefill_backend=LoopbackBackend):
    """A prefill engine streaming into a decode engine of this process, through the real connectors
    (KVStreamer -> PrefillConnector -> notices -> DecodeConnector -> KVIntake) over LoopbackBackend."""
    from pdserve.decode.kv_intake import KVIntake
    from pdserve.prefill.kv_stream import KVStreamer

    p, d = loopback_connectors(*[(e.kv_cache, e.layout, e.fingerprint) for e in (prefill_engine, decode_engine)],
                               prefill_backend=prefill_backend)
    return KVStreamer(prefill_engine, p), KVIntake(decode_engine, d)
