"""A request of several choices over HTTP: `n` per prompt (and `best_of`), a batch of prompts, `echo`.

Each choice is a request of its own to the core, as vLLM runs parallel sampling: its id the parent's
with `-<prompt>-<j>`, a seeded request's choice j seeded with seed + j (vLLM's rule). They run side by
side on whatever replicas the router picks. The response joins their choices (index = prompt_i * n + j,
as OpenAI and vLLM number them); a stream interleaves their chunks, each carrying its index; usage sums
them (each prompt counted once). With best_of > n, best_of run per prompt and the n of the highest
cumulative logprob are returned. However the request ends (finished, refused, failed, the client
gone), every choice's stream is closed, which aborts those unfinished and frees their KV blocks.

A request of one choice never comes here: http_stream.serve is its path."""

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Send

from pdserve.messages import Request, RequestDelta
from pdserve.protocol import InvalidRequestError, SamplingParams
from pdserve.router.http_errors import as_api_error
from pdserve.router.http_stream import _ClientGone, _EVENT_STREAM_HEADERS, _Presence
from pdserve.router.metrics import Metrics, RequestTimer
from pdserve.router.openai_responses import DONE_EVENT, ResponseShape, sse_event, token_usage
from pdserve.router.tenants import Charge
from pdserve.router.types import NoCapacityError, ServingCore, ServingError

DEFAULT_MAX_N = 16  # router.max_n


@dataclass
class Choice:
    request: Request
    shape: ResponseShape  # words this choice, with its index
    prompt: int  # which of the request's prompts
    echo: str | None = None  # the prompt's text, shown before the choice's own (`echo`)


def check_n(n: int, best_of: int, max_n: int) -> None:
    for param, v in (("n", n), ("best_of", best_of)):
        if v > max_n:
            raise InvalidRequestError(param, f"must be at most {max_n} (router.max_n), got {v}")


def child_params(params: SamplingParams, j: int, ranked: bool) -> SamplingParams:
    """Choice j's parameters: seed + j for a seeded request; with `ranked` (best_of > n) the sampled
    tokens' logprobs come back (the ranking sums them; the response shows them only if asked)."""
    changes = {}
    if j and params.seed is not None:
        changes["seed"] = (params.seed + j) % 2**64
    if ranked and params.logprobs is None:
        changes["logprobs"] = 0
    return dataclasses.replace(params, **changes) if changes else params


async def serve_choices(receive: Receive, core: ServingCore, metrics: Metrics, choices: list[Choice], n: int,
                        stream: bool, prompt_tokens: int, max_tokens: int, charge: Charge | None) -> Response:
    """Run every choice; the response (or stream) of them all. prompt_tokens: every prompt's, once."""
    timer = metrics.request_started(choices[0].shape.endpoint, prompt_tokens, charge and charge.end, max_tokens)
    headers = charge.headers if charge else None
    streams = [core.generate(c.request) for c in choices]
    presence = _Presence(receive)
    try:
        # A stream too waits for every choice's first delta: a refused choice is the request's 4xx/503.
        got = await presence.guard(_each(streams, timer, whole=not stream))
    except _ClientGone:
        presence.close()
        await _close(streams)
        timer.aborted()
        return Response(status_code=499)
    except BaseException:
        presence.close()
        await _close(streams)
        timer.refused()
        raise
    if not stream:
        presence.close()
        await _close(streams)
        timer.finished(200)
        return JSONResponse(_response(choices, got, n, prompt_tokens), headers=headers)
    return _ChoiceStream(choices, streams, got, timer, prompt_tokens, presence, headers)


async def _each(streams: list[AsyncIterator[RequestDelta]], timer: RequestTimer, whole: bool) -> list[list[RequestDelta]]:
    """Each stream's deltas to its end (whole), or its first; one failure cancels the rest."""
    async def take(s: AsyncIterator[RequestDelta]) -> list[RequestDelta]:
        out: list[RequestDelta] = []
        async for d in s:
            out.append(d)
            timer.tokens(len(d.token_ids), d.finish_reason)
            if d.finish_reason is not None or not whole:
                return out
        raise ServingError("the request's output ended before it finished")
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(take(s)) for s in streams]
    except BaseExceptionGroup as e:  # the first failure is the request's (a 400 naming its field, a 503)
        raise e.exceptions[0] from None
    return [t.result() for t in tasks]


async def _close(streams: list[AsyncIterator[RequestDelta]]) -> None:
    """Close every choice's stream: an unfinished one is aborted everywhere."""
    for s in streams:
        await s.aclose()


def _cumulative_logprob(deltas: list[RequestDelta]) -> float:
    return sum(t.logprob for d in deltas for t in d.logprobs)


def _response(choices: list[Choice], got: list[list[RequestDelta]], n: int, prompt_tokens: int) -> dict:
    """The response of finished choices; where a prompt has more than n (best_of), its best n."""
    by_prompt: dict[int, list[int]] = {}
    for k, c in enumerate(choices):
        by_prompt.setdefault(c.prompt, []).append(k)
    out = []
    for i, ks in sorted(by_prompt.items()):
        if len(ks) > n:
            ks = sorted(ks, key=lambda k: _cumulative_logprob(got[k]), reverse=True)[:n]
        for j, k in enumerate(ks):
            shape = choices[k].shape
            shape.index = i * n + j  # (a best_of choice's place is its rank)
            deltas = got[k] if choices[k].echo is None else [RequestDelta("", choices[k].echo, []), *got[k]]
            out.append(shape.choice(deltas))
    usage = token_usage(prompt_tokens, sum(len(d.token_ids) for ds in got for d in ds))
    return choices[0].shape._envelope(choices[0].shape.object, out, usage=usage)


class _ChoiceStream(Response):
    """The choices' server-sent events, interleaved as their deltas come: one pump task per choice
    feeds a queue, one coroutine writes what the queue holds in one body write. Closed however it
    ends (the client gone: at once), which aborts the unfinished choices."""

    media_type = "text/event-stream"

    def __init__(self, choices: list[Choice], streams: list[AsyncIterator[RequestDelta]],
                 firsts: list[list[RequestDelta]], timer: RequestTimer, prompt_tokens: int, presence: _Presence,
                 headers: dict[str, str] | None):
        self.status_code, self.background = 200, None
        self.raw_headers = _EVENT_STREAM_HEADERS
        if headers:
            self.raw_headers += tuple((k.encode(), v.encode()) for k, v in headers.items())
        self.choices, self.streams, self.firsts, self.timer = choices, streams, firsts, timer
        self.prompt_tokens, self.presence = prompt_tokens, presence

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await self.presence.guard(self._write(send))
        except _ClientGone:
            pass  # _write's cleanup aborted the choices and counted it
        finally:
            self.presence.close()

    async def _write(self, send: Send) -> None:
        queue: asyncio.Queue[tuple[int, RequestDelta | Exception]] = asyncio.Queue()
        events = [sse_event(chunk) for c in self.choices for chunk in c.shape.opening_chunks()]
        events += [sse_event(c.shape.chunk(RequestDelta("", c.echo, []))) for c in self.choices if c.echo]
        num_tokens, open_ = 0, 0
        pumps = []
        for k, first in enumerate(self.firsts):
            queue.put_nowait((k, first[0]))
            if first[0].finish_reason is None:
                open_ += 1
                pumps.append(asyncio.ensure_future(self._pump(k, queue)))
        try:
            while True:
                k, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if item is not self.firsts[k][0]:
                    self.timer.tokens(len(item.token_ids), item.finish_reason)
                num_tokens += len(item.token_ids)
                if (event := self.choices[k].shape.event(item)) is not None:
                    events.append(event)
                if item.finish_reason is not None and item is not self.firsts[k][0]:
                    open_ -= 1
                if open_ == 0 and queue.empty():
                    break
                if queue.empty() and events:
                    await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": True})
                    events = []
            if self.choices[0].shape.include_usage:
                usage = token_usage(self.prompt_tokens, num_tokens)
                events.append(sse_event(self.choices[0].shape.usage_chunk(usage)))
            events.append(DONE_EVENT)
            self.timer.finished(200)
        except (ServingError, NoCapacityError, InvalidRequestError) as e:
            error = as_api_error(e)  # the 200 is sent: the failure goes in the stream, as vLLM does
            events += [sse_event(error.body()), DONE_EVENT]
            self.timer.finished(error.status)
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            await _close(self.streams)
            if not self.timer.done:  # cancelled mid-stream: the client went away
                self.timer.aborted()
        await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": False})

    async def _pump(self, k: int, queue: asyncio.Queue) -> None:
        try:
            async for d in self.streams[k]:
                queue.put_nowait((k, d))
                if d.finish_reason is not None:
                    return
            queue.put_nowait((k, ServingError("the request's output ended before it finished")))
        except Exception as e:
            queue.put_nowait((k, e))
