"""KV over TCP (asyncio streams, msgpack-framed), for machines without NIXL.

Each worker runs a receiver; a sender opens one connection per peer and sends frames in order on
it, so a notice sent after a layer's frames is read after those frames are in place.
Frame: 4-byte big-endian header length, msgpack header, then the payload's `nbytes` sealed with
AES-256-GCM under the connection's session key (the frame's sequence number the nonce, the header
authenticated with it): `nbytes` + a 16-byte tag.

The receiver listens on the node's address, so it takes connections from handshaked peers only:
it opens each connection with a fresh nonce, and the sender's first frame ("hello") names the
sender and proves the cluster token over that nonce (HMAC; the token never travels). A sender that
is not a handshaked peer, or whose proof is wrong, is refused by name (the receiver answers why,
logs the first of each reason, counts it in `refused`, and closes the connection) before a byte
reaches the KV cache. Both ends then derive the session key from the token and the nonce
(pdserve/frame_seal.py, the sealing every internal channel across hosts shares; why AES-GCM is
there): a frame injected into the stream, replayed from another connection, reordered or dropped
fails its tag and ends the connection.

Every frame is bounded before its payload is read (header length, `nbytes` at most one layer's
blocks); a KV frame's layer and blocks must lie in the cache, its size must match them, and every
block must belong to a lease the decode end granted that sender (`grant`): any other is dropped
and counted, and the connection serves on.
"""

import asyncio
import hashlib
import hmac
import logging
import os
import struct
import threading
from collections import Counter

import msgpack
import torch

from pdserve.frame_seal import TAG_BYTES, BadSeal, Sealer
from pdserve.frame_seal import session_key as _session_key
from pdserve.kvtransfer.backend import KVBackend
from pdserve.kvtransfer.blocks import runs
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.kvtransfer.notice_seal import MAX_NOTICE_BYTES
from pdserve.refusals import Refusals

_LEN = struct.Struct(">I")
NONCE_BYTES = 16
HELLO_S = 10  # a peer that does not say who it is within this long is dropped
MAX_HELLO_BYTES = 4096
MAX_CONNECTIONS = 256  # open at once (handshaked peers hold one each)
log = logging.getLogger(__name__)


def hello_proof(token: str | None, nonce: bytes, sender: str, receiver: str) -> str:
    return hmac.new((token or "").encode(), nonce + f"{sender}>{receiver}".encode(), hashlib.sha256).hexdigest()


def session_key(token: str | None, nonce: bytes, sender: str, receiver: str) -> bytes:
    """The key of one connection's frames (sender to receiver), known to token holders only."""
    return _session_key(token, b"pdserve-kv-tcp-session:", nonce, sender, receiver)


class BadFrame(ValueError):
    """A frame that cannot be a peer's: its connection ends (`reason` is the counter)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class PeerRefused(ConnectionError):
    """A receiver refused this sender (not handshaked there, or of another cluster)."""


def frame(header: dict, payload: bytes) -> bytes:
    """One unsealed frame (the hello and its answer): header length, msgpack header, payload."""
    h = msgpack.packb(header)
    return _LEN.pack(len(h)) + h + payload


class _Session:
    """A sender's connection to one peer: its writer and its frames' sealing."""

    def __init__(self, writer: asyncio.StreamWriter, key: bytes):
        self.writer, self.sealer = writer, Sealer(key)

    def send(self, header: dict, payload: bytes) -> None:
        h = msgpack.packb(header)
        self.writer.write(_LEN.pack(len(h)) + h)
        self.writer.write(self.sealer.seal(payload, h))


class TcpBackend(KVBackend):
    inline = False  # a post copies the layer to the host: the posting thread's
    waits = False  # the posting thread polls each post's Future

    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor, host: str = "127.0.0.1", port: int = 0,
                 cluster_token: str | None = None):
        self.meta = meta
        self._token = cluster_token
        # Connections and frames refused, by why (connections: "not_a_hello", "not_a_peer",
        # "other_cluster", "too_many_connections"; ended for a frame: "bad_frame", "bad_mac" (its
        # tag); frames
        # dropped: "out_of_range", "not_leased"). Counted, not kept: a flood costs no memory.
        self.refused = Refusals(f"KV over TCP to {meta.engine_id}", log)
        self.kv = kv_cache
        self.peers: dict[str, KVAgentMetadata] = {}
        self._writers: dict[str, _Session] = {}
        # Leases open here: request -> (the peer that may write, None: any; its blocks), and per
        # peer how many open leases hold each block (a block is in one lease at a time, but a late
        # revoke must not drop a newer grant of the same block).
        self._grants: dict[str, tuple[str | None, list[int]]] = {}
        self._writable: dict[str | None, Counter[int]] = {}
        self._grant_lock = threading.Lock()  # granted on the engine's thread, read on the receiver's
        self._layer_bytes = kv_cache[0].numel() * kv_cache.element_size()
        self._block_bytes = kv_cache.shape[1] * kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        self._locks: dict[str, asyncio.Lock] = {}
        self._notices: list[bytes] = []
        self._notice_lock = threading.Lock()
        self._closed = False
        self._serving: set[asyncio.Task] = set()  # the receiver's open connections
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"kv-tcp-{meta.engine_id}",
                                        daemon=True)
        self._thread.start()
        self._server = self._run(asyncio.start_server(self._serve, host, port))
        meta.address = f"{host}:{self._server.sockets[0].getsockname()[1]}"

    def _run(self, coro, timeout: float | None = 30):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- sending --------------------------------------------------------------------------------

    def add_peer(self, peer: KVAgentMetadata) -> None:
        self.peers[peer.engine_id] = peer

    def remove_peer(self, engine_id: str) -> None:
        self.peers.pop(engine_id, None)
        w = self._writers.pop(engine_id, None)
        if w is not None:
            self._loop.call_soon_threadsafe(w.writer.close)

    def grant(self, peer_id: str | None, request_id: str, block_ids: list[int]) -> None:
        with self._grant_lock:
            self._grants[request_id] = (peer_id, list(block_ids))
            self._writable.setdefault(peer_id, Counter()).update(block_ids)

    def revoke(self, request_id: str) -> None:
        with self._grant_lock:
            got = self._grants.pop(request_id, None)
            if got is not None:
                peer, blocks = got
                held = self._writable[peer]
                held.subtract(blocks)
                for b in blocks:
                    if held[b] <= 0:
                        del held[b]

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]):
        """Post one layer's planes (K and V, or MLA's latent) for these blocks; the token is a concurrent Future."""
        parts, spans = [], []
        for s, d, n in runs(src_blocks, dst_blocks):
            parts.append(self.kv[layer, :, s:s + n])  # [planes, n, block_size, heads, dim]
            spans.append((d, n))
        # One copy into a host buffer: the bytes leave while the engine goes on computing.
        # As bytes: whatever the cache stores (FP8 too) moves as it is, through uint8 kernels only.
        payload = torch.cat([p.flatten().view(torch.uint8) for p in parts]).cpu().numpy().tobytes()
        header = {"kind": "kv", "layer": layer, "runs": spans, "nbytes": len(payload)}
        return asyncio.run_coroutine_threadsafe(self._send(peer_id, header, payload), self._loop)

    @staticmethod
    def state(token) -> str:
        if not token.done():
            return "pending"
        return "failed" if token.exception() is not None else "done"

    @staticmethod
    def release(token) -> None:
        """Unsent frames are dropped. settled() at once (KVBackend's): whatever was sent precedes
        any later notice on the same connection, so the peer has placed it before it reads that notice."""
        token.cancel()

    def notify(self, peer_id: str, payload: bytes) -> None:
        self._run(self._send(peer_id, {"kind": "notice", "nbytes": len(payload)}, payload), timeout=10)

    def progress(self) -> None:
        """Nothing to drive: a thread of our own receives."""

    def notifications(self) -> list[bytes]:
        with self._notice_lock:
            out, self._notices = self._notices, []
        return out

    async def _send(self, peer_id: str, header: dict, payload: bytes) -> None:
        lock = self._locks.setdefault(peer_id, asyncio.Lock())
        async with lock:  # frames of one peer never interleave
            s = self._writers.get(peer_id)
            if s is None or s.writer.is_closing():
                s = await asyncio.wait_for(self._connect(peer_id), HELLO_S)
                self._writers[peer_id] = s
            s.send(header, payload)
            await s.writer.drain()

    async def _connect(self, peer_id: str) -> _Session:
        """Open the ordered connection to a peer: its nonce, our hello, its answer."""
        host, port = self.peers[peer_id].address.rsplit(":", 1)
        reader, w = await asyncio.open_connection(host, int(port))
        try:
            nonce = await reader.readexactly(NONCE_BYTES)
            me = self.meta.engine_id
            w.write(frame({"kind": "hello", "sender": me, "receiver": peer_id,
                           "proof": hello_proof(self._token, nonce, me, peer_id), "nbytes": 0}, b""))
            await w.drain()
            (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
            answer = msgpack.unpackb(await reader.readexactly(n))
        except BaseException:
            w.close()
            raise
        if not answer.get("ok"):
            w.close()
            raise PeerRefused(f"KV peer {peer_id!r} refused {me!r}: {answer.get('why')}")
        return _Session(w, session_key(self._token, nonce, me, peer_id))

    # -- receiving ------------------------------------------------------------------------------

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple | None:
        """The connection's hello: (a handshaked peer proving our cluster's token, the session's
        key), or None, refused."""
        nonce = os.urandom(NONCE_BYTES)
        writer.write(nonce)
        await writer.drain()
        (n,) = _LEN.unpack(await asyncio.wait_for(reader.readexactly(_LEN.size), HELLO_S))
        sender, reason = "?", "not_a_hello"
        why = "not a pdserve KV hello"
        if n <= MAX_HELLO_BYTES:
            try:
                hello = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(n), HELLO_S))
            except Exception:  # (msgpack raises several kinds on garbage)
                hello = None
            if isinstance(hello, dict) and hello.get("kind") == "hello":
                sender = str(hello.get("sender", "?"))
                expected = hello_proof(self._token, nonce, sender, self.meta.engine_id)
                if sender not in self.peers:
                    reason, why = "not_a_peer", f"{sender!r} is not a handshaked peer of {self.meta.engine_id!r}"
                elif not hmac.compare_digest(str(hello.get("proof", "")), expected):
                    reason, why = "other_cluster", f"{sender!r} belongs to another cluster: its cluster token differs"
                else:
                    writer.write(frame({"ok": True}, b""))
                    await writer.drain()
                    return sender, session_key(self._token, nonce, sender, self.meta.engine_id)
        self.refused.refuse(reason, f"a connection from {sender}: {why}")
        try:
            writer.write(frame({"ok": False, "why": why}, b""))
            await asyncio.wait_for(writer.drain(), 1.0)
        except Exception:  # (it left already)
            pass
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._serving) >= MAX_CONNECTIONS:
            self.refused.refuse("too_many_connections", "a connection")
            writer.close()
            return
        self._serving.add(asyncio.current_task())
        me = None
        try:
            me = await self._authenticate(reader, writer)
            if me is None:
                return
            sender, sealer = me[0], Sealer(me[1])
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                if n > self._max_header():
                    raise BadFrame("bad_frame", f"a header of {n} bytes")
                raw = await reader.readexactly(n)
                header = self._header(raw)
                try:
                    payload = sealer.open(await reader.readexactly(header["nbytes"] + TAG_BYTES), raw)
                except BadSeal as e:  # (the stream is no longer the sender's as sent)
                    raise BadFrame("bad_mac", str(e)) from None
                if header["kind"] == "notice":
                    with self._notice_lock:
                        self._notices.append(payload)
                elif (why := self._unwritable(sender, header)) is not None:
                    self.refused.refuse(why[0], f"a KV write of {sender}: {why[1]}")
                else:
                    self._place(header, payload)
        except BadFrame as e:  # the stream is no peer's any more: it ends, the worker serves on
            self.refused.refuse(e.reason, f"{e}; its connection closed")
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, ValueError):
            if me is None:  # it spoke no hello (in time)
                self.refused.refuse("not_a_hello", "a connection that said no hello")
            # (else the sender went away: its leases expire on our side)
        finally:
            self._serving.discard(asyncio.current_task())
            writer.close()

    def _max_header(self) -> int:
        return 4096 + 16 * self.meta.num_blocks  # a run is two ints: a layer of runs of single blocks fits

    def _header(self, raw: bytes) -> dict:
        """A frame's header, bounded before its payload is read; raises BadFrame."""
        try:
            h = msgpack.unpackb(raw)
        except Exception:  # (msgpack raises several kinds on garbage)
            raise BadFrame("bad_frame", "a header that is not msgpack") from None
        if not isinstance(h, dict) or h.get("kind") not in ("kv", "notice"):
            raise BadFrame("bad_frame", "a header of no known kind")
        n, cap = h.get("nbytes"), self._layer_bytes if h["kind"] == "kv" else MAX_NOTICE_BYTES
        if type(n) is not int or not 0 <= n <= cap:
            raise BadFrame("bad_frame", f"a {h['kind']} frame of {n!r} bytes (at most {cap})")
        return h

    def _unwritable(self, sender: str, h: dict) -> tuple[str, str] | None:
        """Why a KV frame may not land: (reason, detail), or None where it may."""
        layer, spans = h.get("layer"), h.get("runs")
        if type(layer) is not int or not 0 <= layer < self.meta.num_layers:
            return "out_of_range", f"layer {layer!r} outside [0, {self.meta.num_layers})"
        if not isinstance(spans, list) or not all(
                isinstance(r, list) and len(r) == 2 and type(r[0]) is int and type(r[1]) is int
                and r[0] >= 0 and r[1] >= 1 and r[0] + r[1] <= self.meta.num_blocks for r in spans):
            return "out_of_range", f"runs {str(spans)[:80]} outside blocks [0, {self.meta.num_blocks})"
        blocks = sum(n for _, n in spans)
        if h["nbytes"] != blocks * self._block_bytes:
            return "out_of_range", f"{h['nbytes']} bytes for {blocks} blocks of {self._block_bytes}"
        with self._grant_lock:
            mine, anyone = self._writable.get(sender, {}), self._writable.get(None, {})
            for d, n in spans:
                for b in range(d, d + n):
                    if b not in mine and b not in anyone:
                        return "not_leased", f"block {b} is in no lease of {sender!r}"
        return None

    def _place(self, header: dict, payload: bytes) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv.dtype)
        planes, shape = self.kv.shape[1], self.kv.shape[3:]  # block_size, heads, dim
        off = 0
        for d, n in header["runs"]:
            size = planes * n * shape.numel()
            self.kv[header["layer"], :, d:d + n].copy_(data[off:off + size].view(planes, n, *shape))
            off += size

    def refusals(self) -> dict[str, Counter]:
        return {"kv_tcp": self.refused}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown():
            self._server.close()
            for w in self._writers.values():
                w.writer.close()
            for task in list(self._serving):  # connections still open end here, not with the loop
                task.cancel()
            await asyncio.gather(*self._serving, return_exceptions=True)

        try:
            self._run(shutdown(), timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
