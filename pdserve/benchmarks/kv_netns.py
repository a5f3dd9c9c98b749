"""KV between two hosts, stood in for on one machine by two network namespaces joined by a veth
pair: a prefill-side and a decode-side process, each in its own namespace, move one request's KV
(every layer and plane of `--mb` MiB of blocks, fresh: one run; fragmented: runs of 8; scattered:
single blocks, on both sides) through pdserve's backends — NIXL over UCX's TCP transport through
staging slots (kvtransfer/staging.py) and without them (nixl-blocks: a descriptor per run of
blocks), and pdserve's own TCP backend — against a raw socket copy of the same number of bytes
between the same namespaces (the reference, measured in the same run). A rep ends when the decode
side, its KV in its blocks (a staged one scattered), has answered.

    sudo python -m pdserve.benchmarks.kv_netns [--mb 256] [--reps 5] [--patterns fresh scattered]

Needs root (`ip netns`, `ip link`). The namespaces and the veth pair are named after this process
and removed at the end. UCX is held to TCP (UCX_TLS=tcp): both processes share the machine's
memory and IPC, and would otherwise take its shared-memory transports.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

BLOCK_TOKENS, HEADS, DIM = 16, 4, 128  # a float32 block of one plane: 32 KiB
NUM_LAYERS = 8


def _request_blocks(total_mb: int) -> int:
    """Blocks of a request of total_mb MiB (every layer and plane)."""
    return max(1, total_mb * 2**20 // (NUM_LAYERS * 2 * BLOCK_TOKENS * HEADS * DIM * 4))


def _layout(total_mb: int):
    """Twice the request's blocks: room for a scattered one."""
    from pdserve.forward.kv_cache import KVLayout

    return KVLayout(NUM_LAYERS, 2 * _request_blocks(total_mb) + 8, BLOCK_TOKENS, HEADS, DIM, torch.float32, "kv")


def _wait_file(path: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.01)
    time.sleep(0.05)  # written in one go; let the writer close it
    return path.read_text()


# -- the two sides (each run as `ip netns exec NS python -m ... --side ...`) ------------------------


def _backend(kind: str, name: str, host: str, kv, layout, total_mb: int):
    from pdserve.kvtransfer.backends import make_backend
    from pdserve.kvtransfer.metadata import KVAgentMetadata

    backend = kind.removesuffix("-blocks")
    meta = KVAgentMetadata.for_cache(name, backend, kv, layout, "bench", host)
    kw = {"host": host} if kind == "tcp" else {}
    if backend == "nixl":  # one slot a side, as large as the request: always slot 0
        kw = {"staging_slots": 0 if kind == "nixl-blocks" else 1, "staging_slot_mb": total_mb + 1}
    return meta, make_backend(backend, meta, kv, **kw)


def side(role: str, kind: str, host: str, workdir: Path, total_mb: int, reps: int, pattern: str) -> None:
    from pdserve.benchmarks.kv_transfer import blocks_for
    from pdserve.kvtransfer.wire import ReserveHandle

    layout = _layout(total_mb)
    kv = torch.empty(layout.shape, dtype=layout.dtype)
    if role == "decode":
        kv.zero_()
    else:
        kv.copy_(torch.randn(layout.shape))
    n = _request_blocks(total_mb)
    nbytes = n * NUM_LAYERS * 2 * layout.bytes_per_block
    src, dst = blocks_for(n, pattern, 3), blocks_for(n, pattern, 1)
    if kind == "raw":  # the reference: one TCP stream of the same bytes, sendall / recv_into
        buf = memoryview(kv.numpy()).cast("B")[:nbytes]
        if role == "decode":
            srv = socket.create_server((host, 0))
            (workdir / "decode.addr").write_text(f"{host}:{srv.getsockname()[1]}")
            conn, _ = srv.accept()
            for _ in range(reps):
                got = 0
                while got < nbytes:
                    got += conn.recv_into(buf[got:], nbytes - got)
                conn.sendall(b"k")
            return
        h, p = _wait_file(workdir / "decode.addr").rsplit(":", 1)
        s = socket.create_connection((h, int(p)))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            s.sendall(buf)
            s.recv(1)
            times.append(time.perf_counter() - t0)
        (workdir / "result.json").write_text(json.dumps({"bytes": nbytes, "times": times}))
        return
    from pdserve.kvtransfer.metadata import KVAgentMetadata

    meta, be = _backend(kind, role, host, kv, layout, total_mb)
    (workdir / f"{role}.meta").write_bytes(meta.pack())
    while not (workdir / f"{'prefill' if role == 'decode' else 'decode'}.meta").exists():
        time.sleep(0.01)
    time.sleep(0.05)
    peer = KVAgentMetadata.unpack((workdir / f"{'prefill' if role == 'decode' else 'decode'}.meta").read_bytes())
    be.add_peer(peer)
    if role == "decode":  # polls (drives UCX's progress) until a notice per rep came; answers each
        slot = be.reserve_staging(None, dst) if kind == "nixl" else None
        (workdir / "decode.slot").write_text(str(-1 if slot is None else slot))
        seen = 0
        while seen < reps:
            got = len(be.notifications())
            for _ in range(got):
                if slot is not None:  # into the blocks, and the slot again for the next rep (the only one)
                    be.unstage(slot, dst)
                    slot = be.reserve_staging(None, dst)
                be.notify("prefill", b"landed")
            seen += got
            time.sleep(0.0005)
        (workdir / "decode.sum").write_text(repr(kv[:, :, dst].sum().item()))  # checked by the prefill side
        (workdir / "decode.done").write_text("1")
        _wait_file(workdir / "prefill.done", 120)
        be.close()
        return
    handle = ReserveHandle("r", "decode", dst, 3600.0, staging=int(_wait_file(workdir / "decode.slot")))
    parts = [(layer, src, dst) for layer in range(layout.num_layers)]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens = be.write_staged(handle, parts) if handle.staging >= 0 else be.write_layers("decode", parts)
        while any(be.state(t) == "pending" for t in tokens):
            be.progress()
        assert all(be.state(t) == "done" for t in tokens), [be.state(t) for t in tokens]
        be.notify("decode", b"rep")  # behind the KV on the same path
        while not be.notifications():  # the rep ends when the decode side has the KV in its blocks
            time.sleep(0.0002)
        times.append(time.perf_counter() - t0)
        for t in tokens:
            be.release(t)
    want = kv[:, :, src].sum().item()
    got = float(_wait_file(workdir / "decode.sum"))
    assert got == want, f"{kind} {pattern}: the decode side's blocks hold {got}, ours {want}"
    (workdir / "result.json").write_text(json.dumps({"bytes": nbytes, "times": times}))
    _wait_file(workdir / "decode.done", 120)
    (workdir / "prefill.done").write_text("1")
    be.close()


# -- the driver ----------------------------------------------------------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Namespaces:
    """Two namespaces and the veth pair between them: 10.231.0.1 (prefill) and 10.231.0.2 (decode)."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.a, self.b = f"pdkv{tag}a", f"pdkv{tag}b"
        self.ip_a, self.ip_b = "10.231.0.1", "10.231.0.2"

    def __enter__(self):
        _ip("netns", "add", self.a)
        _ip("netns", "add", self.b)
        try:
            _ip("link", "add", f"{self.a}v", "type", "veth", "peer", "name", f"{self.b}v")
            for ns, ip in ((self.a, self.ip_a), (self.b, self.ip_b)):
                _ip("link", "set", f"{ns}v", "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", f"{ns}v")
                _ip("-n", ns, "link", "set", f"{ns}v", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        for ns in (self.a, self.b):  # deleting a namespace deletes its end of the veth, and the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def veth_tx_bytes(ns: str) -> int:
    """Bytes sent through the namespace's end of the veth pair: proof that a path crossed it."""
    out = subprocess.run(["ip", "-n", ns, "-j", "-s", "link", "show", f"{ns}v"], check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)[0]["stats64"]["tx"]["bytes"]


def run(kind: str, ns: Namespaces, total_mb: int, reps: int, pattern: str) -> dict:
    env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
    sent = veth_tx_bytes(ns.a)
    with tempfile.TemporaryDirectory(prefix="pdkv-") as tmp:
        work = Path(tmp)
        procs = [subprocess.Popen(["ip", "netns", "exec", n, sys.executable, "-m", "pdserve.benchmarks.kv_netns",
                                   "--side", role, "--kind", kind, "--host", ip, "--workdir", tmp,
                                   "--mb", str(total_mb), "--reps", str(reps), "--patterns", pattern], env=env)
                 for role, n, ip in (("decode", ns.b, ns.ip_b), ("prefill", ns.a, ns.ip_a))]
        try:
            for p in procs:
                if p.wait(300):
                    raise RuntimeError(f"{kind}: a side exited with {p.returncode}")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        result = json.loads((work / "result.json").read_text())
    result["veth"] = veth_tx_bytes(ns.a) - sent
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=256, help="KV allocation moved per rep (MiB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--patterns", nargs="+", default=["fresh", "fragmented", "scattered"],
                    choices=["fresh", "fragmented", "scattered"], help="the request's block layouts")
    ap.add_argument("--side", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="raw", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        torch.set_num_threads(1)
        side(a.side, a.kind, a.host, a.workdir, a.mb, a.reps, a.patterns[0])
        return 0
    kinds = (("nixl", "NIXL staged (UCX_TLS=tcp)"), ("nixl-blocks", "NIXL per block run"),
             ("tcp", "pdserve tcp backend"))
    with Namespaces() as ns:
        raw = run("raw", ns, a.mb, a.reps, "fresh")
        rows = {(kind, pattern): run(kind, ns, a.mb, a.reps, pattern) for pattern in a.patterns for kind, _ in kinds}
    ref = raw["bytes"] / statistics.median(raw["times"]) / 1e9
    print(f"{'path':<28} {'blocks':>10} {'MiB':>6} {'median s':>9} {'GB/s':>7} {'% of raw socket':>16} "
          f"{'over the veth':>14}")
    for (kind, label), pattern in [(("raw", "raw socket copy (reference)"), "-")] + [
            (k, p) for p in a.patterns for k in kinds]:
        r = raw if kind == "raw" else rows[(kind, pattern)]
        t = statistics.median(r["times"])
        rate = r["bytes"] / t / 1e9
        crossed = r["veth"] / (r["bytes"] * len(r["times"]))  # 1.0x: every byte of every rep went over it
        print(f"{label:<28} {pattern:>10} {r['bytes'] / 2**20:>6.0f} {t:>9.3f} {rate:>7.2f} {100 * rate / ref:>15.1f} % "
              f"{crossed:>13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
