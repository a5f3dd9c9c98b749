"""How the prefill end's posts reach the backend, so that the engine's step never waits on the network.

PostThread: every backend call of the prefill end happens on it, except for the two below. It waits
for a layer's CUDA event and folds the queued layers of a request into one backend post.
InlinePoster: a backend that is `inline` (only enqueues device work: cuda_ipc) posts on the engine's
thread.
CompletionThread: for a backend that `waits` (can block until a post is done), it does, and sends
the finish notice at once rather than at the next poll.

Either thread dying (an exception from a backend call it makes outside a request's own guard, or a
bug) is loud and bounded: it is logged, every transfer the prefill end holds fails, so does every
op handed in later, and `error` says why (the worker's stats() raise on it: the router counts the
replica down). A silent death would leave every transfer hanging.
"""

import logging
import queue
import threading
import time
from collections import deque

from pdserve.kvtransfer.backend import KVBackend
from pdserve.kvtransfer.wire import ReserveHandle
from pdserve.kvtransfer.ops import Call, Died, Op, Opened, PostFailed, PostLayers, Settled
from pdserve.kvtransfer.transfers import Transfer, Transfers

log = logging.getLogger(__name__)


def fold(ops: list[Op]) -> list[Op]:
    """Fold consecutive queued layers of one request into one post (one backend request)."""
    out: list[Op] = []
    for op in ops:
        prev = out[-1] if out else None
        if isinstance(op, PostLayers) and isinstance(prev, PostLayers) and prev.request_id == op.request_id:
            out[-1] = prev.then(op)
        else:
            out.append(op)
    return out


class PostThread:
    def __init__(self, backend: KVBackend, transfers: Transfers, name: str):
        self.backend = backend
        self.transfers = transfers
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._todo: deque[Op] = deque()  # taken from the queue, not applied yet
        self._closed = False
        self.error: BaseException | None = None  # why the thread died
        self._thread = threading.Thread(target=self._guarded, name=name, daemon=True)
        self._thread.start()

    def put(self, op: Op) -> None:
        self._ops.put(op)
        # Dead: nobody takes it. Queued before looking, so that _die (which looks after setting
        # error) or we refuse it, whichever comes last.
        if self.error is not None:
            self._refuse_queued()

    def call(self, fn):
        """Run fn on this thread and wait for it."""
        op = Call(fn)
        self._ops.put(op)
        return op.wait()

    def stop(self) -> None:
        """Leave the loop at its next turn (join() waits for that)."""
        self._closed = True

    def join(self) -> None:
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._closed:
            ops = []
            # A short wait where completion is polled here, a long one where nothing is in flight.
            polling = self.transfers.polling()
            try:
                ops.append(self._ops.get(timeout=0.0005 if polling else 0.05))
                while True:
                    ops.append(self._ops.get_nowait())
            except queue.Empty:
                pass
            self._todo.extend(fold(ops))
            while self._todo:
                op = self._todo.popleft()
                match op:
                    case Call():
                        op.run()
                    case PostLayers():
                        self._post(op)
                    case Died():
                        raise RuntimeError("the KV completion thread died") from op.error
                    case _:
                        self.transfers.apply(op)
            self.transfers.progress()

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as e:
            self._die(e)

    def _die(self, error: BaseException) -> None:
        self.error = error
        log.error("KV posting thread %s died: every transfer fails from now on", self._thread.name,
                  exc_info=error)
        try:
            self.transfers.fail_all()
        finally:
            self._refuse(self._todo)
            self._refuse_queued()

    def _refuse_queued(self) -> None:
        while True:
            try:
                self._refuse([self._ops.get_nowait()])
            except queue.Empty:
                return

    def _refuse(self, ops) -> None:
        """Ops the dead thread will never apply: each request fails, each call raises."""
        for op in ops:
            match op:
                case Call():
                    op.error = RuntimeError(f"the KV posting thread died: {self.error!r}")
                    op.done.set()
                case Settled() | Died():
                    pass  # its result was given already / the thread is dead already
                case _:
                    self.transfers.outcomes.put(op.request_id, False)

    def _post(self, op: PostLayers) -> None:
        t = self.transfers.for_post(op)
        if t is None:
            return
        if op.ready is not None:
            op.ready.synchronize()
        t.nbytes += op.nbytes
        try:
            if op.handle.staging >= 0:  # the decode end gave the request a staging slot
                t.tokens += self.backend.write_staged(op.handle, op.parts)
            else:
                t.tokens += self.backend.write_layers(op.handle.engine_id, op.parts)
        except Exception:  # a bad handle or a broken peer fails this request, not the thread
            self.transfers.fail(op.request_id)


class InlinePoster:
    """Posts on the engine's thread; the posting thread hears of a request once (its first post), not
    per layer: a hand-off per layer would ping-pong the GIL between the two threads."""

    def __init__(self, backend: KVBackend, transfers: Transfers, post: PostThread):
        self.backend = backend
        self.transfers = transfers
        self.post_thread = post
        self._posting: dict[str, Transfer] = {}  # requests not finished yet

    def post(self, rid: str, first_layer: int, num_layers: int, src: list[int], dst: list[int],
             handle: ReserveHandle, nbytes: int) -> None:
        t = self._posting.get(rid)
        # Under the lock: once the posting thread marks the transfer failed, no copy of it is posted,
        # so the copies it waits for before answering an abort are all there are.
        with self.transfers.lock:
            if self.transfers.refuses(rid, t):
                return
            if handle.deadline < time.monotonic():  # past our lease: the decode end frees the blocks soon
                self.post_thread.put(PostFailed(rid, handle))
                return
            started = time.monotonic()  # the transfer's clock starts before its first post's host work
            try:
                token = self.backend.write_range(handle.engine_id, first_layer, num_layers, src, dst)
            except Exception:  # a bad handle or a peer gone fails this request, not the engine
                self.post_thread.put(PostFailed(rid, handle))
                return
            if t is None:
                t = self._posting[rid] = Transfer(handle, [token], nbytes=nbytes, started=started)
                self.transfers.opening(rid)
                self.post_thread.put(Opened(rid, t))
            else:
                t.tokens.append(token)  # the posting thread reads the list only after finish (or to drop it)
                t.nbytes += nbytes

    def forget(self, rid: str) -> None:
        """The request is finished or released: no more posts of it."""
        self._posting.pop(rid, None)


class CompletionThread:
    """Waits for each finished request's copies, then tells the decode side."""

    def __init__(self, backend: KVBackend, transfers: Transfers, post: PostThread, waits: queue.SimpleQueue, name: str):
        self.backend = backend
        self.transfers = transfers
        self.post_thread = post
        self._waits = waits  # (request_id, Transfer), put by Transfers on finish; None ends the thread
        self.error: BaseException | None = None  # why the thread died
        self._thread = threading.Thread(target=self._guarded, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._waits.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            item = self._waits.get()
            if item is None:
                return
            rid, t = item
            try:
                ok = all([self.backend.wait(tok) for tok in t.tokens])
            except Exception:
                ok = False
            if self.transfers.complete(rid, t, ok):
                self.post_thread.put(Settled(rid, t))

    def _guarded(self) -> None:
        try:
            self._run()
        except BaseException as e:  # the posting thread fails the transfers, ours included
            self.error = e
            log.error("KV completion thread %s died", self._thread.name, exc_info=e)
            self.post_thread.put(Died(e))
