"""The requests a worker streams to routers (decode and colocated workers): which router each
belongs to, and their new output, sent as one `Router.deliver` per router per step — never one
message per token."""

from collections import defaultdict

import ray

from pdserve.engine.outputs import RequestOutput
from pdserve.messages import RequestDelta


class RouterStreams:
    def __init__(self, namespace: str):
        self.namespace = namespace  # where the routers' named actors live
        self._owner: dict[str, str] = {}  # request id -> the router streaming it
        self._routers: dict[str, ray.actor.ActorHandle] = {}  # looked up once per router
        self._pending: dict[str, list[RequestDelta]] = defaultdict(list)  # this step's, per router

    def __len__(self) -> int:
        """Requests streaming from here."""
        return len(self._owner)

    def add(self, request_id: str, router: str) -> None:
        self._owner[request_id] = router

    def drop(self, request_id: str) -> bool:
        """Stop streaming a request (its client left); False if it was not streaming from here."""
        return self._owner.pop(request_id, None) is not None

    def fail(self, request_id: str, error: str) -> None:
        """The request failed here: its router hears why, and it streams no more."""
        router = self._owner.pop(request_id, None)
        if router is not None:
            self._pending[router].append(RequestDelta(request_id, "", [], "error", error))

    def output(self, out: RequestOutput) -> None:
        """One step's output of a request; it streams no more once finished."""
        router = self._owner.get(out.request_id)
        if router is None:  # aborted meanwhile
            return
        reason = out.finish_reason.value if out.finish_reason else None
        self._pending[router].append(RequestDelta(out.request_id, out.text, out.token_ids, reason,
                                                  logprobs=out.logprobs))
        if out.finished:
            del self._owner[out.request_id]

    def flush(self) -> None:
        """Send this step's deltas: one message per router."""
        for router, deltas in self._pending.items():
            self._router(router).deliver.remote(deltas)
        self._pending.clear()

    def _router(self, name: str) -> ray.actor.ActorHandle:
        h = self._routers.get(name)
        if h is None:
            h = self._routers[name] = ray.get_actor(name, namespace=self.namespace)
        return h
