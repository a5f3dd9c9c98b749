"""A generation request's life over HTTP, from the core's deltas to the client: the first wake is
awaited before anything is sent (so a refused request still gets its 4xx/503), then the whole
answer as JSON, or a server-sent event stream written by one coroutine, a wake's events in one
body write, or by the core's `deliver` at once while the coroutine waits with nothing in hand
(_DirectSSE). One task per request watches for the client leaving (_Presence); however the
request ends, the core's stream is closed, which aborts it if unfinished, and the metrics timer
records how it ended.
"""

import asyncio
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Send

from pdserve.hop_trace import hop
from pdserve.protocol import InvalidRequestError
from pdserve.router.eager import run_now
from pdserve.router.http_errors import as_api_error
from pdserve.router.metrics import Metrics, RequestTimer
from pdserve.router.openai_responses import DONE_EVENT, ResponseShape, sse_event, token_usage
from pdserve.router.tenants import Charge
from pdserve.messages import Request, RequestDelta
from pdserve.router.types import NoCapacityError, ServingCore, ServingError

T = TypeVar("T")


class _ClientGone(Exception):
    """The client disconnected before the response was ready."""


class _Presence:
    """Whether a request's client is still there, watched once for the request's life: one task awaits
    `receive` for the disconnect (once the body is read, the server's receive() returns only when the
    client goes away). While the request's own task awaits work under `guard`, a disconnect cancels
    that work where it waits — the core's stream then aborts the request — and the guard raises
    _ClientGone. (Before, each wait ran its work in a task of its own beside a watcher task, under
    asyncio.wait: four tasks for a streaming request's two waits, on the loop that takes in the burst.)"""

    def __init__(self, receive: Receive):
        self.gone = False
        self._guarded: asyncio.Task | None = None  # the request's task, while it awaits guarded work
        self._watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._guarded is not None:
            self._guarded.cancel()

    async def guard(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work` in this task; raises _ClientGone, with `work` cancelled, when the client leaves first."""
        if self.gone:
            work.close()
            raise _ClientGone()
        task = self._guarded = asyncio.current_task()
        try:
            return await work
        except asyncio.CancelledError:
            if self.gone and task.uncancel() == 0:  # the watcher's cancel, and nobody else's
                raise _ClientGone() from None
            raise
        finally:
            self._guarded = None

    def close(self) -> None:
        """The response is over (or never comes): stop watching."""
        self._watcher.cancel()


class _Wakes:
    """A request's deltas a wake at a time: the next delta and those the core already holds after
    it (RequestDelta.more), what one write can carry. The metrics timer counts tokens by wake."""

    def __init__(self, deltas: AsyncIterator[RequestDelta], timer: RequestTimer):
        self.deltas, self.timer = deltas, timer
        self._error: Exception | None = None  # raised by the core behind deltas this wake still returns

    async def next(self) -> list[RequestDelta]:
        if self._error is not None:
            raise self._error
        wake: list[RequestDelta] = []
        while not wake or (wake[-1].more and wake[-1].finish_reason is None):
            try:
                wake.append(await anext(self.deltas))
            except StopAsyncIteration:
                self._error = ServingError("the request's output ended before it finished")
            except Exception as e:
                self._error = e
            if self._error is not None:
                if not wake:  # else the tokens before the failure are shown first; the next call raises
                    raise self._error
                break
        self.timer.tokens(sum(len(d.token_ids) for d in wake), wake[-1].finish_reason)
        return wake

    async def all(self) -> list[RequestDelta]:
        out = await self.next()
        while out[-1].finish_reason is None:
            out += await self.next()
        return out

    async def aclose(self) -> None:
        await self.deltas.aclose()


# Every stream's headers, as Response.init_headers builds them for its media type: built once (a
# tuple: nothing may change them in place).
_EVENT_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream; charset=utf-8"))


def _chunked_cycle(send: Send):
    """The uvicorn (httptools) response cycle whose bound `send` this is, once its chunked response
    has started — what `_DirectSSE.write` writes a chunk to directly; None for any other server (h11's
    cycle, a test's plain callable), which keeps the ASGI `send`."""
    cycle = getattr(send, "__self__", None)
    if (cycle is None or getattr(cycle, "chunked_encoding", None) is not True
            or not getattr(cycle, "response_started", False)
            or not all(hasattr(cycle, a) for a in ("transport", "flow", "disconnected", "response_complete"))
            or not hasattr(cycle.flow, "write_paused")):
        return None
    return cycle


class _DirectSSE:
    """The direct writer of one stream (types.DirectWriter): while the stream's coroutine waits for
    the core with nothing in hand, the core's `deliver` hands an ordinary delta here, and its event
    is sent right there — one transport write, no wake of the coroutine. `send` is set only while
    the coroutine waits; a send that the transport makes wait (the client reads slowly) finishes in
    a task (`pending`), and nothing is written directly until the coroutine has awaited it."""

    __slots__ = ("shape", "timer", "send", "cycle", "pending", "num_tokens")
    waited = 0  # direct writes, of every stream, that the transport made wait (they finished in a task)

    def __init__(self, shape: ResponseShape, timer: RequestTimer):
        self.shape, self.timer = shape, timer
        self.send: Send | None = None
        self.cycle = None  # uvicorn's response cycle behind `send`, when it can be written to at once
        self.pending: asyncio.Task | None = None
        self.num_tokens = 0  # tokens streamed, by either way (the usage chunk's count)

    def write(self, delta) -> bool:
        if self.send is None or self.pending is not None:
            return False
        n = len(delta.token_ids)
        self.num_tokens += n
        self.timer.tokens(n)
        if (event := self.shape.event(delta)) is not None:
            body = event.encode()
            c = self.cycle
            if c is not None and not c.flow.write_paused and not c.disconnected and not c.response_complete:
                # What uvicorn's `send` does for a chunk in the middle of a chunked response, without
                # the ASGI message, the coroutine and run_now around it (~a quarter of a streamed
                # token's router CPU, py-spy): one transport write of the chunk.
                c.transport.write(b"%x\r\n%b\r\n" % (len(body), body))
                return True
            self.pending = run_now(self.send({"type": "http.response.body", "body": body, "more_body": True}))
            if self.pending is not None:
                _DirectSSE.waited += 1
        return True


class SSEResponse(Response):
    """Server-sent events written by the subclass's one `_write` coroutine, under the client's
    presence: the response starts, `_write` runs until it ends or the client leaves (whose
    cleanup then aborts what is unfinished and counts it), and the presence watch stops."""

    media_type = "text/event-stream"

    def __init__(self, presence: _Presence, headers: dict[str, str] | None):
        self.status_code, self.background = 200, None
        self.raw_headers = _EVENT_STREAM_HEADERS
        if headers:  # a key's x-ratelimit-* headers
            self.raw_headers += tuple((k.encode(), v.encode()) for k, v in headers.items())
        self.presence = presence

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await self.presence.guard(self._write(send))
        except _ClientGone:
            pass  # _write's cleanup aborted the request and counted it
        finally:
            self.presence.close()

    async def _write(self, send: Send) -> None:
        raise NotImplementedError


class _EventStream(SSEResponse):
    """A started request's server-sent events, written by one coroutine that awaits the core's
    deltas and sends each wake's events in one body write (Starlette's StreamingResponse pays a
    write per event, and tasks and a thread hop per response). However it ends, the core's stream
    is closed, which aborts the request if it is unfinished: at once when the client leaves."""

    def __init__(self, wakes: _Wakes, first: list[RequestDelta], shape: ResponseShape, timer: RequestTimer,
                 prompt_tokens: int, presence: _Presence, direct: _DirectSSE, headers: dict[str, str] | None):
        super().__init__(presence, headers)
        self.wakes, self.first, self.shape, self.timer, self.prompt_tokens = wakes, first, shape, timer, prompt_tokens
        self.direct = direct

    async def _write(self, send: Send) -> None:
        shape, timer, direct = self.shape, self.timer, self.direct
        cycle = _chunked_cycle(send)
        events = [sse_event(chunk) for chunk in shape.opening_chunks()]
        wake = self.first
        try:
            while True:
                for delta in wake:
                    direct.num_tokens += len(delta.token_ids)
                    if (event := shape.event(delta)) is not None:
                        events.append(event)
                if wake[-1].finish_reason is not None:
                    break
                if events:
                    await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": True})
                    if wake is self.first:
                        hop("written")  # (the first events only: a trace must not cost every token)
                    events = []
                direct.send = send  # nothing in hand: the core may write the next deltas at once
                direct.cycle = cycle
                try:
                    wake = await self.wakes.next()
                finally:
                    direct.send = direct.cycle = None
                if direct.pending is not None:  # a direct write still under way goes out first
                    pending, direct.pending = direct.pending, None
                    await pending
            if shape.include_usage:
                events.append(sse_event(shape.usage_chunk(token_usage(self.prompt_tokens, direct.num_tokens))))
            events.append(DONE_EVENT)
            timer.finished(200)
        except (ServingError, NoCapacityError, InvalidRequestError) as e:
            # The 200 and its headers are already sent: report the failure in the stream, as vLLM does.
            error = as_api_error(e)
            events += [sse_event(error.body()), DONE_EVENT]
            timer.finished(error.status)
        finally:
            await self.wakes.aclose()
            if not timer.done:  # cancelled mid-stream: the client went away
                timer.aborted()
        await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": False})


async def serve(receive: Receive, core: ServingCore, metrics: Metrics, shape: ResponseShape,
                 req: Request, stream: bool, charge: Charge | None = None) -> Response:
    """charge: the request's charge under its API key, settled when the request ends (the timer's end)."""
    timer = metrics.request_started(shape.endpoint, len(req.prompt_ids), charge and charge.end,
                                    req.params.max_tokens)
    headers = charge.headers if charge else None
    direct = _DirectSSE(shape, timer) if stream else None
    wakes = _Wakes(core.generate(req, direct), timer)
    presence = _Presence(receive)
    try:
        # Streaming waits for the first delta too, so that a refused request still gets a proper 4xx/503.
        result = await presence.guard(wakes.next() if stream else wakes.all())
        hop("first_delta", req.request_id)
    except _ClientGone:
        presence.close()
        await wakes.aclose()
        timer.aborted()
        return Response(status_code=499)
    except BaseException:
        presence.close()
        await wakes.aclose()
        timer.refused()
        raise
    if not stream:
        presence.close()
        await wakes.aclose()
        timer.finished(200)
        num_tokens = sum(len(d.token_ids) for d in result)
        return JSONResponse(shape.response(result, token_usage(len(req.prompt_ids), num_tokens)), headers=headers)
    return _EventStream(wakes, result, shape, timer, len(req.prompt_ids), presence, direct, headers)
