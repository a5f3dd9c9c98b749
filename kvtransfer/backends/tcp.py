"""KV over TCP (asyncio streams, msgpack-framed), for machines without NIXL.

Each worker runs a receiver; a sender opens one connection per peer and sends frames in order on
it, so a notice sent after a layer's frames is read after those frames are in place.
Frame: 4-byte big-endian header length, msgpack header, then `nbytes` of payload.

The receiver listens on the node's address, so it takes connections from handshaked peers only:
it opens each connection with a fresh nonce, and the sender's first frame ("hello") names the
sender and proves the cluster token over that nonce (HMAC; the token never travels). A sender that
is not a handshaked peer, or whose proof is wrong, is refused by name (the receiver answers why,
logs it, keeps it in `refused`, and closes the connection) before a byte reaches the KV cache.
"""

import asyncio
import hashlib
import hmac
import logging
import os
import struct
import threading

import msgpack
import torch

from pdserve.kvtransfer.backend import KVBackend
from pdserve.kvtransfer.blocks import runs
from pdserve.kvtransfer.metadata import KVAgentMetadata

_LEN = struct.Struct(">I")
NONCE_BYTES = 16
HELLO_S = 10  # a peer that does not say who it is within this long is dropped
log = logging.getLogger(__name__)


def hello_proof(token: str | None, nonce: bytes, sender: str, receiver: str) -> str:
    return hmac.new((token or "").encode(), nonce + f"{sender}>{receiver}".encode(), hashlib.sha256).hexdigest()


class PeerRefused(ConnectionError):
    """A receiver refused this sender (not handshaked there, or of another cluster)."""


def frame(header: dict, payload: bytes) -> bytes:
    """One frame: header length, msgpack header, payload."""
    h = msgpack.packb(header)
    return _LEN.pack(len(h)) + h + payload


class TcpBackend(KVBackend):
    inline = False  # a post copies the layer to the host: the posting thread's
    waits = False  # the posting thread polls each post's Future

    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor, host: str = "127.0.0.1", port: int = 0,
                 cluster_token: str | None = None):
        self.meta = meta
        self._token = cluster_token
        self.refused: list[tuple[str, str]] = []  # (sender as it named itself, why) of refused connections
        self.kv = kv_cache
        self.peers: dict[str, KVAgentMetadata] = {}
        self._writers: dict[str, asyncio.StreamWriter] = {}
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
            self._loop.call_soon_threadsafe(w.close)

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
            w = self._writers.get(peer_id)
            if w is None or w.is_closing():
                w = await asyncio.wait_for(self._connect(peer_id), HELLO_S)
                self._writers[peer_id] = w
            w.write(frame(header, b""))
            w.write(payload)
            await w.drain()

    async def _connect(self, peer_id: str) -> asyncio.StreamWriter:
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
        return w

    # -- receiving ------------------------------------------------------------------------------

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The connection's hello: a handshaked peer proving our cluster's token, or refused."""
        nonce = os.urandom(NONCE_BYTES)
        writer.write(nonce)
        await writer.drain()
        (n,) = _LEN.unpack(await asyncio.wait_for(reader.readexactly(_LEN.size), HELLO_S))
        if n > 4096:
            why, sender = "not a pdserve KV hello", "?"
        else:
            hello = msgpack.unpackb(await asyncio.wait_for(reader.readexactly(n), HELLO_S))
            sender = str(hello.get("sender", "?")) if isinstance(hello, dict) else "?"
            expected = hello_proof(self._token, nonce, sender, self.meta.engine_id)
            if not isinstance(hello, dict) or hello.get("kind") != "hello":
                why = "not a pdserve KV hello"
            elif sender not in self.peers:
                why = f"{sender!r} is not a handshaked peer of {self.meta.engine_id!r}"
            elif not hmac.compare_digest(str(hello.get("proof", "")), expected):
                why = f"{sender!r} belongs to another cluster: its cluster token differs"
            else:
                writer.write(frame({"ok": True}, b""))
                await writer.drain()
                return True
        log.warning("KV over TCP: refused a connection from %s: %s", sender, why)
        self.refused.append((sender, why))
        writer.write(frame({"ok": False, "why": why}, b""))
        await writer.drain()
        return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._serving.add(asyncio.current_task())
        try:
            if not await self._authenticate(reader, writer):
                return
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                header = msgpack.unpackb(await reader.readexactly(n))
                payload = await reader.readexactly(header["nbytes"])
                if header["kind"] == "kv":
                    self._place(header, payload)
                else:
                    with self._notice_lock:
                        self._notices.append(payload)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError, ValueError):
            pass  # the sender went away (or spoke no hello); its leases expire on our side
        finally:
            self._serving.discard(asyncio.current_task())
            writer.close()

    def _place(self, header: dict, payload: bytes) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.kv.dtype)
        planes, shape = self.kv.shape[1], self.kv.shape[3:]  # block_size, heads, dim
        off = 0
        for d, n in header["runs"]:
            size = planes * n * shape.numel()
            self.kv[header["layer"], :, d:d + n].copy_(data[off:off + size].view(planes, n, *shape))
            off += size

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True

        async def shutdown():
            self._server.close()
            for w in self._writers.values():
                w.close()
            for task in list(self._serving):  # connections still open end here, not with the loop
                task.cancel()
            await asyncio.gather(*self._serving, return_exceptions=True)

        try:
            self._run(shutdown(), timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
