"""The decode end of a KV transfer: leases on reserved blocks, and the notices that end them.

reserve(request, blocks) -> ReserveHandle; poll() -> DecodePoll (done, failed, settled); release()
-> whether the blocks must wait to be settled. The blocks belong to the engine: the connector says
when they may be freed, it never frees them.

A lease is counted on this process's monotonic clock (the handle carries its length, not a time).
A reservation whose finish notice has not come by its deadline fails. A lease that ends without
its KV (an abort here, expiry) keeps its blocks *closing* until no write can land in them: until
the prefill end answers with its own abort (sent once its writes stopped), or for a silent one
until deadline + `settle_s`; poll() then lists it as settled and the engine frees the blocks.
"""

import time
from dataclasses import dataclass, field

from pdserve.kvtransfer.backend import KVBackend
from pdserve.kvtransfer.wire import FirstLogprob, Notice, NoticeKind, ReserveHandle
from pdserve.kvtransfer.metadata import KVAgentMetadata, Replays, accept_peer
from pdserve.kvtransfer.notice_seal import NoticeSeal
from pdserve.kvtransfer.pairing import choose_backend


@dataclass
class Finished:
    request_id: str
    first_token: int
    first_logprob: FirstLogprob | None = None  # where the request asked for logprobs


@dataclass
class DecodePoll:
    """What a decode end's poll() found. `failed` is for whoever waits on the request; `settled`
    is for the block pool: a lease that ended without its KV (aborted, expired, refused) keeps its
    blocks until no write of the prefill end can land in them any more."""

    done: list[Finished] = field(default_factory=list)  # KV arrived: decode may start
    failed: list[str] = field(default_factory=list)  # the transfer failed (prefill abort, lease ran out)
    why: dict[str, str] = field(default_factory=dict)  # failed request -> why, for its router
    settled: list[str] = field(default_factory=list)  # blocks of ended leases that may be reused now


@dataclass
class _Lease:
    handle: ReserveHandle
    prefill_id: str | None
    closing: bool = False  # ended without its KV: waiting until the prefill end's writes have stopped


class DecodeConnector:
    """Blocks of a lease that ends without its KV are freed only once the prefill end has answered
    the abort (its answer follows any write it posted) or, where it stays silent, `settle_s` after
    the lease's deadline (by which a live prefill end stopped writing on its own). Freed earlier, a
    late write would land in blocks that another request owns by then.

    Each end counts the lease on its own clock (ReserveHandle): ours from when we made the handle,
    the prefill end's from when the handle reached it, which is later by the handle's way through
    the router (a Ray call or two: milliseconds). The prefill end posts nothing past its deadline,
    so its last write lands by our deadline plus that way plus the write's own flight; `settle_s`
    is the margin that covers both (and the clocks' rate difference, parts per million of the
    lease)."""

    # As PrefillConnector.error, always None: this end runs no thread of its own (its backend calls
    # are poll()'s, on the engine's thread, where an exception stops the loop).
    error: BaseException | None = None

    def __init__(self, backend: KVBackend, meta: KVAgentMetadata, settle_s: float = 5.0,
                 cluster_token: str | None = None):
        self.backend = backend
        self.meta = meta
        self.cluster_token = cluster_token
        self.peers: dict[str, KVAgentMetadata] = {}
        self.pairs: dict[str, dict] = {}  # peer -> the handshake's record: backend chosen, why
        self._replays = Replays()  # peers' records accepted lately
        self.settle_s = settle_s
        self._leases: dict[str, _Lease] = {}
        self._seal = NoticeSeal(cluster_token, meta.engine_id)
        self.dropped = self._seal.dropped  # notices dropped unread, by why (NoticeSeal)

    def metadata(self) -> bytes:
        """What this end publishes for the handshake (msgpack)."""
        return self.meta.pack(self.cluster_token)

    def add_peer(self, data: bytes) -> str:
        """Handshake with a prefill worker; raises HandshakeError on any mismatch."""
        peer = accept_peer(self.meta, data, self.cluster_token, self._replays)
        self.backend.add_peer(peer)
        self.peers[peer.engine_id] = peer
        self.pairs[peer.engine_id] = choose_backend(self.meta, peer).record(self.meta, peer)
        return peer.engine_id

    def reserve(self, request_id: str, block_ids: list[int], lease_s: float,
                prefill_id: str | None = None, cached_blocks: int = 0) -> ReserveHandle:
        """Open a lease on blocks the engine reserved (those to write, after the `cached_blocks`
        leading ones it holds already); the handle goes to the prefill worker."""
        slot = self.backend.reserve_staging(prefill_id, list(block_ids))
        handle = ReserveHandle(request_id, self.meta.engine_id, list(block_ids), lease_s, cached_blocks,
                               staging=-1 if slot is None else slot)
        self._leases[request_id] = _Lease(handle, prefill_id)
        self.backend.grant(prefill_id, request_id, handle.block_ids)  # (a backend that sees writes takes only these)
        return handle

    def poll(self) -> DecodePoll:
        """Requests whose KV has fully arrived, ones that failed, and ones whose blocks may be reused."""
        out = DecodePoll()
        for payload in self.backend.notifications():
            n = self._seal.receive(payload)
            if n is None:
                continue
            lease = self._leases.get(n.request_id)
            if lease is None:
                continue  # a late notice of a lease settled already
            if n.sender != lease.prefill_id and (lease.prefill_id is not None or n.sender not in self.peers):
                self._seal.drop("not_the_lease_holder", f"{n.kind} of {n.request_id} from {n.sender!r}, "
                                                   f"whose lease is {lease.prefill_id!r}'s")
                continue
            self._end(n.request_id)
            if lease.closing:  # a finish too: every write landed, none can follow
                self._settle(lease, out)
            elif n.kind is NoticeKind.FINISH:
                if lease.handle.staging >= 0:  # every write landed in the slot: into the blocks
                    self.backend.unstage(lease.handle.staging, lease.handle.block_ids)
                out.done.append(Finished(n.request_id, n.first_token, n.logprob()))
            else:  # the prefill end gave up, and its writes have stopped
                out.failed.append(n.request_id)
                out.why[n.request_id] = f"the prefill worker {n.sender} gave up the KV transfer"
                self._settle(lease, out)
        now = time.monotonic()
        for rid, lease in list(self._leases.items()):
            if lease.closing and lease.handle.deadline + self.settle_s < now:
                self._end(rid)  # a silent or dead prefill end
                self._settle(lease, out)
            elif not lease.closing and lease.handle.deadline < now:
                self._close(rid, lease)
                out.failed.append(rid)
                out.why[rid] = (f"no KV from the prefill worker {lease.prefill_id} within its "
                                f"{lease.handle.lease_s:g} s lease")
        return out

    def progress(self) -> None:
        """Let the transport move data into our blocks; call it while waiting (poll() does too)."""
        self.backend.progress()

    def release(self, request_id: str) -> bool:
        """End a lease before its KV arrived: the prefill worker is told to stop. True when the blocks
        must wait for poll() to report the request settled; False when they are free to go now."""
        lease = self._leases.get(request_id)
        if lease is None:
            return False
        if not lease.closing:
            self._close(request_id, lease)
        return True

    def busy(self) -> bool:
        """Leases open or closing: poll() has something to wait for."""
        return bool(self._leases)

    def _end(self, rid: str) -> None:
        """The lease is over: no write may land in its blocks from now on."""
        del self._leases[rid]
        self.backend.revoke(rid)

    def _settle(self, lease: _Lease, out: DecodePoll) -> None:
        """No write of the lease can land any more: its blocks (and staging slot) may be reused."""
        if lease.handle.staging >= 0:
            self.backend.drop_staging(lease.handle.staging)
        out.settled.append(lease.handle.request_id)

    def _close(self, rid: str, lease: _Lease) -> None:
        lease.closing = True
        if lease.prefill_id in self.peers:
            # The prefill end may not have the handle yet. It answers at once then, and we reuse the
            # blocks: it must refuse the request's posts until no handle of this lease can be posted
            # to, which is the lease's time left plus the handle's way there (settle_s covers it).
            refuse_s = max(lease.handle.deadline - time.monotonic(), 0.0) + self.settle_s
            try:
                self.backend.notify(lease.prefill_id,
                                   self._seal.seal(Notice.abort(rid, self.meta.engine_id, refuse_s), lease.prefill_id))
            except Exception:  # a dead peer cannot be told: the blocks wait out the lease
                pass

    def close(self) -> None:
        self.backend.close()
