"""The two ends of a KV transfer, with leases so that no dead or silent peer strands blocks.

Decode end: reserve(request, blocks) -> ReserveHandle; poll() -> DecodePoll (done, failed, settled);
release() -> whether the blocks must wait to be settled.
Prefill end: send_layer(...) / send_layers(...) (return at once), finish(request, first_token,
first_logprob);
poll() -> (done, failed); release(). Blocks themselves belong to the engines: a connector says when they may be
freed (done / failed), it never frees them.

The prefill end posts from one worker thread, so the engine's step never waits on the network;
every backend call of that end happens on that thread — except for a backend that posts inline
(cuda_ipc: it only enqueues device work, so it posts on the engine's thread) and the completion
thread's blocking wait and finish notice for a backend that can wait.
"""

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.kvtransfer.messages import Notice, ReserveHandle
from pdserve.kvtransfer.metadata import KVAgentMetadata, check_peer

RECENT_DONE = 4096  # delivered requests a prefill connector remembers, for late aborts


# A token's logprob as the finish notice carries it: (logprob, [(token id, logprob), ...] of its
# most likely alternatives, most likely first).
FirstLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class Finished:
    request_id: str
    first_token: int
    first_logprob: FirstLogprob | None = None  # where the request asked for logprobs


class _Base:
    def __init__(self, backend, meta: KVAgentMetadata):
        self.backend = backend
        self.meta = meta
        self.peers: dict[str, KVAgentMetadata] = {}

    def metadata(self) -> bytes:
        """What this end publishes for the handshake (msgpack)."""
        return self.meta.pack()

    def _check(self, data: bytes) -> KVAgentMetadata:
        peer = KVAgentMetadata.unpack(data)
        check_peer(self.meta, peer)
        return peer


@dataclass
class DecodePoll:
    """What a decode end's poll() found. `failed` is for whoever waits on the request; `settled`
    is for the block pool: a lease that ended without its KV (aborted, expired, refused) keeps its
    blocks until no write of the prefill end can land in them any more."""

    done: list[Finished] = field(default_factory=list)  # KV arrived: decode may start
    failed: list[str] = field(default_factory=list)  # the transfer failed (prefill abort, lease ran out)
    settled: list[str] = field(default_factory=list)  # blocks of ended leases that may be reused now


@dataclass
class _Lease:
    handle: ReserveHandle
    prefill_id: str | None
    closing: bool = False  # ended without its KV: waiting until the prefill end's writes have stopped


class DecodeConnector(_Base):
    """Blocks of a lease that ends without its KV are freed only once the prefill end has answered
    the abort (its answer follows any write it posted) or, where it stays silent, `settle_s` after
    the lease's deadline (by which a live prefill end stopped writing on its own). Freed earlier, a
    late write would land in blocks that another request owns by then."""

    def __init__(self, backend, meta: KVAgentMetadata, settle_s: float = 5.0):
        super().__init__(backend, meta)
        self.settle_s = settle_s
        self._leases: dict[str, _Lease] = {}

    def add_peer(self, data: bytes) -> str:
        """Handshake with a prefill worker; raises HandshakeError on any mismatch."""
        peer = self._check(data)
        self.backend.add_peer(peer)
        self.peers[peer.engine_id] = peer
        return peer.engine_id

    def reserve(self, request_id: str, block_ids: list[int], lease_s: float,
                prefill_id: str | None = None) -> ReserveHandle:
        """Open a lease on blocks the engine reserved; the handle goes to the prefill worker."""
        handle = ReserveHandle(request_id, self.meta.engine_id, list(block_ids), time.time() + lease_s)
        self._leases[request_id] = _Lease(handle, prefill_id)
        return handle

    def poll(self) -> DecodePoll:
        """Requests whose KV has fully arrived, ones that failed, and ones whose blocks may be reused."""
        out = DecodePoll()
        for payload in self.backend.notifications():
            n = Notice.unpack(payload)
            lease = self._leases.pop(n.request_id, None)
            if lease is None:
                continue  # a late notice of a lease settled already
            if lease.closing:  # "finish" too: every write landed, none can follow
                out.settled.append(n.request_id)
            elif n.kind == "finish":
                lp = n.first_logprob
                out.done.append(Finished(n.request_id, n.first_token,
                                         None if lp is None else (lp[0], [(i, v) for i, v in lp[1]])))
            else:  # the prefill end gave up, and its writes have stopped
                out.failed.append(n.request_id)
                out.settled.append(n.request_id)
        now = time.time()
        for rid, lease in list(self._leases.items()):
            if lease.closing and lease.handle.deadline + self.settle_s < now:
                del self._leases[rid]  # a silent or dead prefill end
                out.settled.append(rid)
            elif not lease.closing and lease.handle.deadline < now:
                self._close(rid, lease)
                out.failed.append(rid)
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

    def _close(self, rid: str, lease: _Lease) -> None:
        lease.closing = True
        if lease.prefill_id in self.peers:
            try:
                self.backend.notify(lease.prefill_id, Notice("abort", rid, sender=self.meta.engine_id).pack())
            except Exception:  # a dead peer cannot be told: the blocks wait out the lease
                pass

    def close(self) -> None:
        self.backend.close()


@dataclass
class _Transfer:
    handle: ReserveHandle
    tokens: list = field(default_factory=list)
    first_token: int | None = None
    notice: bytes = b""  # the "finish" notice, packed before the copies end: sent the moment they do
    nbytes: int = 0
    started: float = field(default_factory=time.monotonic)  # when the caller posted its first layer
    # open -> (finishing: every layer posted, a completion thread waits for the copies) -> done | failed
    state: str = "open"


class PrefillConnector(_Base):
    def __init__(self, backend, meta: KVAgentMetadata):
        super().__init__(backend, meta)
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, ok)
        self._has_results = threading.Event()
        self._delivered: queue.SimpleQueue = queue.SimpleQueue()  # (bytes, seconds) per request
        self._transfers: dict[str, _Transfer] = {}  # worker thread only
        self._aborted: set[str] = set()  # written by the worker thread: aborted before we heard of them
        # Requests delivered lately (under _lock): an abort the decode end sent before it read our
        # "finish" comes after the transfer is gone, and is no failure.
        self._recent_done: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()  # a transfer's state, where the completion thread also moves it
        self._closed = False
        # A backend that posts on the caller's thread (device-ordered, never blocking) skips the
        # hand-off to the worker thread; one that can block until a post is done gets a completion
        # thread, so delivery is noticed at once rather than at the next poll.
        self._inline = getattr(backend, "inline", False)
        self._waits: queue.SimpleQueue | None = queue.SimpleQueue() if hasattr(backend, "wait") else None
        self._posting: dict[str, _Transfer] = {}  # inline posting: requests not finished yet (caller's thread)
        self._unopened: set[str] = set()  # inline posts the worker has not heard of yet (under _lock)
        # Failed transfers whose writes may still land (a copy NIXL could not cancel, a queued device
        # copy): the decode end hears "abort" only once they cannot, as it then reuses the blocks.
        self._draining: dict[str, _Transfer] = {}  # worker thread only
        self._thread = threading.Thread(target=self._run, name=f"kv-post-{meta.engine_id}", daemon=True)
        self._thread.start()
        if self._waits is not None:
            self._waiter = threading.Thread(target=self._complete, name=f"kv-done-{meta.engine_id}", daemon=True)
            self._waiter.start()

    # -- called by the engine's thread ----------------------------------------------------------

    def add_peer(self, data: bytes) -> str:
        """Handshake with a decode worker; raises HandshakeError on any mismatch."""
        peer = self._check(data)
        self._call(lambda: self.backend.add_peer(peer))
        self.peers[peer.engine_id] = peer
        return peer.engine_id

    def send_layer(self, request_id: str, layer: int, src_blocks: list[int], handle: ReserveHandle,
                   first: int = 0) -> None:
        """Queue one layer's KV of the request's blocks [first, first + len(src_blocks)) for writing
        into the same positions of the handle's blocks; returns at once."""
        self.send_layers(request_id, layer, 1, src_blocks, handle, first)

    def send_layers(self, request_id: str, first_layer: int, num_layers: int, src_blocks: list[int],
                    handle: ReserveHandle, first: int = 0) -> None:
        """send_layer for the layers [first_layer, first_layer + num_layers) at once: KV that is
        complete already (a whole request, a cached prefix) moves as one post."""
        dst = handle.block_ids[first:first + len(src_blocks)]
        assert len(dst) == len(src_blocks), "more blocks than the decode side reserved"
        src = list(src_blocks)
        nbytes = 2 * len(src) * num_layers * self.meta.bytes_per_block
        if self._inline:
            self._post_inline(request_id, first_layer, num_layers, src, dst, handle, nbytes)
            return
        ready = None
        if self.meta.device.startswith("cuda"):
            # The layer's KV is written by kernels still in flight: post only once they finish.
            ready = torch.cuda.Event()
            ready.record()
        parts = [(layer, src, dst) for layer in range(first_layer, first_layer + num_layers)]
        self._ops.put(("layer", request_id, parts, handle, ready, nbytes, time.monotonic()))

    def _post_inline(self, rid: str, first_layer: int, num_layers: int, src: list[int], dst: list[int],
                     handle: ReserveHandle, nbytes: int) -> None:
        """Post on this thread; the worker hears of the request once (its first post), not per
        layer: a hand-off per layer would ping-pong the GIL between the two threads."""
        t = self._posting.get(rid)
        # Under the lock: once the worker marks the transfer failed, no copy of it is posted, so
        # the copies it waits for before answering an abort are all there are.
        with self._lock:
            if (t is not None and t.state == "failed") or (t is None and rid in self._aborted):
                return  # aborted meanwhile: the decode side may have reused its blocks already
            started = time.monotonic()  # the transfer's clock starts before its first post's host work
            try:
                token = self.backend.write_range(handle.engine_id, first_layer, num_layers, src, dst)
            except Exception:  # a bad handle or a peer gone fails this request, not the engine
                self._ops.put(("fail", rid, handle))
                return
            if t is None:
                t = self._posting[rid] = _Transfer(handle, [token], nbytes=nbytes, started=started)
                self._unopened.add(rid)
                self._ops.put(("opened", rid, t))
            else:
                t.tokens.append(token)  # the worker reads the list only after finish (or to drop it)
                t.nbytes += nbytes

    def finish(self, request_id: str, first_token: int, first_logprob: FirstLogprob | None = None) -> None:
        """Every layer is queued: once all have landed, tell the decode worker (with the first token,
        and its logprob where the request asked for logprobs)."""
        self._posting.pop(request_id, None)
        self._ops.put(("finish", request_id, first_token, first_logprob))

    def poll(self) -> tuple[list[str], list[str]]:
        """Requests whose KV was delivered (source blocks may be freed), and ones that failed."""
        done, failed = [], []
        self._has_results.clear()
        while True:
            try:
                rid, ok = self._results.get_nowait()
            except queue.Empty:
                return done, failed
            (done if ok else failed).append(rid)

    def delivered(self) -> list[tuple[int, float]]:
        """(KV bytes, seconds from first post to delivered) of each request delivered since the last call."""
        out = []
        while not self._delivered.empty():
            out.append(self._delivered.get_nowait())
        return out

    def wait(self, timeout: float) -> None:
        """Block (GIL released) until poll() has something or timeout seconds pass.

        A caller with nothing else to do waits here instead of spinning on poll(): a spinning
        thread holds the GIL, and the posting thread would get it only every switch interval (5 ms).
        """
        self._has_results.wait(timeout)

    def release(self, request_id: str, handle: ReserveHandle | None = None) -> None:
        """Abort a transfer from this side; the decode worker is told (pass the handle in case
        no layer was sent yet)."""
        self._posting.pop(request_id, None)
        self._ops.put(("release", request_id, handle))

    def close(self) -> None:
        self._closed = True
        if self._waits is not None:
            self._waits.put(None)
            self._waiter.join(timeout=5)
        self._thread.join(timeout=5)
        self.backend.close()

    def _call(self, fn: Callable):
        """Run fn on the worker thread and wait for it (backend calls stay on one thread)."""
        box: list = []
        ev = threading.Event()
        self._ops.put(("call", fn, box, ev))
        ev.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    # -- worker thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed:
            ops = []
            # Completion is polled only where no completion thread waits for it.
            polling = bool(self._draining) or (
                self._waits is None and any(t.state == "open" for t in self._transfers.values()))
            try:
                ops.append(self._ops.get(timeout=0.0005 if polling else 0.05))
                while True:
                    ops.append(self._ops.get_nowait())
            except queue.Empty:
                pass
            for op in self._batch_layers(ops):
                self._apply(op)
            self._progress()

    @staticmethod
    def _batch_layers(ops: list[tuple]) -> list[tuple]:
        """Fold consecutive queued layers of one request into one post (one backend request)."""
        out: list[tuple] = []
        for op in ops:
            prev = out[-1] if out else None
            if op[0] == "layer" and prev is not None and prev[0] == "layer" and prev[1] == op[1]:
                # Events complete in stream order: waiting for the newest covers the older ones.
                _, rid, parts, handle, ready, nbytes, _ = op
                out[-1] = ("layer", rid, prev[2] + parts, handle, ready or prev[4], prev[5] + nbytes, prev[6])
            else:
                out.append(op)
        return out

    def _apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "call":
            _, fn, box, ev = op
            try:
                box.append(fn())
            except BaseException as e:  # handed back to the caller
                box.append(e)
            ev.set()
        elif kind == "layer":
            _, rid, parts, handle, ready, nbytes, posted = op
            if rid in self._aborted:
                return
            t = self._transfers.get(rid)
            if t is None:  # the clock runs from the caller's first post, hand-off included
                t = self._transfers[rid] = _Transfer(handle, started=posted)
            if ready is not None:
                ready.synchronize()
            t.nbytes += nbytes
            try:
                if hasattr(self.backend, "write_layers"):
                    t.tokens.append(self.backend.write_layers(handle.engine_id, parts))
                else:
                    t.tokens += [self.backend.write(handle.engine_id, *p) for p in parts]
            except Exception:  # a bad handle or a broken peer fails this request, not the thread
                self._fail(rid)
        elif kind == "opened":  # inline posting: the request's first post
            _, rid, t = op
            with self._lock:
                self._unopened.discard(rid)
                self._transfers[rid] = t
            if rid in self._aborted:  # the decode end aborted it already: answer once its copies are done
                self._aborted.discard(rid)
                self._fail(rid, result=False)
        elif kind == "fail":
            _, rid, handle = op
            if rid not in self._transfers and rid not in self._aborted:  # nothing was posted
                self._notify(handle.engine_id, Notice("abort", rid, sender=self.meta.engine_id))
            self._fail(rid)
        elif kind == "finish":
            _, rid, first, logprob = op
            t = self._transfers.get(rid)
            if t is not None:
                t.first_token = first
                wire = None if logprob is None else [logprob[0], [[i, v] for i, v in logprob[1]]]
                t.notice = Notice("finish", rid, first, first_logprob=wire).pack()
                if self._waits is not None:
                    t.state = "finishing"
                    self._waits.put((rid, t))
            elif rid in self._aborted:  # aborted by the peer before we started: fail it again
                self._aborted.discard(rid)
                self._result(rid, False)
        elif kind == "settled":  # the completion thread is through with it
            _, rid, t = op
            if self._transfers.get(rid) is t:
                del self._transfers[rid]
                self._drop(t)
        elif kind == "release":
            _, rid, handle = op
            t = self._transfers.get(rid)
            self._aborted.discard(rid)
            if t is not None:
                with self._lock:
                    if t.state == "done":  # delivered already: nothing to abort
                        return
                    t.state = "failed"
                del self._transfers[rid]
                self._drop(t)
                self._tell_aborted(rid, t)
            elif handle is not None:  # nothing was posted
                self._notify(handle.engine_id, Notice("abort", rid, sender=self.meta.engine_id))

    def _progress(self) -> None:
        for payload in self.backend.notifications():
            n = Notice.unpack(payload)
            if n.kind == "abort":
                self._fail(n.request_id, answer=n.sender)
        now = time.time()
        for rid, t in list(self._draining.items()):
            if self._settled(t):
                del self._draining[rid]
                self._notify(t.handle.engine_id, Notice("abort", rid, sender=self.meta.engine_id))
        for rid, t in list(self._transfers.items()):
            if t.handle.deadline < now:
                self._fail(rid)
            elif t.state != "open" or self._waits is not None:
                continue  # the completion thread waits for it (once finished)
            else:
                states = [self.backend.state(tok) for tok in t.tokens]
                if "failed" in states:
                    self._fail(rid)
                elif t.first_token is not None and all(s == "done" for s in states):
                    del self._transfers[rid]
                    t.state = "done"
                    self._drop(t)
                    self._deliver(rid, t)

    def _complete(self) -> None:
        """Completion thread: wait for each finished request's copies, then tell the decode side."""
        while True:
            item = self._waits.get()
            if item is None:
                return
            rid, t = item
            try:
                ok = all([self.backend.wait(tok) for tok in t.tokens])
            except Exception:
                ok = False
            with self._lock:
                if t.state != "finishing":  # aborted or expired meanwhile
                    continue
                t.state = "done" if ok else "failed"
            if ok:
                self._deliver(rid, t)
            else:  # every copy was waited for: none can land later
                self._notify(t.handle.engine_id, Notice("abort", rid, sender=self.meta.engine_id))
                self._result(rid, False)
            self._ops.put(("settled", rid, t))

    def _deliver(self, rid: str, t: _Transfer) -> None:
        try:
            self.backend.notify(t.handle.engine_id, t.notice)
            self._delivered.put((t.nbytes, time.monotonic() - t.started))
            with self._lock:
                self._recent_done[rid] = None
                if len(self._recent_done) > RECENT_DONE:
                    self._recent_done.popitem(last=False)
            self._result(rid, True)
        except Exception:
            self._result(rid, False)

    def _fail(self, rid: str, answer: str | None = None, result: bool = True) -> None:
        """Stop a transfer and tell the decode end once none of its writes can land any more.
        `answer`: the decode end that aborted it, answered even where we never heard of the request."""
        t = self._transfers.get(rid)
        if t is None:
            with self._lock:
                late = rid in self._recent_done  # delivered: every write landed, the result was given
                if not late:
                    self._aborted.add(rid)  # the layers may still be queued: drop them when they come
                unopened = rid in self._unopened  # posted inline already: answered once "opened" comes
            if not late:
                self._result(rid, False)
            if answer and not unopened:  # the decode end holds its blocks until it hears back
                self._notify(answer, Notice("abort", rid, sender=self.meta.engine_id))
            return
        with self._lock:
            if t.state == "done":  # delivered already (a late abort): the completion thread settles it
                return
            t.state = "failed"
        del self._transfers[rid]
        self._drop(t)
        self._tell_aborted(rid, t)
        if result:
            self._result(rid, False)

    def _tell_aborted(self, rid: str, t: _Transfer) -> None:
        if self._settled(t):
            self._notify(t.handle.engine_id, Notice("abort", rid, sender=self.meta.engine_id))
        else:
            self._draining[rid] = t  # _progress tells it when they are

    def _settled(self, t: _Transfer) -> bool:
        """No write of this (released) transfer can still land in the peer's blocks."""
        settled = getattr(self.backend, "settled", None)
        return settled is None or all(settled(tok) for tok in t.tokens)

    def _result(self, rid: str, ok: bool) -> None:
        self._results.put((rid, ok))
        self._has_results.set()

    def _drop(self, t: _Transfer) -> None:
        for tok in t.tokens:
            self.backend.release(tok)

    def _notify(self, peer: str, notice: Notice) -> None:
        try:
            self.backend.notify(peer, notice.pack())
        except Exception:
            pass
