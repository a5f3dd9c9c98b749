"""KV between GPUs of one host through CUDA IPC: the prefill worker maps the decode worker's KV
allocation and copies into it over NVLink; notices go over TCP.

Why besides NIXL: on one host, NIXL/UCX's cuda_ipc path pays about a millisecond per request
and reaches 60-70 % of the peer-copy rate (docs/benchmarks.md); here a request's blocks move in
one copy kernel per post (kvtransfer/backends/block_copy.py), whatever their fragmentation.

Posting is *inline*: `write_range` runs on the caller's (the engine's) thread and only enqueues
GPU work — our copy stream waits for the caller's stream on the device, never on the host — so
a layer's KV leaves as soon as its kernels finish, without a thread hand-off; `wait` blocks (the
GIL released) until a post's copy is done.
"""

import pickle
import socket
import threading

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from kvtransfer.backends.block_copy import BlockCopy
from kvtransfer.backends.tcp import TcpBackend, frame
from kvtransfer.metadata import KVAgentMetadata

_STORAGE_DEVICE = 6  # position of the storage's device index in reduce_tensor's rebuild arguments
_RING = 8  # staging slots for block ids (pinned and on the GPU)


class CudaIpcBackend:
    inline = True

    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor, host: str = "127.0.0.1"):
        if not kv_cache.is_cuda:
            raise ValueError("kv_transfer.backend 'cuda_ipc' needs the KV cache on a GPU; use 'nixl' or 'tcp'")
        self.kv = kv_cache
        self.meta = meta
        self.notices = TcpBackend(meta, kv_cache, host=host)  # receives notices (sets meta.address)
        # The handle lets a peer on this host map our allocation; the args hold no tensor data.
        _, args = reduce_tensor(kv_cache)
        meta.agent_metadata = pickle.dumps(args)
        self.stream = torch.cuda.Stream(device=kv_cache.device)
        self._raw_stream = self.stream.cuda_stream
        self._handles: dict[str, bytes] = {}
        self._peers: dict[str, BlockCopy] = {}  # a mapped peer allocation, as the copy into it
        self._socks: dict[str, socket.socket] = {}
        self._sock_lock = threading.Lock()  # notices go out from the poster and the completion thread
        # Block ids go up through pinned memory into a device ring: a slot is refilled only once
        # the last copy that read it has run. Each slot holds the source ids, then the destination
        # ids from the next multiple of 4 on, so both start 16-byte aligned (as BlockCopy's
        # compiled kernel assumes).
        width = 2 * (-(-meta.num_blocks // 4) * 4) + 4
        self._pinned = torch.empty(_RING, width, dtype=torch.int32, pin_memory=True)
        self._pinned_np = self._pinned.numpy()  # filled from lists without building tensors
        self._dev_ids = torch.empty(_RING, width, dtype=torch.int32, device=kv_cache.device)
        self._last_use: list[torch.cuda.Event | None] = [None] * _RING  # per slot: the last copy reading it
        self._slot = 0
        self._ids: tuple[tuple, torch.Tensor, torch.Tensor, int] | None = None  # last upload: layers reuse it
        # Compile the copy kernel now (block 0 onto itself, before the engine uses the cache), not
        # while the first request waits.
        with torch.cuda.stream(self.stream):
            zero = torch.zeros(1, dtype=torch.int32, device=kv_cache.device)
            BlockCopy(kv_cache, kv_cache)(0, 1, zero, zero)
        self.stream.synchronize()

    def add_peer(self, peer: KVAgentMetadata) -> None:
        self.notices.add_peer(peer)
        self._handles[peer.engine_id] = peer.agent_metadata

    def remove_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)
        self._handles.pop(engine_id, None)
        with self._sock_lock:
            s = self._socks.pop(engine_id, None)
        if s is not None:
            s.close()
        self.notices.remove_peer(engine_id)

    def _peer_copy(self, engine_id: str) -> BlockCopy:
        """The copy into the peer's KV allocation, mapped into our GPU's context on first write
        (the decode side never writes and never maps)."""
        copy = self._peers.get(engine_id)
        if copy is None:
            args = list(pickle.loads(self._handles[engine_id]))
            # Open the handle in OUR device's context (peer access over NVLink), not the owner's:
            # our copy kernels run on our device, and an address mapped only in the other
            # device's context faults there. The tensor thus reads as ours; its bytes live on the peer.
            args[_STORAGE_DEVICE] = self.kv.device.index
            copy = self._peers[engine_id] = BlockCopy(self.kv, rebuild_cuda_tensor(*args))
        return copy

    def write_range(self, peer_id: str, first_layer: int, num_layers: int, src_blocks: list[int],
                    dst_blocks: list[int]) -> torch.cuda.Event:
        """Enqueue the copy of layers [first_layer, first_layer + num_layers) of these blocks;
        ordered after the work the caller's stream has queued so far. Returns the copy's event.

        This is the whole host cost of a post, paid before the copy can start, so it is kept to
        array fills, one upload, two events and the kernel's launch — no stream switch (the
        upload goes on the caller's stream, the kernel is launched onto ours by handle)."""
        copy = self._peer_copy(peer_id)
        if len(src_blocks) != len(dst_blocks):
            raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
        if not (0 <= first_layer and first_layer + num_layers <= self.meta.num_layers):
            raise ValueError(f"layers {first_layer}..{first_layer + num_layers - 1} outside [0, {self.meta.num_layers})")
        src_ids, dst_ids, slot = self._upload(src_blocks, dst_blocks, copy.dst_num_blocks)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.kv.device))  # after the KV's kernels and the ids' upload
        self.stream.wait_event(ready)
        copy(first_layer, num_layers, src_ids, dst_ids, stream=self._raw_stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        self._last_use[slot] = done
        return done

    def _upload(self, src: list[int], dst: list[int], dst_num_blocks: int):
        """Source and destination block ids on the GPU (int32), through pinned memory so that the
        upload never waits for a stream; the layers of one step reuse them. The upload is queued
        on the caller's stream. Returns them and the ring slot they are in."""
        key = (tuple(src), tuple(dst))
        if self._ids is not None and self._ids[0] == key:
            return self._ids[1], self._ids[2], self._ids[3]
        slot = self._slot = (self._slot + 1) % _RING
        if self._last_use[slot] is not None:
            self._last_use[slot].synchronize()  # in practice long done: 8 uploads ago
        n = len(src)
        off = -(-n // 4) * 4
        host = self._pinned_np[slot]
        host[:n], host[off:off + n] = src, dst
        if n:  # the kernel would write outside the cache
            for ids, limit, side in ((host[:n], self.kv.shape[2], "source"), (host[off:off + n], dst_num_blocks, "destination")):
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= limit:
                    raise ValueError(f"{side} block ids must lie in [0, {limit}), got {lo}..{hi}")
        dev = self._dev_ids[slot]
        dev[:off + n].copy_(self._pinned[slot, :off + n], non_blocking=True)  # pinned: asynchronous
        self._ids = (key, dev[:n], dev[off:off + n], slot)
        return self._ids[1], self._ids[2], slot

    def write_layers(self, peer_id: str, parts: list[tuple[int, list[int], list[int]]]):
        """Several (layer, src, dst) at once (the worker-thread interface); consecutive layers with
        the same blocks are one kernel."""
        done = None
        i = 0
        while i < len(parts):
            j = i + 1
            while j < len(parts) and parts[j][0] == parts[j - 1][0] + 1 and parts[j][1:] == parts[i][1:]:
                j += 1
            done = self.write_range(peer_id, parts[i][0], j - i, parts[i][1], parts[i][2])
            i = j
        return done

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]):
        return self.write_range(peer_id, layer, 1, src_blocks, dst_blocks)

    @staticmethod
    def state(token) -> str:
        return "done" if token is None or token.query() else "pending"

    @staticmethod
    def wait(token) -> bool:
        """Block until the copy is done (the GIL released meanwhile); True when it succeeded.

        cudaEventSynchronize returns within ~5 us of the copy's end on the H200 hosts (the
        `waited_ms` split of pdserve.benchmarks.kv_transfer); polling the event from Python was
        no faster and would take the GIL from the engine's thread while it spins."""
        if token is not None:
            token.synchronize()
        return True

    @staticmethod
    def release(token) -> None:
        pass  # a queued device copy cannot be called back: settled() says when it has run

    @staticmethod
    def settled(token) -> bool:
        return token is None or token.query()

    def notify(self, peer_id: str, payload: bytes) -> None:
        """A blocking send on a socket of our own: no hop through an event loop on the hot path."""
        data = frame({"kind": "notice", "nbytes": len(payload)}, payload)
        with self._sock_lock:
            s = self._socks.get(peer_id)
            try:
                if s is None:
                    host, port = self.notices.peers[peer_id].address.rsplit(":", 1)
                    s = self._socks[peer_id] = socket.create_connection((host, int(port)), timeout=10)
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.sendall(data)
            except OSError:
                self._socks.pop(peer_id, None)
                raise

    def progress(self) -> None:
        """Nothing to drive: a thread of our own receives."""

    def notifications(self) -> list[bytes]:
        return self.notices.notifications()

    def close(self) -> None:
        self.stream.synchronize()
        self._peers.clear()
        with self._sock_lock:
            for s in self._socks.values():
                s.close()
            self._socks.clear()
        self.notices.close()
