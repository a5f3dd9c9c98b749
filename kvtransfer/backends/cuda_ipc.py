"""KV between GPUs of one host through CUDA IPC: the prefill worker maps the decode worker's KV
allocation and copies into it over NVLink; notices go over a Unix socket.

Why besides NIXL: on one host, NIXL/UCX's cuda_ipc path pays per descriptor and stays well below
the peer-copy rate (docs/benchmarks-history.md, KV transfer between two GPUs); here a request's blocks move in
one copy kernel per post (kvtransfer/backends/block_copy.py), whatever their fragmentation.

Posting is *inline*: `write_range` runs on the caller's (the engine's) thread and only enqueues
GPU work — our copy stream waits for the caller's stream on the device, never on the host — so
a layer's KV leaves as soon as its kernels finish, without a thread hand-off; `wait` blocks (the
GIL released) until a post's copy is done.
"""

import struct

import torch

from pdserve.kvtransfer.backend import KVBackend, Part
from pdserve.kvtransfer.backends import ipc_handle
from pdserve.kvtransfer.backends.block_copy import BlockCopy
from pdserve.kvtransfer.backends.notices import NoticeInbox, NoticeOutbox
from pdserve.kvtransfer.metadata import KVAgentMetadata

_RING = 8  # staging slots for block ids (pinned host memory, read by the copy kernel)


class CudaIpcBackend(KVBackend):
    inline = True  # write_range enqueues a copy on our stream after the caller's: see above
    waits = True  # a post's token is a CUDA event, synchronized with the GIL released

    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor):
        if not kv_cache.is_cuda:
            raise ValueError("kv_transfer.backend 'cuda_ipc' needs the KV cache on a GPU; use 'nixl' or 'tcp'")
        self.kv = kv_cache
        self.meta = meta
        # Notices go over a Unix socket read when the connector polls (CUDA IPC peers share
        # this host): a send is a copy into a socket buffer, no thread to wake (notices.py).
        self.inbox, self.outbox = NoticeInbox(), NoticeOutbox()
        meta.address = self.inbox.address
        self._addresses: dict[str, str] = {}  # each peer's inbox
        # The handle lets a peer on this host map our allocation (explicit fields, no pickle).
        meta.agent_metadata = ipc_handle.share(kv_cache)
        self.stream = torch.cuda.Stream(device=kv_cache.device)
        self._raw_stream = self.stream.cuda_stream
        self._ready = torch.cuda.Event()
        self._handles: dict[str, bytes] = {}
        self._peers: dict[str, BlockCopy] = {}  # a mapped peer allocation, as the copy into it
        # Block ids live in a ring of pinned host slots that the copy kernel reads directly (over
        # PCIe, a few bytes per block): a post fills a slot and launches — no upload to wait for.
        # A slot is refilled only once the last copy that read it has run. Each slot holds the
        # source ids, then the destination ids from `half` on, both 16-byte aligned (as
        # BlockCopy's compiled kernel assumes).
        half = -(-meta.num_blocks // 4) * 4
        self._pinned = torch.empty(_RING, 2 * half, dtype=torch.int32, pin_memory=True)
        self._slot_bytes = [memoryview(row).cast("B") for row in self._pinned.numpy()]  # filled by struct
        self._slot_ids = [(self._pinned[i, :half], self._pinned[i, half:]) for i in range(_RING)]
        self._half = half
        self._last_use: list[torch.cuda.Event | None] = [None] * _RING  # per slot: the last copy reading it
        self._slot = 0
        self._staged: tuple[list[int], list[int], int] | None = None  # the last ids staged: layers reuse them
        # Compile the copy kernel now (block 0 onto itself, before the engine uses the cache), not
        # while the first request waits.
        self._pinned.zero_()
        with torch.cuda.stream(self.stream):
            BlockCopy(kv_cache, kv_cache)(0, 1, *self._slot_ids[0], n=1)
        self.stream.synchronize()

    def add_peer(self, peer: KVAgentMetadata) -> None:
        ipc_handle.decode(peer.agent_metadata, self.kv.device.index)  # refused at the handshake, not at a write
        self._addresses[peer.engine_id] = peer.address
        self._handles[peer.engine_id] = peer.agent_metadata

    def remove_peer(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)
        self._handles.pop(engine_id, None)
        self.outbox.forget(engine_id)
        self._addresses.pop(engine_id, None)

    def _peer_copy(self, engine_id: str) -> BlockCopy:
        """The copy into the peer's KV allocation, mapped into our GPU's context on first write
        (the decode side never writes and never maps)."""
        copy = self._peers.get(engine_id)
        if copy is None:
            # Open the handle in OUR device's context (peer access over NVLink), not the owner's:
            # our copy kernels run on our device, and an address mapped only in the other
            # device's context faults there. The tensor thus reads as ours; its bytes live on the peer.
            peer = ipc_handle.open_peer(self._handles[engine_id], self.kv.device.index)
            copy = self._peers[engine_id] = BlockCopy(self.kv, peer)
        return copy

    def write_range(self, peer_id: str, first_layer: int, num_layers: int, src_blocks: list[int],
                    dst_blocks: list[int]) -> torch.cuda.Event:
        """Enqueue the copy of layers [first_layer, first_layer + num_layers) of these blocks;
        ordered after the work the caller's stream has queued so far. Returns the copy's event.

        This is the whole host cost of a post, paid before the copy can start, so it is kept to
        array fills, two events and the kernel's launch — no upload (the kernel reads the ids
        from pinned memory), no stream switch (the kernel is launched onto our stream by handle)."""
        copy = self._peer_copy(peer_id)
        n = len(src_blocks)
        if n != len(dst_blocks):
            raise ValueError(f"{n} source blocks but {len(dst_blocks)} destination blocks")
        if not (0 <= first_layer and first_layer + num_layers <= self.meta.num_layers):
            raise ValueError(f"layers {first_layer}..{first_layer + num_layers - 1} outside [0, {self.meta.num_layers})")
        slot = self._stage(src_blocks, dst_blocks, copy.dst_num_blocks)
        # After the kernels writing the KV. One event serves every post: a stream's wait takes the
        # event's state at the call, so recording it again later changes nothing for this copy.
        self._ready.record(torch.cuda.current_stream(self.kv.device))
        self.stream.wait_event(self._ready)
        src_ids, dst_ids = self._slot_ids[slot]
        copy(first_layer, num_layers, src_ids, dst_ids, stream=self._raw_stream, n=n)
        done = torch.cuda.Event()
        done.record(self.stream)
        self._last_use[slot] = done
        return done

    def _stage(self, src: list[int], dst: list[int], dst_num_blocks: int) -> int:
        """Put the ids where the kernel reads them; the layers of one step reuse them. Returns the slot.

        struct packs a list straight into the slot (faster than numpy's conversion), and
        its unsigned format refuses negative ids on the way; max() bounds the rest."""
        staged = self._staged
        if staged is not None and staged[0] == src and staged[1] == dst:
            return staged[2]
        n = len(src)
        if n > self._half:
            raise ValueError(f"{n} blocks in one post, more than the {self._half} the id slots hold")
        if n:  # the kernel would write outside the cache
            for ids, limit, side in ((src, self.kv.shape[2], "source"), (dst, dst_num_blocks, "destination")):
                if max(ids) >= limit:
                    raise ValueError(f"{side} block ids must lie in [0, {limit}), got {min(ids)}..{max(ids)}")
        slot = self._slot = (self._slot + 1) % _RING
        last = self._last_use[slot]
        if last is not None and not last.query():  # in practice long done: 8 stagings ago
            last.synchronize()  # (which lets go of the GIL: not on the usual path)
        fmt, buf = f"{n}I", self._slot_bytes[slot]
        try:
            struct.pack_into(fmt, buf, 0, *src)
            struct.pack_into(fmt, buf, 4 * self._half, *dst)
        except struct.error:
            side = "source" if any(i < 0 for i in src) else "destination"
            raise ValueError(f"{side} block ids must be non-negative, got {min(src + dst)}") from None
        self._staged = (list(src), list(dst), slot)
        return slot

    def write_layers(self, peer_id: str, parts: list[Part]) -> list[torch.cuda.Event]:
        """Several (layer, src, dst) at once (the posting thread's interface); consecutive layers
        with the same blocks are one kernel. One token: our stream runs the copies in order, so the
        last one's event covers them all."""
        done = None
        i = 0
        while i < len(parts):
            j = i + 1
            while j < len(parts) and parts[j][0] == parts[j - 1][0] + 1 and parts[j][1:] == parts[i][1:]:
                j += 1
            done = self.write_range(peer_id, parts[i][0], j - i, parts[i][1], parts[i][2])
            i = j
        return [] if done is None else [done]

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]):
        return self.write_range(peer_id, layer, 1, src_blocks, dst_blocks)

    @staticmethod
    def state(token) -> str:
        return "done" if token is None or token.query() else "pending"

    @staticmethod
    def wait(token) -> bool:
        """Block until the copy is done (the GIL released meanwhile); True when it succeeded.

        cudaEventSynchronize returns soon after the copy's end (the `waited_ms` split of
        pdserve.benchmarks.kv_transfer shows it); polling the event from Python was
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
        """Straight into the peer's socket, no hop through an event loop on the hot path."""
        self.outbox.send(peer_id, self._addresses[peer_id], payload)

    def progress(self) -> None:
        """Nothing to drive: notices wait in the socket until notifications() reads them."""

    def notifications(self) -> list[bytes]:
        self.outbox.flush()  # (both ends poll here: a good moment to retry what a full socket left)
        return self.inbox.drain()

    def refusals(self) -> dict:
        return {"kv_ipc_inbox": self.inbox.refused}

    def close(self) -> None:
        self.stream.synchronize()
        self._peers.clear()
        self.outbox.close()
        self.inbox.close()
