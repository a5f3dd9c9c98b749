"""The requests a worker streams to routers (decode and colocated workers): which router each
belongs to, and their new output, sent one message per router per step — never one per token —
over the router's direct channel (pdserve/channel/worker_end.py: ordered, one socket), or as
`Router.deliver` Ray calls to a router without one (`router.channel: ray`).

A router whose channel closed is gone: its requests are orphaned at once (the worker stops them and
frees their KV blocks). Over Ray, the rest of this docstring holds:

Each router has at most one message from a worker in flight; what the steps produce meanwhile goes
into the next one. Ray does not keep the order of an async actor's calls, so two messages in
flight could land swapped and put a request's tokens out of order; and a router that falls behind
gets fewer, larger messages instead of a growing queue. In a message a request has one delta, its
steps' output joined (text, token ids, logprobs): a router that keeps up gets one delta per step,
one that falls behind does no more work per message for the steps it missed."""

import logging
from collections import defaultdict
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError

from pdserve.engine.outputs import RequestOutput
from pdserve.messages import RequestDelta

log = logging.getLogger(__name__)
HELD_S = 0.001  # a worker's nap while a router still takes its previous message and more waits
MEET_S = 10.0  # a router introducing itself answers within this, or is met by its first request


class RouterStreams:
    def __init__(self, namespace: str, orphaned: Callable[[list[str]], None] = lambda ids: None):
        """orphaned(request ids): a router died; its requests have nobody to stream to, and the
        worker stops them (the engine frees their KV blocks)."""
        self.namespace = namespace  # where the routers' named actors live
        self._orphaned = orphaned
        self._dead: set[str] = set()  # routers found dead: their requests' output goes nowhere
        self._owner: dict[str, str] = {}  # request id -> the router streaming it
        self._routers: dict[str, ray.actor.ActorHandle] = {}  # looked up once per router
        self._pending: dict[str, list[RequestDelta]] = defaultdict(list)  # not sent yet, per router
        # Per router: the request id -> where in its pending list the request's delta is, while
        # later steps may still join it.
        self._open: dict[str, dict[str, int]] = defaultdict(dict)
        self._inflight: dict[str, tuple[ray.ObjectRef, list[str]]] = {}  # the message each router is taking, its requests
        self.channel = None  # the worker's ChannelServer, once it listens: routers connected there take deltas so

    def __len__(self) -> int:
        """Requests streaming from here."""
        return len(self._owner)

    def add(self, request_id: str, router: str) -> None:
        self._owner[request_id] = router

    def requests(self) -> list[str]:
        """The requests streaming from here."""
        return list(self._owner)

    def drop(self, request_id: str) -> bool:
        """Stop streaming a request (its client left); False if it was not streaming from here."""
        return self._owner.pop(request_id, None) is not None

    def fail(self, request_id: str, error: str, reason: str = "error") -> None:
        """The request failed here: its router hears why (reason LOST: it may move elsewhere), and
        it streams no more."""
        router = self._owner.pop(request_id, None)
        if router is not None and router not in self._dead:
            self._open[router].pop(request_id, None)  # its output so far goes first, on its own
            self._pending[router].append(RequestDelta(request_id, "", [], reason, error))

    def output(self, out: RequestOutput) -> None:
        """One step's output of a request; it streams no more once finished."""
        router = self._owner.get(out.request_id)
        if router is None or router in self._dead:  # aborted meanwhile; or its router died
            return
        reason = out.finish_reason.value if out.finish_reason else None
        pending, open_ = self._pending[router], self._open[router]
        i = open_.get(out.request_id)
        if i is None:
            open_[out.request_id] = len(pending)
            # Token ids copied: later steps extend them.
            pending.append(RequestDelta(out.request_id, out.text, list(out.token_ids), reason, out.error,
                                        out.logprobs or (), stop_reason=out.stop_reason))
        else:
            d = pending[i]
            d.token_ids.extend(out.token_ids)
            logprobs = [*d.logprobs, *out.logprobs] if out.logprobs else d.logprobs
            pending[i] = RequestDelta(out.request_id, d.text + out.text, d.token_ids, reason, out.error, logprobs,
                                      stop_reason=out.stop_reason)
        if out.finished:
            del self._owner[out.request_id]

    def flush(self) -> bool:
        """Send the pending deltas to each router that has taken its previous message; True while
        some are held back (the caller flushes again soon: `HELD_S`)."""
        for router in list(self._pending):
            if router in self._dead:  # (gone since its deltas were made)
                self._pending.pop(router, None)
                self._open.pop(router, None)
                continue
            sent = self._inflight.get(router)
            if sent is not None:  # a Ray message first: the next one, over either path, lands after it
                ready, _ = ray.wait([sent[0]], timeout=0, fetch_local=False)
                if not ready:
                    continue
                if self._died(router, *sent):
                    continue
                del self._inflight[router]
            deltas = self._pending[router]
            sent_now = self.channel.send_deltas(router, deltas) if self.channel is not None else None
            if sent_now is False:  # the router has not read the last ones yet: these wait, and grow
                continue
            del self._pending[router]
            self._open.pop(router, None)
            if sent_now is None:
                self._inflight[router] = (self._router(router).deliver.remote(deltas), [d.request_id for d in deltas])
        return bool(self._pending)

    def router_gone(self, router: str) -> None:
        """The router's channel closed: its requests here stop (any thread: the orphaned callback
        hands their aborts to the engine loop). A router that connects again streams again."""
        self._dead.add(router)
        self._orphaned([rid for rid, r in list(self._owner.items()) if r == router])

    def router_back(self, router: str) -> None:
        self._dead.discard(router)

    def _died(self, router: str, ref: ray.ObjectRef, request_ids: list[str]) -> bool:
        """Whether the router's last message found it dead; if so its requests are orphaned."""
        try:
            ray.get(ref, timeout=0)
            return False
        except RayActorError:
            pass
        except Exception as e:  # its deliver raised (a bug there, not a death): that message's
            # output is lost, so its requests cannot go on correctly: each ends with the error
            # rather than waiting for tokens that never come (and the router's abort stops it here).
            log.error("router %s failed to take a message: %r", router, e)
            for rid in dict.fromkeys(request_ids):
                if self._owner.get(rid) == router:
                    self._open[router].pop(rid, None)
                    self._pending[router].append(RequestDelta(
                        rid, "", [], "error", f"the router could not take this request's output ({type(e).__name__})"))
            return False
        self._dead.add(router)
        del self._inflight[router]
        self._pending.pop(router, None)
        self._open.pop(router, None)
        self._orphaned([rid for rid, r in self._owner.items() if r == router])
        return True

    def flush_nap(self, nap: float | None) -> float | None:
        """flush(), then the worker's nap: `nap`, but no longer than HELD_S while deltas wait for a
        router to take its previous message (None, no nap, stays None)."""
        held = self.flush()
        return min(nap, HELD_S) if held and nap is not None else nap

    def meet(self, router: str) -> None:
        """`router` introduced itself: its handle looked up and one empty `deliver` sent, now, on the
        caller's thread. Ray's name lookup and first connection to an actor are slow, and the first
        token of the router's first request here paid for them otherwise. Bounded: a router that does not take it is met by its first
        request's tokens instead."""
        try:
            ray.get(self._router(router).deliver.remote([]), timeout=MEET_S)
        except Exception as e:  # (not worth failing anything over: the first request looks it up again)
            log.warning("could not meet router %s: %s", router, e)
            self._routers.pop(router, None)

    def _router(self, name: str) -> ray.actor.ActorHandle:
        h = self._routers.get(name)
        if h is None:
            h = self._routers[name] = ray.get_actor(name, namespace=self.namespace)
        return h
