"""Requests to a worker, handed over in batches: every call made in one turn of the router's event
loop goes out as one message — one frame on the worker's direct channel, or one Ray call — (a burst
of N requests is one message, not N), and the worker answers each entry in order. Nothing waits for
an earlier batch: under a light load a batch is one request."""

import asyncio
from collections.abc import Callable


class HandOff:
    def __init__(self, send: Callable[[list], object], answered: bool = True):
        """send(items) -> an awaitable (a channel call's future, a Ray ObjectRef) of one answer per item
        (answered), or of nothing (aborts)."""
        self._send = send
        self._answered = answered
        self._pending: list = []
        self._futures: list[asyncio.Future] = []

    def __call__(self, item) -> asyncio.Future | None:
        """Queue `item` for this turn's batch; its answer's future (None when unanswered)."""
        loop = asyncio.get_running_loop()
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append(item)
        if not self._answered:
            return None
        self._futures.append(loop.create_future())
        return self._futures[-1]

    def _flush(self) -> None:
        items, futures = self._pending, self._futures
        self._pending, self._futures = [], []
        ref = self._send(items)
        if self._answered:
            asyncio.ensure_future(_answer(ref, futures))


async def _answer(ref, futures: list[asyncio.Future]) -> None:
    try:
        answers = await ref
        if len(answers) != len(futures):
            raise RuntimeError(f"a worker answered {len(answers)} of {len(futures)} requests")
    except Exception as e:  # the worker died, or the call failed: every request of the batch hears it
        for f in futures:
            if not f.done():
                f.set_exception(e)
        return
    for f, answer in zip(futures, answers):
        if not f.done():  # (a request whose client left meanwhile)
            f.set_result(answer)
