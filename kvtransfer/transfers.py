"""The prefill end's request bookkeeping, kept by the posting thread: each request's transfer, its
failure or delivery, and the abort answers the decode end waits for before it reuses blocks."""

import queue
import threading
import time
from collections import OrderedDict

from pdserve.kvtransfer.backend import KVBackend
from pdserve.kvtransfer.notice_seal import NoticeSeal
from pdserve.kvtransfer.wire import Notice, NoticeKind
from pdserve.kvtransfer.ops import Finish, Opened, PostFailed, PostLayers, Release, Settled, State, Transfer

RECENT_DONE = 4096  # delivered requests remembered, for late aborts


class Outcomes:
    """What the engine's thread collects: each request's result, and delivered() records."""

    def __init__(self):
        self._results: queue.SimpleQueue = queue.SimpleQueue()  # (request_id, ok)
        self._ready = threading.Event()
        self._delivered: queue.SimpleQueue = queue.SimpleQueue()  # (bytes, seconds) per request

    def put(self, rid: str, ok: bool) -> None:
        self._results.put((rid, ok))
        self._ready.set()

    def delivered(self, nbytes: int, seconds: float) -> None:
        self._delivered.put((nbytes, seconds))

    def take(self) -> tuple[list[str], list[str]]:
        """(delivered, failed) requests since the last call."""
        done, failed = [], []
        self._ready.clear()
        while True:
            try:
                rid, ok = self._results.get_nowait()
            except queue.Empty:
                return done, failed
            (done if ok else failed).append(rid)

    def take_delivered(self) -> list[tuple[int, float]]:
        out = []
        while not self._delivered.empty():
            out.append(self._delivered.get_nowait())
        return out

    def wait(self, timeout: float) -> None:
        self._ready.wait(timeout)


class Transfers:
    """Posting thread only, but for what `lock` guards: a transfer's state (the completion thread and
    inline posting read or move it) and the sets of requests that have no transfer (any more)."""

    def __init__(self, backend: KVBackend, engine_id: str, outcomes: Outcomes, waits: queue.SimpleQueue | None,
                 cluster_token: str | None = None):
        self.backend = backend
        self.engine_id = engine_id
        self.seal = NoticeSeal(cluster_token, engine_id)  # its `dropped`: notices refused unread
        self.outcomes = outcomes
        self.waits = waits  # the completion thread's queue, where there is one
        self.lock = threading.Lock()
        self._live: dict[str, Transfer] = {}
        # Failed transfers whose writes may still land (a copy NIXL could not cancel, a queued device
        # copy): the decode end hears "abort" only once they cannot, as it then reuses the blocks.
        self._draining: dict[str, Transfer] = {}
        # Aborted before we heard of them -> until when (monotonic) a handle of theirs could still
        # be posted to, after which their posts are refused by the lease anyway; oldest first.
        self._aborted: OrderedDict[str, float] = OrderedDict()
        self._unopened: set[str] = set()  # posted inline, the Opened op not applied yet
        # Requests delivered lately: an abort the decode end sent before it read our finish notice
        # comes after the transfer is gone, and is no failure.
        self._recent_done: OrderedDict[str, None] = OrderedDict()

    def polling(self) -> bool:
        """The posting thread must look again soon: draining transfers, or open ones where no
        completion thread waits for their copies."""
        return bool(self._draining) or (
            self.waits is None and any(t.state is State.OPEN for t in self._live.values()))

    def for_post(self, op: PostLayers) -> Transfer | None:
        """The transfer op's layers join; None where the request was aborted or its lease is over."""
        if op.request_id in self._aborted:
            return None
        if op.handle.deadline < time.monotonic():  # past our lease: the decode end frees the blocks soon
            self.apply(PostFailed(op.request_id, op.handle))
            return None
        t = self._live.get(op.request_id)
        if t is None:  # the clock runs from the caller's first post, hand-off included
            t = self._live[op.request_id] = Transfer(op.handle, started=op.posted)
        return t

    def refuses(self, rid: str, t: Transfer | None) -> bool:
        """Inline posting, under `lock`: the request was aborted, and the decode side may have reused
        its blocks already."""
        return (t is not None and t.state is State.FAILED) or (t is None and rid in self._aborted)

    def opening(self, rid: str) -> None:
        """Inline posting, under `lock`: the request's first post is out; an Opened op follows."""
        self._unopened.add(rid)

    def apply(self, op: Opened | PostFailed | Finish | Release | Settled) -> None:
        match op:
            case Opened(rid, t):
                with self.lock:
                    self._unopened.discard(rid)
                    self._live[rid] = t
                # The decode end aborted it already: answer once its copies are done.
                if self._aborted.pop(rid, None) is not None:
                    self.fail(rid, result=False)
            case PostFailed(rid, handle):
                if rid not in self._live and rid not in self._aborted:  # nothing was posted
                    self._abort(handle.engine_id, rid)
                self.fail(rid, until=handle.deadline)
            case Finish(rid, first_token, first_logprob):
                t = self._live.get(rid)
                if t is not None:
                    t.notice = self.seal.seal(Notice.finish(rid, first_token, first_logprob), t.handle.engine_id)
                    if self.waits is not None:
                        t.state = State.FINISHING
                        self.waits.put((rid, t))
                elif self._aborted.pop(rid, None) is not None:  # aborted by the peer before we started
                    self.outcomes.put(rid, False)  # fail it again
            case Settled(rid, t):
                if self._live.get(rid) is t:
                    del self._live[rid]
                    self._drop(t)
            case Release(rid, handle):
                t = self._live.get(rid)
                self._aborted.pop(rid, None)
                if t is not None:
                    self._stop(rid, t)
                elif handle is not None:  # nothing was posted
                    self._abort(handle.engine_id, rid)

    def progress(self) -> None:
        """Take the decode ends' aborts, forget those whose leases are over, answer drained ones, fail
        expired transfers and (where no completion thread waits) deliver complete ones."""
        now = time.monotonic()
        for payload in self.backend.notifications():
            n = self.seal.receive(payload)
            if n is None:
                continue
            t = self._live.get(n.request_id)
            if t is not None and t.handle.engine_id != n.sender:
                self.seal.drop("not_the_lease_holder", f"{n.kind} of {n.request_id} from {n.sender!r}, "
                                                      f"whose lease is {t.handle.engine_id!r}'s")
                continue
            if n.kind is NoticeKind.ABORT:
                self.fail(n.request_id, answer=n.sender, until=now + n.refuse_s)
        while self._aborted:  # an entry waits behind an older one at most that one's time
            rid, until = next(iter(self._aborted.items()))
            if until > now:
                break
            with self.lock:
                del self._aborted[rid]
        for rid, t in list(self._draining.items()):
            if self._settled(t):
                del self._draining[rid]
                self._abort(t.handle.engine_id, rid)
        for rid, t in list(self._live.items()):
            if t.handle.deadline < now:
                self.fail(rid)
            elif t.state is not State.OPEN or self.waits is not None:
                continue  # the completion thread waits for it (once finished)
            else:
                states = [self.backend.state(tok) for tok in t.tokens]
                if "failed" in states:
                    self.fail(rid)
                elif t.notice is not None and all(s == "done" for s in states):
                    del self._live[rid]
                    t.state = State.DONE
                    self._drop(t)
                    self._deliver(rid, t)

    def complete(self, rid: str, t: Transfer, ok: bool) -> bool:
        """Completion thread: every copy of a finished transfer was waited for (ok: all landed).
        False where it was aborted or expired meanwhile."""
        with self.lock:
            if t.state is not State.FINISHING:
                return False
            t.state = State.DONE if ok else State.FAILED
        if ok:
            self._deliver(rid, t)
        else:  # none can land later
            self._abort(t.handle.engine_id, rid)
            self.outcomes.put(rid, False)
        return True

    def fail(self, rid: str, answer: str | None = None, result: bool = True, until: float = 0.0) -> None:
        """Stop a transfer and tell the decode end once none of its writes can land any more.
        `answer`: the decode end that aborted it, answered even where we never heard of the request.
        `until`: for a request we hold no transfer of, when (monotonic) its lease can no longer be
        posted to: its posts are refused until then."""
        t = self._live.get(rid)
        if t is None:
            with self.lock:
                late = rid in self._recent_done  # delivered: every write landed, the result was given
                if not late:  # the layers may still be queued, or the handle still on its way: drop them
                    self._aborted[rid] = max(until, self._aborted.pop(rid, until))
                unopened = rid in self._unopened  # posted inline already: answered once Opened comes
            if not late:
                self.outcomes.put(rid, False)
            if answer and not unopened:  # the decode end holds its blocks until it hears back
                self._abort(answer, rid)
            return
        if self._stop(rid, t) and result:
            self.outcomes.put(rid, False)

    def fail_all(self) -> None:
        """The posting thread is dying: fail every request it holds, telling each decode end what
        fail() would (where it is safe). The backend may be what broke: a request whose step raises
        fails all the same, and its decode end waits out the lease."""
        with self.lock:
            held = [*self._live, *self._unopened]
        for rid in held:
            try:
                self.fail(rid)
            except Exception:
                self.outcomes.put(rid, False)

    def _stop(self, rid: str, t: Transfer) -> bool:
        """Fail a live transfer, unless delivered already (a late abort: the completion thread
        settles it)."""
        with self.lock:
            if t.state is State.DONE:
                return False
            t.state = State.FAILED
        del self._live[rid]
        self._drop(t)
        if self._settled(t):
            self._abort(t.handle.engine_id, rid)
        else:
            self._draining[rid] = t  # progress() tells it when they are
        return True

    def _deliver(self, rid: str, t: Transfer) -> None:
        try:
            self.backend.notify(t.handle.engine_id, t.notice)
            self.outcomes.delivered(t.nbytes, time.monotonic() - t.started)
            with self.lock:
                self._recent_done[rid] = None
                if len(self._recent_done) > RECENT_DONE:
                    self._recent_done.popitem(last=False)
            self.outcomes.put(rid, True)
        except Exception:
            self.outcomes.put(rid, False)

    def _settled(self, t: Transfer) -> bool:
        """No write of this (released) transfer can still land in the peer's blocks."""
        return all(self.backend.settled(tok) for tok in t.tokens)

    def _drop(self, t: Transfer) -> None:
        for tok in t.tokens:
            self.backend.release(tok)

    def _abort(self, peer: str, rid: str) -> None:
        """Tell a decode end to forget the request; a peer that cannot be told holds out its lease."""
        try:
            self.backend.notify(peer, self.seal.seal(Notice.abort(rid, self.engine_id), peer))
        except Exception:
            pass
