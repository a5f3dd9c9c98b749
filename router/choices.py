"""A request of several choices (`n`, `best_of`, a batch of prompts) as the front ends run it: one child
request to the core per choice, as vLLM runs parallel sampling. Each child is an independent sequence on
whatever replicas the router picks (colocated, or prefill then decode), so nothing below the front ends
knows of choices. Here: the limit on n, a child's parameters, and running the children's streams side
by side — all to the end, or interleaved as they come. However a request ends, every child's stream is
closed (`close_all`), which aborts those unfinished everywhere and frees their KV blocks."""

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from pdserve.messages import RequestDelta
from pdserve.protocol import InvalidRequestError, SamplingParams
from pdserve.router.types import ServingError

DEFAULT_MAX_N = 16  # router.max_n

Streams = list[AsyncIterator[RequestDelta]]


def check_n(n: int, best_of: int, max_n: int) -> None:
    for param, v in (("n", n), ("best_of", best_of)):
        if v > max_n:
            raise InvalidRequestError(param, f"must be at most {max_n} (router.max_n), got {v}")


def child_params(params: SamplingParams, j: int, ranked: bool = False) -> SamplingParams:
    """Choice j's parameters: seed + j for a seeded request (vLLM's rule); with `ranked` (best_of > n)
    the sampled tokens' logprobs come back (the ranking sums them; a response shows them only if asked)."""
    changes = {}
    if j and params.seed is not None:
        changes["seed"] = (params.seed + j) % 2**64
    if ranked and params.logprobs is None:
        changes["logprobs"] = 0
    return dataclasses.replace(params, **changes) if changes else params


def cumulative_logprob(deltas: list[RequestDelta]) -> float:
    return sum(t.logprob for d in deltas for t in d.logprobs)


async def each(streams: Streams, whole: bool,
               on_delta: Callable[[RequestDelta], None] = lambda d: None) -> list[list[RequestDelta]]:
    """Each stream's deltas to its end (whole), or its first; the first failure cancels the rest and is
    raised (a refused child's InvalidRequestError: the request's 400)."""
    async def take(s: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
        out: list[RequestDelta] = []
        async for d in s:
            out.append(d)
            on_delta(d)
            if d.finish_reason is not None or not whole:
                return out
        raise ServingError("the request's output ended before it finished")
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(take(s)) for s in streams]
    except BaseExceptionGroup as e:
        raise e.exceptions[0] from None
    return [t.result() for t in tasks]


async def close_all(streams: Streams) -> None:
    """Close every child's stream: an unfinished one is aborted everywhere."""
    for s in streams:
        await s.aclose()


class Interleaved:
    """The children's deltas as they come, a wake at a time: one pump task per child feeds a queue.
    `firsts`: each child's deltas taken already (they come first)."""

    def __init__(self, streams: Streams, firsts: list[list[RequestDelta]] | None = None):
        self.streams = streams
        self._queue: asyncio.Queue[tuple[int, RequestDelta | Exception]] = asyncio.Queue()
        self._left = len(streams)  # children not finished yet
        self._pumps = []
        for k, s in enumerate(streams):
            taken = firsts[k] if firsts else []
            for d in taken:
                self._queue.put_nowait((k, d))
            if not taken or taken[-1].finish_reason is None:
                self._pumps.append(asyncio.ensure_future(self._pump(k, s)))

    @property
    def finished(self) -> bool:
        return self._left == 0

    async def wake(self) -> list[tuple[int, RequestDelta]]:
        """(child, delta) pairs: at least one, and all that are queued; raises a child's failure."""
        out = [await self._queue.get()]
        while not self._queue.empty():
            out.append(self._queue.get_nowait())
        for _, item in out:
            if isinstance(item, Exception):
                raise item
        self._left -= sum(1 for _, d in out if d.finish_reason is not None)
        return out

    async def aclose(self) -> None:
        for p in self._pumps:
            p.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)
        await close_all(self.streams)

    async def _pump(self, k: int, stream: AsyncIterator[RequestDelta]) -> None:
        try:
            async for d in stream:
                self._queue.put_nowait((k, d))
                if d.finish_reason is not None:
                    return
            self._queue.put_nowait((k, ServingError("the request's output ended before it finished")))
        except Exception as e:
            self._queue.put_nowait((k, e))
