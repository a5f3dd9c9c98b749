"""KV between two hosts, stood in for on one machine by two network namespaces joined by a veth
pair: a prefill-side and a decode-side process, each in its own namespace, move a whole KV
allocation (every layer, plane and block) through pdserve's backends — NIXL over UCX's TCP
transport, and pdserve's own TCP backend — against a raw socket copy of the same bytes between the
same namespaces (the reference, measured in the same run).

    sudo python -m pdserve.benchmarks.kv_netns [--mb 256] [--reps 5]

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


def _layout(total_mb: int):
    from pdserve.forward.kv_cache import KVLayout

    bytes_per_block = BLOCK_TOKENS * HEADS * DIM * 4
    blocks = max(1, total_mb * 2**20 // (NUM_LAYERS * 2 * bytes_per_block))
    return KVLayout(NUM_LAYERS, blocks, BLOCK_TOKENS, HEADS, DIM, torch.float32, "kv")


def _wait_file(path: Path, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never came")
        time.sleep(0.01)
    time.sleep(0.05)  # written in one go; let the writer close it
    return path.read_text()


# -- the two sides (each run as `ip netns exec NS python -m ... --side ...`) ------------------------


def _backend(kind: str, name: str, host: str, kv, layout):
    from pdserve.kvtransfer.backends import make_backend
    from pdserve.kvtransfer.metadata import KVAgentMetadata

    meta = KVAgentMetadata.for_cache(name, kind, kv, layout, "bench", host)
    kw = {"host": host} if kind == "tcp" else {}
    return meta, make_backend(kind, meta, kv, **kw)


def side(role: str, kind: str, host: str, workdir: Path, total_mb: int, reps: int) -> None:
    layout = _layout(total_mb)
    kv = torch.empty(layout.shape, dtype=layout.dtype)
    if role == "decode":
        kv.zero_()
    else:
        kv.copy_(torch.randn(layout.shape))
    nbytes = kv.numel() * kv.element_size()
    if kind == "raw":  # the reference: one TCP stream of the same bytes, sendall / recv_into
        buf = memoryview(kv.numpy()).cast("B")
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

    meta, be = _backend(kind, role, host, kv, layout)
    (workdir / f"{role}.meta").write_bytes(meta.pack())
    while not (workdir / f"{'prefill' if role == 'decode' else 'decode'}.meta").exists():
        time.sleep(0.01)
    time.sleep(0.05)
    peer = KVAgentMetadata.unpack((workdir / f"{'prefill' if role == 'decode' else 'decode'}.meta").read_bytes())
    be.add_peer(peer)
    blocks = list(range(layout.num_blocks))
    if role == "decode":  # polls (drives UCX's progress) until a notice per rep came
        seen = 0
        while seen < reps:
            seen += len(be.notifications())
            time.sleep(0.0005)
        (workdir / "decode.done").write_text("1")
        _wait_file(workdir / "prefill.done", 120)
        be.close()
        return
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        tokens = be.write_layers("decode", [(layer, blocks, blocks) for layer in range(layout.num_layers)])
        while any(be.state(t) == "pending" for t in tokens):
            be.progress()
        assert all(be.state(t) == "done" for t in tokens), [be.state(t) for t in tokens]
        be.notify("decode", b"rep")  # behind the KV on the same path: the rep ends when it is read
        times.append(time.perf_counter() - t0)
        for t in tokens:
            be.release(t)
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


def run(kind: str, ns: Namespaces, total_mb: int, reps: int) -> dict:
    env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n")
    sent = veth_tx_bytes(ns.a)
    with tempfile.TemporaryDirectory(prefix="pdkv-") as tmp:
        work = Path(tmp)
        procs = [subprocess.Popen(["ip", "netns", "exec", n, sys.executable, "-m", "pdserve.benchmarks.kv_netns",
                                   "--side", role, "--kind", kind, "--host", ip, "--workdir", tmp,
                                   "--mb", str(total_mb), "--reps", str(reps)], env=env)
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
    ap.add_argument("--side", choices=["prefill", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--kind", default="raw", help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        torch.set_num_threads(1)
        side(a.side, a.kind, a.host, a.workdir, a.mb, a.reps)
        return 0
    with Namespaces() as ns:
        rows = {kind: run(kind, ns, a.mb, a.reps) for kind in ("raw", "nixl", "tcp")}
    ref = None
    print(f"{'path':<28} {'MiB':>6} {'median s':>9} {'GB/s':>7} {'% of raw socket':>16} {'over the veth':>14}")
    for kind, label in (("raw", "raw socket copy (reference)"), ("nixl", "NIXL (UCX_TLS=tcp)"),
                        ("tcp", "pdserve tcp backend")):
        r = rows[kind]
        t = statistics.median(r["times"])
        rate = r["bytes"] / t / 1e9
        ref = ref or rate
        crossed = r["veth"] / (r["bytes"] * len(r["times"]))  # 1.0x: every byte of every rep went over it
        print(f"{label:<28} {r['bytes'] / 2**20:>6.0f} {t:>9.3f} {rate:>7.2f} {100 * rate / ref:>15.1f} % "
              f"{crossed:>13.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
