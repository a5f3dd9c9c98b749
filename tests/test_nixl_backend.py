"""NixlBackend for real: two processes, UCX on CPU memory, allocations of different block counts.

Each child owns one backend and answers the parent's commands over a pipe; every wait has a
timeout, so a hang fails the test in seconds instead of blocking CI.
"""

import time
import traceback
import uuid

import pytest
import torch

import kv_pair
from pdserve.kvtransfer.backends.nixl_find import nixl_module
from pdserve.kvtransfer.blocks import runs
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache

pytestmark = pytest.mark.skipif(nixl_module() is None, reason="nixl is not installed")

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 4, 2, 8
SRC_BLOCKS, DST_BLOCKS = 12, 20  # different on purpose: each side indexes with its own count
TIMEOUT_S = 15.0  # per command; generous, since a loaded CI box can be slow to spawn
# The child's first answer comes after its spawn and its imports (torch, NIXL): on 2 cores beside the
# suite's clusters that took more than 15 s (three setup errors in one README run).
START_S = 60.0


def _layout(num_blocks: int) -> KVLayout:
    """The tiny KV layout both sides share, with `num_blocks` blocks."""
    return KVLayout(LAYERS, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, torch.float32)


def _source_kv() -> torch.Tensor:
    """The writer's KV: random, so that any misplaced byte shows."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(_layout(SRC_BLOCKS).shape, generator=g)


def _wait(backend, token, timeout: float = 5.0) -> str:
    """Poll a write until it settles or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while (s := backend.state(token)) == "pending" and time.monotonic() < deadline:
        time.sleep(0.001)
    return s


def _node(conn, engine_id: str, source: bool) -> None:
    """Child process: one NixlBackend, serving the parent's commands until 'close'."""
    from pdserve.kvtransfer.backends.nixl import NixlBackend

    layout = _layout(SRC_BLOCKS if source else DST_BLOCKS)
    kv = _source_kv() if source else allocate_kv_cache(layout, torch.device("cpu"))
    meta = KVAgentMetadata.for_cache(engine_id, "nixl", kv, layout, "test-model")
    backend = NixlBackend(meta, kv, telemetry=True)
    conn.send(meta.pack())
    while True:
        idle_until = time.monotonic() + 60  # the parent died or forgot us: do not linger
        while not conn.poll(0.001):  # a live worker keeps polling, and so drives UCX's progress
            backend.progress()
            if time.monotonic() > idle_until:
                return
        cmd, *args = conn.recv()
        try:
            if cmd == "add_peer":
                out = backend.add_peer(KVAgentMetadata.unpack(args[0]))
            elif cmd == "write":  # -> (final state, descriptors NIXL moved)
                token = backend.write(*args)
                state = _wait(backend, token)
                out = (state, backend.descriptor_count(token) if state == "done" else None)
                backend.release(token)
            elif cmd == "watch":  # write, then every state seen for `secs`; released still in flight
                *wargs, secs = args
                token = backend.write(*wargs)
                seen, deadline = set(), time.monotonic() + secs
                while time.monotonic() < deadline:
                    seen.add(backend.state(token))
                    time.sleep(0.01)
                backend.release(token)
                out = seen
            elif cmd == "notify":
                out = backend.notify(*args)
            elif cmd == "notifications":  # wait for `n` of them
                n, got, deadline = args[0], [], time.monotonic() + 5
                while len(got) < n and time.monotonic() < deadline:
                    got += backend.notifications()
                    time.sleep(0.005)
                out = got
            elif cmd == "kv":
                out = kv.clone()
            elif cmd == "close":
                t0 = time.monotonic()
                backend.close()
                backend.close()  # idempotent
                conn.send(time.monotonic() - t0)
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:  # handed to the parent, which re-raises it
            out = RuntimeError(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        conn.send(out)


class Node:
    """A child process with its command pipe; `call` fails fast instead of hanging."""

    def __init__(self, source: bool):
        ctx = kv_pair.context()  # forked from a server that imported torch and NIXL once
        self.conn, child = ctx.Pipe()
        self.engine_id = f"{'src' if source else 'dst'}-{uuid.uuid4().hex[:8]}"  # unique under xdist
        self.proc = ctx.Process(target=_node, args=(child, self.engine_id, source), daemon=True)
        self.proc.start()
        child.close()

    def recv(self, what: str, timeout: float = TIMEOUT_S):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.engine_id} did not answer {what!r} within {timeout} s")
        out = self.conn.recv()
        if isinstance(out, Exception):
            raise out
        return out

    def call(self, *msg, timeout: float = TIMEOUT_S):
        self.conn.send(msg)
        return self.recv(msg[0], timeout)

    def close(self) -> float:
        """Close the backend and wait for a clean exit; the seconds close() took."""
        return self.exit(self.call("close"))

    def exit(self, took: float) -> float:
        """Wait for the child to exit after 'close' answered `took`; a clean exit or an error."""
        self.proc.join(TIMEOUT_S)
        assert self.proc.exitcode == 0, f"{self.engine_id} exited with {self.proc.exitcode}"
        return took

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(TIMEOUT_S)


@pytest.fixture
def pair():
    """A writer holding random KV and a reader with zeros, handshaken both ways."""
    a, b = Node(source=True), Node(source=False)
    try:
        ma, mb = a.recv("meta", START_S), b.recv("meta", START_S)
        a.call("add_peer", mb)
        b.call("add_peer", ma)  # so that notices can go back too
        yield a, b
    finally:
        a.kill()
        b.kill()


def test_writes_land_at_mapped_blocks_and_nothing_else(pair):
    a, b = pair
    src_kv = _source_kv()
    expected = torch.zeros(_layout(DST_BLOCKS).shape)
    cases = [  # (layer, src, dst)
        (0, list(range(0, 6)), list(range(10, 16))),  # one run on both sides
        (1, [3, 1, 7, 8, 9, 0], [19, 2, 4, 5, 6, 11]),  # fragmented: 4 runs
        (2, [2, 3, 4, 5], [0, 2, 4, 6]),  # consecutive here, scattered there: 4 runs
        (2, [0, 11], [0, 19]),  # K's last block and V's first are adjacent on both sides
        (1, list(range(SRC_BLOCKS)), list(range(DST_BLOCKS - SRC_BLOCKS, DST_BLOCKS))),  # whole layer
    ]
    for layer, src, dst in cases:
        state, ndesc = a.call("write", b.engine_id, layer, src, dst)
        assert state == "done", (layer, src, dst)
        expected[layer, :, dst] = src_kv[layer, :, src]
        got = b.call("kv")
        # The whole tensor: the mapped blocks of this layer (K and V) changed, nothing else did.
        assert torch.equal(got, expected), f"mismatch after writing layer {layer} {src} -> {dst}"
        # NIXL merged each run adjacent on both sides into one descriptor (UCX pays
        # per descriptor); K and V are listed back to back, so they merge where adjacent too.
        n_runs = len(runs(src, dst))
        kv_merge = src[-1] == SRC_BLOCKS - 1 and dst[-1] == DST_BLOCKS - 1 and src[0] == 0 and dst[0] == 0
        assert ndesc == 2 * n_runs - kv_merge, (layer, src, dst)

    assert a.call("kv").equal(src_kv)  # a WRITE leaves its source alone

    # Block ids outside an allocation would alias another layer's blocks: refused.
    with pytest.raises(RuntimeError, match="ValueError"):
        a.call("write", b.engine_id, 0, [0], [DST_BLOCKS])
    with pytest.raises(RuntimeError, match="ValueError"):
        a.call("write", b.engine_id, 0, [SRC_BLOCKS], [0])
    assert a.call("write", "nobody", 0, [0], [0]) == ("failed", None)  # unknown peer: fails, never raises
    assert a.call("write", b.engine_id, 0, [], [])[0] == "done"  # nothing to move

    # Notices both ways, in order per sender.
    a.call("notify", b.engine_id, b"finish r1")
    a.call("notify", b.engine_id, b"finish r2")
    assert b.call("notifications", 2) == [b"finish r1", b"finish r2"]
    b.call("notify", a.engine_id, b"abort r3")
    assert a.call("notifications", 1) == [b"abort r3"]
    assert b.call("kv").equal(expected)  # notices do not touch the KV

    for n in (a, b):  # both at once: a process takes most of a second to exit
        n.conn.send(("close",))
    assert a.exit(a.recv("close")) < 5
    assert b.exit(b.recv("close")) < 5


@pytest.mark.parametrize("connected", [False, True], ids=["before-first-write", "after-a-write"])
def test_write_to_killed_peer_never_reads_done_and_close_returns(pair, connected):
    a, b = pair
    if connected:  # UCX then holds a live endpoint to the peer when it dies
        assert a.call("write", b.engine_id, 0, [1], [1])[0] == "done"
    b.kill()
    seen = a.call("watch", b.engine_id, 0, list(range(SRC_BLOCKS)), list(range(SRC_BLOCKS)), 1.0)
    assert seen and seen <= {"pending", "failed"}, seen
    try:  # may raise (the connector swallows it); it must only not hang
        a.call("notify", b.engine_id, b"finish r1")
    except RuntimeError:
        pass
    assert a.close() < 5  # releases every handle, even one that may still be in flight
