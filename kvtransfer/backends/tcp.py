"""KV over TCP (asyncio streams, msgpack-framed), for machines without NIXL.

Each worker runs a receiver; a sender opens one connection per peer and sends frames in order on
it, so a notice sent after a layer's frames is read after those frames are in place.
Frame: 4-byte big-endian header length, msgpack header, then `nbytes` of payload.
"""

import asyncio
import struct
import threading

import msgpack
import torch

from pdserve.kvtransfer.blocks import runs
from pdserve.kvtransfer.metadata import KVAgentMetadata

_LEN = struct.Struct(">I")


def frame(header: dict, payload: bytes) -> bytes:
    """One frame: header length, msgpack header, payload."""
    h = msgpack.packb(header)
    return _LEN.pack(len(h)) + h + payload


class TcpBackend:
    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor, host: str = "127.0.0.1", port: int = 0):
        self.meta = meta
        self.kv = kv_cache
        self.peers: dict[str, KVAgentMetadata] = {}
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._notices: list[bytes] = []
        self._notice_lock = threading.Lock()
        self._closed = False
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
        """Unsent frames are dropped; no settled(): whatever was sent precedes any later notice on
        the same connection, so the peer has placed it before it reads that notice."""
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
                host, port = self.peers[peer_id].address.rsplit(":", 1)
                _, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 10)
                self._writers[peer_id] = w
            w.write(frame(header, b""))
            w.write(payload)
            await w.drain()

    # -- receiving ------------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                header = msgpack.unpackb(await reader.readexactly(n))
                payload = await reader.readexactly(header["nbytes"])
                if header["kind"] == "kv":
                    self._place(header, payload)
                else:
                    with self._notice_lock:
                        self._notices.append(payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the sender went away; its leases expire on our side
        finally:
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

        try:
            self._run(shutdown(), timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
