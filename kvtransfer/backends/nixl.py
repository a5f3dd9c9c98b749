"""KV over NIXL (UCX): one-sided WRITEs straight into the peer's registered KV allocation.

The allocation is registered once, one region per layer (nixl_descs.py), and both descriptor lists
(ours and each peer's) are prepared once: one descriptor per (layer, plane, block) — the planes are
K and V, or MLA's one latent —, index `(layer * planes + plane) * num_blocks + block`, so that index
order is address order. A write then only picks indices. NIXL merges descriptors that are adjacent
on both sides (`skip_desc_merge=False`), so a run of consecutive blocks moves as one descriptor: checked with NIXL's telemetry
(`descCount` is 1 for a 4000-block run, 4000 with merging skipped; tests/test_nixl_backend.py
asserts it), which matters because UCX pays per descriptor (docs/benchmarks-history.md, KV transfer
between two GPUs).

Blocks that are not consecutive on both sides (a cache that has served traffic) still cost a
descriptor each, so a lease the decode end could give a staging slot (`reserve_staging`) moves
through slots instead (kvtransfer/staging.py): the posting thread gathers a post's blocks into one
of our slots and writes it to the peer's slot as one descriptor per run of layers (one for a whole
prompt), while the previous post is on the wire; the decode end scatters its slot into the blocks
at the finish notice. With no slot of ours free (or a post larger than one), the post writes each
run of blocks into the peer's slot directly: never a wait. Blocks in one run need no slot: the
decode end gives none to a lease whose blocks are one run, and a post whose source blocks are one
run is written without a gather.
"""

import itertools
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kvtransfer.backend import KVBackend, Part
from pdserve.kvtransfer.backends.nixl_descs import block_array, block_descs, layer_regions, memory_of, plane_indices
from pdserve.kvtransfer.backends.nixl_rows import block_rows, descriptors, gathered_rows
from pdserve.kvtransfer.blocks import runs
from pdserve.kvtransfer.metadata import KVAgentMetadata
from pdserve.kvtransfer.staging import StagingPool, cache_words, gather, layer_runs, scatter
from pdserve.kvtransfer.wire import ReserveHandle

log = logging.getLogger(__name__)


class _Bound(threading.local):
    bound = False  # per thread: our GPU's context made current on it


@dataclass
class _Peer:
    meta: KVAgentMetadata
    dlist: object  # nixl_prepped_dlist_handle of the peer's blocks


@dataclass
class _Xfer:
    peer: str
    handle: object | None  # nixl_xfer_handle; None when there was nothing to post
    state: str  # "pending" | "done" | "failed" — cached once final
    slot: int | None = None  # our staging slot the write reads: free once it cannot any more


class NixlBackend(KVBackend):
    """Writes runs of KV blocks into peers' allocations through one NIXL agent (UCX backend)."""

    inline = False  # a post is host work (descriptor lists, a UCX request): the posting thread's
    waits = False  # NIXL has no blocking wait: the posting thread polls state(), driving progress

    def __init__(self, meta: KVAgentMetadata, kv_cache: torch.Tensor, telemetry: bool = False,
                 close_timeout_s: float = 2.0, num_workers: int = 1, progress_thread: bool = False,
                 staging_slots: int = 4, staging_slot_mb: float = 64.0):
        from pdserve.kvtransfer.backends.nixl_find import nixl_api

        api = nixl_api()  # only workers that use NIXL load it
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

        assert kv_cache.is_contiguous(), "the KV allocation must be one contiguous region"
        assert kv_cache.data_ptr() == meta.base_addr, "meta describes another allocation"
        self.meta = meta
        self.kv = kv_cache  # keeps the registered memory alive as long as the agent uses it
        self._mem, self._dev = memory_of(str(kv_cache.device))
        self._close_timeout_s = close_timeout_s
        self._closed = False
        self._peers: dict[str, _Peer] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._stuck: dict[int, _Xfer] = {}  # token -> a transfer NIXL refused to release (in flight): retried later
        self._tokens = itertools.count()
        self._notices: list[bytes] = []
        self.refused = 0  # notices dropped: their sender was not a handshaked peer
        self.slots_given = 0  # decode end: leases that got a staging slot
        self.posts_gathered = 0  # prefill end: staged posts gathered into a slot of ours
        self.posts_direct = 0  # prefill end: staged posts written run by run (no slot of ours, or one run)
        self._cuda_thread = _Bound()

        # No NIXL progress thread by default: it spins a core even when idle, and the connector
        # already drives progress by polling
        # transfer states and notifications (`progress`).
        self.agent = nixl_agent(meta.engine_id, nixl_agent_config(enable_prog_thread=progress_thread, backends=[],
                                                                  capture_telemetry=telemetry))
        # UCX workers post descriptors in parallel: with many descriptors per request it pays.
        self.agent.create_backend("UCX", {"num_workers": str(num_workers)})
        # Slots of one size, allocated and registered once: bounded, and no allocation per transfer.
        self.staging = StagingPool(staging_slots, int(staging_slot_mb * 2**20), kv_cache.device)
        self._cache = cache_words(kv_cache, meta.num_layers, meta.num_planes, meta.num_blocks)
        regions = layer_regions(meta, self._dev)
        if staging_slots:
            regions.append((self.staging.base_addr, staging_slots * self.staging.slot_bytes, self._dev, ""))
            meta.staging_addr, meta.staging_slots = self.staging.base_addr, staging_slots
            meta.staging_slot_bytes = self.staging.slot_bytes
        self._reg = self.agent.register_memory(regions, self._mem)
        try:
            self._local = self.agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                block_descs(meta.base_addr, meta.num_layers, meta.num_blocks, meta.bytes_per_block, self._dev,
                       meta.num_planes),
                self._mem)
        except Exception:
            self.agent.deregister_memory(self._reg)
            raise
        # Taken after registering: the blob carries the region's remote keys the peers need.
        meta.agent_metadata = self.agent.get_agent_metadata()

    # -- peers ----------------------------------------------------------------------------------

    def add_peer(self, peer: KVAgentMetadata) -> None:
        """Load a peer's agent metadata and prepare its block descriptors (once per peer)."""
        if peer.engine_id in self._peers:  # a re-handshake (e.g. the peer restarted): start afresh
            self.remove_peer(peer.engine_id)
        name = self.agent.add_remote_agent(peer.agent_metadata)
        if isinstance(name, bytes):  # the bindings hand the name back as bytes
            name = name.decode()
        if name != peer.engine_id:
            self.agent.remove_remote_agent(name)
            raise ValueError(f"peer {peer.engine_id!r} sent NIXL metadata of agent {name!r}")
        mem, dev = memory_of(peer.device)
        try:
            dlist = self.agent.prep_xfer_dlist(
                peer.engine_id,
                block_descs(peer.base_addr, peer.num_layers, peer.num_blocks, peer.bytes_per_block, dev,
                       peer.num_planes), mem)
        except Exception:
            self.agent.remove_remote_agent(peer.engine_id)
            raise
        self._peers[peer.engine_id] = _Peer(peer, dlist)

    def remove_peer(self, engine_id: str) -> None:
        """Forget a peer: its transfers are released (and read as failed), then its descriptors."""
        p = self._peers.pop(engine_id, None)
        if p is None:
            return
        for tok in [t for t, x in self._xfers.items() if x.peer == engine_id]:
            self.release(tok)
        self._release_stuck()
        self._quietly(p.dlist.release, "release the descriptor list of", engine_id)
        self._quietly(lambda: self.agent.remove_remote_agent(engine_id), "remove agent", engine_id)

    # -- transfers ------------------------------------------------------------------------------

    def write(self, peer_id: str, layer: int, src_blocks: list[int], dst_blocks: list[int]) -> int:
        """Post one WRITE of `layer`'s planes (K and V, or the latent) from src_blocks into the peer's
        dst_blocks; returns a token."""
        return self._post(peer_id, [(layer, src_blocks, dst_blocks)])

    def write_layers(self, peer_id: str, parts: list[Part]) -> list[int]:
        """Post one WRITE covering several (layer, src_blocks, dst_blocks): one NIXL request, so
        layers that queued up together pay the per-request cost once."""
        return [self._post(peer_id, parts)]

    def _post(self, peer_id: str, parts: list[Part]) -> int:
        """One WRITE of these parts; its token."""
        for layer, src_blocks, dst_blocks in parts:
            if len(src_blocks) != len(dst_blocks):
                raise ValueError(f"{len(src_blocks)} source blocks but {len(dst_blocks)} destination blocks")
            if not 0 <= layer < self.meta.num_layers:
                raise ValueError(f"layer {layer} outside [0, {self.meta.num_layers})")
        token = next(self._tokens)
        peer = self._peers.get(peer_id)
        if peer is None:  # removed meanwhile: the request fails, the caller's thread goes on
            self._xfers[token] = _Xfer(peer_id, None, "failed")
            return token
        planes = self.meta.num_planes  # the handshake made sure the peer's is the same
        ours, theirs = self.meta.num_blocks, peer.meta.num_blocks
        src_idx = [plane_indices(layer, block_array(s, ours, "source"), ours, planes) for layer, s, _ in parts]
        dst_idx = [plane_indices(layer, block_array(d, theirs, "destination"), theirs, planes) for layer, _, d in parts]
        src, dst = np.concatenate(src_idx), np.concatenate(dst_idx)
        if src.size == 0:
            self._xfers[token] = _Xfer(peer_id, None, "done")
            return token
        if self._mem == "VRAM":
            self._bind_cuda()
        x = _Xfer(peer_id, None, "pending")
        self._xfers[token] = x
        try:
            # Indices into the prepared lists; NIXL merges runs adjacent on both sides itself.
            x.handle = self.agent.make_prepped_xfer("WRITE", self._local, src, peer.dlist, dst,
                                                    skip_desc_merge=False)
            if self.agent.transfer(x.handle) == "ERR":
                x.state = "failed"
        except Exception as e:  # e.g. the peer is gone: report through state(), never raise here
            log.warning("NIXL write to %s failed: %s", peer_id, e)
            x.state = "failed"
        return token

    # -- staging -------------------------------------------------------------------------------

    def reserve_staging(self, peer_id: str | None, block_ids: list[int]) -> int | None:
        """Decode end: a slot for every layer of the lease's blocks, or None: blocks in one run
        (each layer's plane one descriptor already), none free, or the KV larger than a slot."""
        m = self.meta
        if len(runs(block_ids, block_ids)) <= 1:
            return None
        if not self.staging.fits(m.num_layers * m.num_planes * len(block_ids) * m.bytes_per_block):
            return None
        slot = self.staging.acquire()
        self.slots_given += slot is not None
        return slot

    def unstage(self, slot: int, block_ids: list[int]) -> None:
        """Decode end: scatter the slot into the lease's blocks on the caller's stream, then free it
        (on a GPU once the scatter has read it)."""
        m = self.meta
        nbytes = m.num_layers * m.num_planes * len(block_ids) * m.bytes_per_block
        scatter(self._cache, self.staging.view(slot, nbytes), block_ids)
        after = None
        if self._mem == "VRAM":
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.kv.device))  # where the scatter was queued
        self.staging.release(slot, after=after)

    def drop_staging(self, slot: int) -> None:
        self.staging.release(slot)

    def write_staged(self, handle: ReserveHandle, parts: list[Part]) -> list[int]:
        """Post parts into the handle's slot on the peer: gathered into a slot of ours and written
        as a descriptor per run of layers, or (no slot of ours) a descriptor per run of blocks."""
        token = next(self._tokens)
        peer = self._peers.get(handle.engine_id)
        if peer is None:  # removed meanwhile: the request fails, the caller's thread goes on
            self._xfers[token] = _Xfer(handle.engine_id, None, "failed")
            return [token]
        m, pm = self.meta, peer.meta
        n = len(handle.block_ids)
        if not (0 <= handle.staging < pm.staging_slots
                and m.num_layers * m.num_planes * n * m.bytes_per_block <= pm.staging_slot_bytes):
            raise ValueError(f"{handle.request_id}: staging slot {handle.staging} of {handle.engine_id} "
                             f"cannot hold {n} blocks")
        at = {b: i for i, b in enumerate(handle.block_ids)}
        remote = pm.staging_addr + handle.staging * pm.staging_slot_bytes
        groups = layer_runs(parts)
        for first, count, src, dst in groups:
            if not (0 <= first and first + count <= m.num_layers) or len(src) != len(dst):
                raise ValueError(f"layers [{first}, {first + count}) with {len(src)} source and {len(dst)} "
                                 f"destination blocks")
            block_array(src, m.num_blocks, "source")
            if any(d not in at for d in dst):
                raise ValueError(f"{handle.request_id}: destination blocks outside the lease")
        nbytes = sum(count * m.num_planes * len(src) * m.bytes_per_block for _, count, src, _ in groups)
        if nbytes == 0:
            self._xfers[token] = _Xfer(handle.engine_id, None, "done")
            return [token]
        # Blocks in one run on both sides are a descriptor per layer and plane already: no gather.
        contiguous = all(len(runs(src, [at[d] for d in dst])) == 1 for _, _, src, dst in groups)
        slot = None if contiguous else self._take_slot(nbytes)
        if slot is not None:
            self.posts_gathered += 1
            rows = self._gathered_rows(slot, groups, at, remote, n)
        else:
            self.posts_direct += 1
            rows = block_rows(groups, m, remote, at, n)
        self._start(token, handle.engine_id, pm, rows, slot)
        return [token]

    def _gathered_rows(self, slot: int, groups, at: dict[int, int], remote: int, n: int) -> list:
        """Gather the groups into our slot; the rows from it into the peer's."""
        placed = gather(self._cache, groups, self.staging.view(slot, self.staging.slot_bytes))
        if self._mem == "VRAM":  # NIXL reads the slot in host order, after the gather it queued
            torch.cuda.current_stream(self.kv.device).synchronize()
        return gathered_rows(placed, self.staging.addr(slot), remote, at, n, self.meta.num_planes,
                             self.meta.bytes_per_block)

    def _start(self, token: int, peer_id: str, pm: KVAgentMetadata, rows: list, slot: int | None) -> None:
        """Post one WRITE of these rows; a failure is reported through state(), never raised."""
        if self._mem == "VRAM":
            self._bind_cuda()
        x = _Xfer(peer_id, None, "pending", slot)
        self._xfers[token] = x
        try:
            mem, dev = memory_of(pm.device)
            local, remote = descriptors(rows, self._dev, dev)
            x.handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, self._mem),
                                                  self.agent.get_xfer_descs(remote, mem), peer_id)
            if self.agent.transfer(x.handle) == "ERR":
                x.state = "failed"
        except Exception as e:
            log.warning("NIXL staged write to %s failed: %s", peer_id, e)
            x.state = "failed"
            if x.handle is None:  # nothing reads the slot
                self._free_slot(x)

    def _take_slot(self, nbytes: int) -> int | None:
        """A slot of ours for a post of nbytes; writes that finished since give theirs back first."""
        if not self.staging.fits(nbytes):
            return None
        slot = self.staging.acquire()
        if slot is None:
            for token in [t for t, x in self._xfers.items() if x.slot is not None]:
                self.state(token)
            slot = self.staging.acquire()
        return slot

    def _free_slot(self, x: _Xfer) -> None:
        if x.slot is not None:
            slot, x.slot = x.slot, None
            self.staging.release(slot)

    def state(self, token: int) -> str:
        """'done' | 'pending' | 'failed' of a write (an unknown or released token reads 'failed')."""
        x = self._xfers.get(token)
        if x is None:
            return "failed"
        if x.state == "pending":
            try:
                s = self.agent.check_xfer_state(x.handle)
            except Exception:
                s = "ERR"
            if s == "DONE":
                x.state = "done"
                self._free_slot(x)  # the write read it all
            elif s != "PROC":
                x.state = "failed"
        return x.state

    def release(self, token: int) -> None:
        """Free a write's handle; one still in flight is cancelled, or kept and retried later."""
        x = self._xfers.pop(token, None)
        if x is not None and x.handle is not None:
            self._stuck[token] = x
        elif x is not None:
            self._free_slot(x)
        self._release_stuck()

    def settled(self, token: int) -> bool:
        """A released write can no longer touch the peer's memory: NIXL let go of its handle."""
        self._release_stuck()
        return token not in self._xfers and token not in self._stuck

    def descriptor_count(self, token: int) -> int:
        """Descriptors NIXL actually moved for a write, after merging (needs telemetry=True)."""
        h = self._xfers[token].handle
        return 0 if h is None else self.agent.get_xfer_telemetry(h).descCount

    # -- notices --------------------------------------------------------------------------------

    def notify(self, peer_id: str, payload: bytes) -> None:
        """Send a small message to a peer (raises if the peer is unknown or unreachable)."""
        if peer_id not in self._peers:
            raise KeyError(f"unknown peer {peer_id!r}")
        self.agent.send_notif(peer_id, payload)

    def notifications(self) -> list[bytes]:
        """Every notice received since the last call, from any peer."""
        self.progress()
        out, self._notices = self._notices, []
        return out

    def progress(self) -> None:
        """Let UCX make progress (there is no progress thread); notices received are kept.

        A peer's write into our memory over UCX's host transports needs our side to progress
        too, so an idle end that expects data calls this (polling notifications does)."""
        for agent, msgs in self.agent.get_new_notifs().items():
            agent = agent.decode() if isinstance(agent, bytes) else agent
            if agent in self._peers:
                self._notices += msgs
            else:  # only handshaked peers speak to this end (a stranger cannot write: it lacks our keys)
                self.refused += len(msgs)
                log.warning("NIXL: dropped %d notices from %r, not a handshaked peer", len(msgs), agent)

    def refusals(self) -> dict:
        return {"kv_nixl": {"not_a_peer": self.refused}} if self.refused else {}

    # -- teardown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Release every transfer and descriptor list, drop the peers, deregister; idempotent."""
        if self._closed:
            return
        self._closed = True
        for tok in list(self._xfers):
            self.release(tok)
        # Transfers NIXL could not cancel get a short while to settle: deregistering memory a
        # transfer still reads could fault, so memory stays registered if they never do.
        deadline = time.monotonic() + self._close_timeout_s
        while self._stuck and time.monotonic() < deadline:
            time.sleep(0.01)
            self._release_stuck()
        for engine_id in list(self._peers):
            self.remove_peer(engine_id)
        self._quietly(self._local.release, "release the local descriptor list", "")
        if self._stuck:
            log.warning("NIXL: %d transfers never settled; leaving the KV memory registered", len(self._stuck))
        else:
            self._quietly(lambda: self.agent.deregister_memory(self._reg), "deregister the KV memory", "")

    # -- helpers --------------------------------------------------------------------------------

    def _release_stuck(self) -> None:
        """Retry releasing handles NIXL refused before (their transfer may have ended by now)."""
        for token, x in list(self._stuck.items()):
            try:
                x.handle.release()
            except Exception:
                continue
            del self._stuck[token]
            self._free_slot(x)

    def _bind_cuda(self) -> None:
        """Make our GPU's context current on the calling thread: UCX's CUDA transports use it."""
        if self._cuda_thread.bound:
            return
        torch.cuda.set_device(self._dev)
        self._cuda_thread.bound = True

    @staticmethod
    def _quietly(fn, what: str, who: str) -> None:
        """Teardown goes on past a failing step (a dead peer must not stop the rest)."""
        try:
            fn()
        except Exception as e:
            log.warning("NIXL: could not %s %s: %s", what, who, e)
