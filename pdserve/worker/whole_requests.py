"""Whole requests on a worker whose tokens stream to routers: a colocated worker takes every request
so, and a decode worker takes one so when the router has its prompt prefilled there (local prefill)
rather than on a prefill replica. The worker's own engine computes the prompt, in steps it mixes
with the decoding sequences' (one scheduler, one token budget), and no KV moves."""

from pdserve.messages import NewRequest, Refusal
from pdserve.protocol import InvalidRequestError
from pdserve.worker.inbox import Generate
from pdserve.worker.router_streams import RouterStreams


class WholeRequests:
    streams: RouterStreams  # the worker's streams to routers

    def generate(self, requests: list[NewRequest], router: str) -> list[Refusal | None]:
        """Queue requests whose output streams to `router`; returns at once, without waiting for
        a step. The engine queues what its KV cache cannot take yet, so a worker is never full:
        only a request that is unacceptable in itself is refused (its entry)."""
        answers = []
        for r in requests:
            answers.append(self._refusal(r))
            if answers[-1] is None:
                self.loop.submit(Generate(r.request, router))
        return answers

    def _take_whole(self, item: Generate) -> None:
        self.streams.add(item.request_id, item.router)
        try:
            self.engine.add(item.request)
        except InvalidRequestError as e:  # what only the engine knows, e.g. an id in use
            self.streams.fail(item.request_id, str(e))
