"""OpenAI-compatible HTTP front end over a ServingCore: the app and its routes (completions, chat completions,
models, health, metrics; the dashboard's are dashboard.py's), errors in OpenAI's shape, and each request's life
(streaming, client disconnects). The request bodies are in openai_protocol.py, the response shapes in
openai_responses.py; the generation endpoints' requests are admitted past FastAPI by the app's fast door
(http_fast.py) into the same handlers."""

import asyncio
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from pdserve.protocol import InvalidRequestError
from pdserve.router import limits
from pdserve.router.dashboard import add_dashboard
from pdserve.router.eager import run_now
from pdserve.router.http_auth import ApiKeyAuth, tenant_of
from pdserve.router.http_fast import FastDoor
from pdserve.router.http_limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from pdserve.router.metrics import Metrics, RequestTimer
from pdserve.router.openai_protocol import (CHAT, COMPLETIONS, GENERATION_ENDPOINTS, ChatCompletionRequest,
                                            CompletionRequest, ErrorBody)
from pdserve.router.openai_responses import (DONE_EVENT, ChatShape, CompletionShape, ResponseShape, sse_event,
                                             token_usage)
from pdserve.router.rate_limits import RateLimited
from pdserve.router.tenants import Admission, Tenants
from pdserve.router.types import (Delta, GenerateRequest, NoCapacityError, OverloadedError, ReplicaUnavailableError,
                                  ServingCore, ServingError, off_loop)

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- errors -------------------------------------------------------------------------------------


class ApiError(Exception):
    """A request the front end answers with an error: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")  # OpenAI's `type`

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _as_api_error(exc: Exception) -> ApiError:
    """The HTTP form of an error raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, RateLimited):  # OpenAI's 429: its type names the limit, "requests" or "tokens"
        return ApiError(429, str(exc), code="rate_limit_exceeded", headers=exc.headers, kind=exc.limit)
    if isinstance(exc, OverloadedError):  # nothing wrong with the request: the service is past its load
        retry = str(exc.retry_after)
        return ApiError(429, f"overloaded: {exc}; retry after {retry} s", code="overloaded",
                        headers={"Retry-After": retry}, kind="overloaded_error")
    if isinstance(exc, NoCapacityError):
        retry = str(max(1, math.ceil(exc.retry_after_s)))
        return ApiError(503, f"no capacity: {exc}; retry after {retry} s", code="no_capacity",
                        headers={"Retry-After": retry})
    if isinstance(exc, ReplicaUnavailableError):
        return ApiError(503, str(exc), code="replica_unavailable")
    if isinstance(exc, ServingError):
        return ApiError(503, f"the request failed inside the service: {exc}", code="service_error")
    return ApiError(500, "internal server error", code="internal_error")


def _validation_error(exc: RequestValidationError) -> ApiError:
    """A 400 naming the first offending field and saying what each offending field allows."""
    errors = exc.errors()
    if errors and errors[0]["type"] == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}")
    params = [_param(e["loc"]) for e in errors]
    if not any(params):
        return ApiError(400, "request body must be a JSON object")
    messages = [f"{p or 'body'}: {_describe(e)}" for p, e in zip(params, errors)]
    return ApiError(400, "; ".join(messages), param=next(p for p in params if p), code="invalid_value")


def _param(loc: tuple) -> str | None:
    """`("body", "messages", 0, "content")` -> "messages.0.content"."""
    parts = [str(p) for p in loc[1:]] if loc and loc[0] == "body" else [str(p) for p in loc]
    return ".".join(parts) or None


def _describe(error: dict) -> str:
    msg = error["msg"].removeprefix("Value error, ")
    value = error.get("input")
    if error["type"] != "missing" and isinstance(value, (str, int, float, bool)) and len(repr(value)) <= 40:
        msg += f" (got {value!r})"
    return msg


# -- the request's life -------------------------------------------------------------------------


class _ClientGone(Exception):
    """The client disconnected before the response was ready."""


class _Presence:
    """Whether a request's client is still there, watched once for the request's life: one task awaits
    `receive` for the disconnect (once the body is read, the server's receive() returns only when the
    client goes away). While the request's own task awaits work under `guard`, a disconnect cancels
    that work where it waits — the core's stream then aborts the request — and the guard raises
    _ClientGone. (Before, each wait ran its work in a task of its own beside a watcher task, under
    asyncio.wait: four tasks for a streaming request's two waits, on the loop that admits the burst.)"""

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
    it (Delta.more), what one write can carry. The metrics timer counts tokens by wake."""

    def __init__(self, deltas: AsyncIterator[Delta], timer: RequestTimer):
        self.deltas, self.timer = deltas, timer
        self._error: Exception | None = None  # raised by the core behind deltas this wake still returns

    async def next(self) -> list[Delta]:
        if self._error is not None:
            raise self._error
        wake: list[Delta] = []
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
        self.timer.tokens(sum(len(d.token_ids) for d in wake))
        return wake

    async def all(self) -> list[Delta]:
        out = await self.next()
        while out[-1].finish_reason is None:
            out += await self.next()
        return out

    async def aclose(self) -> None:
        await self.deltas.aclose()


# Every stream's headers, as Response.init_headers builds them for its media type: built once (a
# tuple: nothing may change them in place).
_EVENT_STREAM_HEADERS = ((b"cache-control", b"no-cache"), (b"content-type", b"text/event-stream; charset=utf-8"))


class _DirectSSE:
    """The direct writer of one stream (types.DirectWriter): while the stream's coroutine waits for
    the core with nothing in hand, the core's `deliver` hands an ordinary delta here, and its event
    is sent right there — one transport write, no wake of the coroutine. `send` is set only while
    the coroutine waits; a send that the transport makes wait (the client reads slowly) finishes in
    a task (`pending`), and nothing is written directly until the coroutine has awaited it."""

    __slots__ = ("shape", "timer", "send", "pending", "num_tokens")
    waited = 0  # direct writes, of every stream, that the transport made wait (they finished in a task)

    def __init__(self, shape: ResponseShape, timer: RequestTimer):
        self.shape, self.timer = shape, timer
        self.send: Send | None = None
        self.pending: asyncio.Task | None = None
        self.num_tokens = 0  # tokens streamed, by either way (the usage chunk's count)

    def write(self, delta) -> bool:
        if self.send is None or self.pending is not None:
            return False
        n = len(delta.token_ids)
        self.num_tokens += n
        self.timer.tokens(n)
        if (event := self.shape.event(delta)) is not None:
            self.pending = run_now(self.send({"type": "http.response.body", "body": event.encode(), "more_body": True}))
            if self.pending is not None:
                _DirectSSE.waited += 1
        return True


class _EventStream(Response):
    """A started request's server-sent events, written by one coroutine that awaits the core's
    deltas and sends each wake's events in one body write (Starlette's StreamingResponse pays a
    write per event, and tasks and a thread hop per response). However it ends, the core's stream
    is closed, which aborts the request if it is unfinished: at once when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, wakes: _Wakes, first: list[Delta], shape: ResponseShape, timer: RequestTimer,
                 prompt_tokens: int, presence: _Presence, direct: _DirectSSE, headers: dict[str, str] | None):
        self.status_code, self.background = 200, None
        self.raw_headers = _EVENT_STREAM_HEADERS
        if headers:  # a key's x-ratelimit-* headers
            self.raw_headers += tuple((k.encode(), v.encode()) for k, v in headers.items())
        self.wakes, self.first, self.shape, self.timer, self.prompt_tokens = wakes, first, shape, timer, prompt_tokens
        self.presence, self.direct = presence, direct

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await self.presence.guard(self._write(send))
        except _ClientGone:
            pass  # _write's cleanup aborted the request and counted it
        finally:
            self.presence.close()

    async def _write(self, send: Send) -> None:
        shape, timer, direct = self.shape, self.timer, self.direct
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
                    events = []
                direct.send = send  # nothing in hand: the core may write the next deltas at once
                try:
                    wake = await self.wakes.next()
                finally:
                    direct.send = None
                if direct.pending is not None:  # a direct write still under way goes out first
                    pending, direct.pending = direct.pending, None
                    await pending
            if shape.include_usage:
                events.append(sse_event(shape.usage_chunk(token_usage(self.prompt_tokens, direct.num_tokens))))
            events.append(DONE_EVENT)
            timer.finished(200)
        except (ServingError, NoCapacityError, InvalidRequestError) as e:
            # The 200 and its headers are already sent: report the failure in the stream, as vLLM does.
            error = _as_api_error(e)
            events += [sse_event(error.body()), DONE_EVENT]
            timer.finished(error.status)
        finally:
            await self.wakes.aclose()
            if not timer.done:  # cancelled mid-stream: the client went away
                timer.aborted()
        await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": False})


async def _serve(receive: Receive, core: ServingCore, metrics: Metrics, shape: ResponseShape,
                 req: GenerateRequest, stream: bool, admission: Admission | None = None) -> Response:
    """admission: the request's charge under its API key, settled when the request ends (the timer's end)."""
    timer = metrics.request_started(shape.endpoint, len(req.prompt_ids), admission and admission.end)
    headers = admission.headers if admission else None
    direct = _DirectSSE(shape, timer) if stream else None
    wakes = _Wakes(core.generate(req, direct), timer)
    presence = _Presence(receive)
    try:
        # Streaming waits for the first delta too, so that a refused request still gets a proper 4xx/503.
        result = await presence.guard(wakes.next() if stream else wakes.all())
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


async def _tokenize(core: ServingCore, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return await off_loop(core.tokenize, text, add_special_tokens=add_special_tokens)
    except UnicodeError as e:  # JSON may carry lone UTF-16 surrogates (\ud800); no UTF-8 tokenizer takes them
        raise ApiError(400, f"{param}: text is not valid Unicode ({e.reason})", param=param,
                       code="invalid_value") from e


async def _chat_prompt(core: ServingCore, body: ChatCompletionRequest) -> str:
    """The chat rendered by the model's template, with the request's tools and template variables."""
    messages = [m.for_template() for m in body.messages]
    tools, template_kwargs = body.template_tools(), body.chat_template_kwargs
    try:
        return await off_loop(core.apply_chat_template, messages, tools=tools, template_kwargs=template_kwargs)
    except ValueError as e:  # no chat template, a reserved variable, or the template rejects its input
        param = await off_loop(_template_culprit, core, messages, tools, template_kwargs)
        message = str(e) if str(e).startswith(f"{param}:") else f"{param}: {e}"  # the tokenizer may name it
        raise ApiError(400, message, param=param, code="invalid_value") from e


def _template_culprit(core: ServingCore, messages: list[dict], tools: list[dict] | None,
                      template_kwargs: dict | None) -> str:
    """Which field a chat template's error is about. A template says only what went wrong, so render again
    without the request's extras: the one whose removal makes it render is at fault, else the messages.
    Blocking, as each render is: called off the loop."""
    def renders(**kw) -> bool:
        try:
            core.apply_chat_template(messages, **kw)
            return True
        except ValueError:
            return False
    if template_kwargs and renders(tools=tools):
        return "chat_template_kwargs"
    if tools and renders():
        return "tools"
    return "messages"


# -- the generation endpoints: a validated body to its response (the app's routes and its fast door) --


def _check_model(core: ServingCore, model: str) -> None:
    if model != core.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {core.model_name!r}",
                       param="model", code="model_not_found")


def _admit(tenants: Tenants | None, scope: Scope, prompt_tokens: int, max_tokens: int, prompt_param: str,
           max_tokens_param: str) -> Admission | None:
    """The request charged to its API key's limits (RateLimited: 429); None without keys."""
    tenant = tenant_of(scope)
    if tenant is None:
        return None
    return tenants.admit(tenant, prompt_tokens, max_tokens, prompt_param, max_tokens_param)


SESSION_HEADER = b"x-session-id"


def _session(body, scope: Scope) -> str | None:
    """A conversation's key for routing affinity: the `x-session-id` header, else OpenAI's `user`."""
    for name, value in scope.get("headers", ()):
        if name == SESSION_HEADER:
            return value.decode("latin-1")[:512]
    return body.user


def _priority(body, scope: Scope) -> int:
    """The request's own `priority`, else its API key's default (0 without keys)."""
    if body.priority is not None:
        return body.priority
    tenant = tenant_of(scope)
    return tenant.priority if tenant is not None else 0


async def complete(core: ServingCore, metrics: Metrics, tenants: Tenants | None, body: CompletionRequest,
                   scope: Scope, receive: Receive) -> Response:
    """POST /v1/completions; `receive` is the request's, its body read (it then tells of a disconnect);
    `scope` its ASGI scope, which holds its API key's tenant (http_auth.py) where keys are configured."""
    _check_model(core, body.model)
    prompt_ids = await _tokenize(core, body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
    max_tokens = limits.max_tokens(body.max_tokens, "max_tokens", 16, len(prompt_ids), core.max_model_len)
    params = body.sampling_params(max_tokens, body.logprobs)
    admission = _admit(tenants, scope, len(prompt_ids), max_tokens, "prompt", "max_tokens")
    rid = f"cmpl-{uuid.uuid4().hex}"
    shape = CompletionShape(rid, core.model_name, body.logprobs is not None, body.include_usage)
    return await _serve(receive, core, metrics, shape,
                        GenerateRequest(rid, prompt_ids, params, session=_session(body, scope),
                                        priority=_priority(body, scope)),
                        bool(body.stream), admission)


async def chat_complete(core: ServingCore, metrics: Metrics, tenants: Tenants | None, body: ChatCompletionRequest,
                        scope: Scope, receive: Receive) -> Response:
    """POST /v1/chat/completions, as `complete`."""
    _check_model(core, body.model)
    text = await _chat_prompt(core, body)
    prompt_ids = await _tokenize(core, text, "messages", add_special_tokens=False)  # the template has its BOS
    requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                        if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
    # No default cap, as OpenAI and vLLM: generate until a stop or the end of the context.
    max_tokens = limits.max_tokens(requested, param, None, len(prompt_ids), core.max_model_len)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = body.sampling_params(max_tokens, logprobs)
    admission = _admit(tenants, scope, len(prompt_ids), max_tokens, "messages", param)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    shape = ChatShape(rid, core.model_name, logprobs is not None, body.include_usage)
    return await _serve(receive, core, metrics, shape,
                        GenerateRequest(rid, prompt_ids, params, session=_session(body, scope),
                                        priority=_priority(body, scope)),
                        bool(body.stream), admission)


# -- the app ------------------------------------------------------------------------------------


def build_app(core: ServingCore, metrics: Metrics | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tenants: Tenants | None = None) -> FastDoor:
    """The OpenAI-compatible app serving `core`: the FastAPI app (`.app`) behind its fast door
    (http_fast.py), which admits the generation endpoints' everyday requests past FastAPI.
    tenants: the API keys every /v1 request must carry (http_auth.py) and their limits; None: open."""
    metrics = metrics or Metrics()
    routes = {COMPLETIONS: (CompletionRequest, functools.partial(complete, core, metrics, tenants)),
              CHAT: (ChatCompletionRequest, functools.partial(chat_complete, core, metrics, tenants))}
    app = _build_fastapi(core, metrics, max_body_bytes, tenants)
    # The door checks a key as the app's middleware does (the same check, the same answer).
    guard = ApiKeyAuth(None, tenants, _refusal_counter(metrics)).admit if tenants is not None else None
    return FastDoor(app, routes, functools.partial(answer_error, metrics=metrics), max_body_bytes, guard)


def _refusal_counter(metrics: Metrics) -> Callable[[str, int], None]:
    """on_refused(path, status) of the app's middlewares: a generation endpoint's refusal is counted."""
    def on_refused(path: str, status: int) -> None:
        if path in GENERATION_ENDPOINTS:
            metrics.count_request(path, status)
    return on_refused


def _build_fastapi(core: ServingCore, metrics: Metrics, max_body_bytes: int, tenants: Tenants | None) -> FastAPI:
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a disaggregated prefill/decode service")
    app.state.core, app.state.metrics = core, metrics
    created = int(time.time())  # /v1/models: when this server started serving the model
    _add_error_handlers(app, metrics)
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, on_refused=_refusal_counter(metrics))
    if tenants is not None:  # outermost (added last): a request without a valid key is refused first
        app.add_middleware(ApiKeyAuth, tenants=tenants, on_refused=_refusal_counter(metrics))
    _document_errors(app)

    @app.post(COMPLETIONS, responses=_GENERATION_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await complete(core, metrics, tenants, body, request.scope, request.receive)

    @app.post(CHAT, responses=_GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await chat_complete(core, metrics, tenants, body, request.scope, request.receive)

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(core, created)]}

    @app.get("/v1/models/{model:path}", responses={404: {"model": ErrorBody, "description": "no such model"}})
    async def get_model(model: str) -> dict:
        _check_model(core, model)
        return _model_card(core, created)

    @app.get("/health")
    async def health() -> Response:
        # 200 while every role serves; "degraded" names the replicas down or draining meanwhile
        # (a replacement starting, a scale-down) so that a probe can tell, without failing it.
        down = core.degraded()
        if core.ready():
            return JSONResponse({"status": "degraded", "replicas": down} if down else {"status": "ok"})
        why = "; ".join(f"{n} {w}" for n, w in down.items()) or "some role has no live replica"
        error = ApiError(503, f"not ready: {why}", code="not_ready")
        return JSONResponse(error.body(), status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    add_dashboard(app, core, metrics)  # /dashboard: the live picture of `pdserve status --watch`, as charts
    return app


def _model_card(core: ServingCore, created: int) -> dict:
    return {"id": core.model_name, "object": "model", "created": created, "owned_by": "pdserve",
            "root": core.model_name, "max_model_len": core.max_model_len}


_GENERATION_ERRORS: dict = {
    400: {"model": ErrorBody, "description": "a field is missing or wrong; `param` names it"},
    401: {"model": ErrorBody, "description": "no API key, or one not accepted (where keys are configured)"},
    404: {"model": ErrorBody, "description": "the model is not served here"},
    413: {"model": ErrorBody, "description": "the body is over router.max_request_bytes"},
    415: {"model": ErrorBody, "description": "the body is not JSON"},
    429: {"model": ErrorBody, "description": "the API key is over a rate limit now (Retry-After, x-ratelimit-*), or "
                                             "overloaded: the first token would miss slo.ttft_ms, or the router's "
                                             "queue is full (Retry-After)"},
    503: {"model": ErrorBody, "description": "no replica can take the request now (Retry-After when full)"},
}


def _document_errors(app: FastAPI) -> None:
    """The OpenAPI schema says what the server answers: its 400s, not FastAPI's default 422."""
    default = app.openapi

    def openapi() -> dict:
        schema = default()  # built once and cached by FastAPI; stripping it again is a no-op
        for path in schema.get("paths", {}).values():
            for op in path.values():
                op.get("responses", {}).pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        return schema

    app.openapi = openapi


# The errors the app's handlers answer; any other is answered with a 500 and raised again for the server's log.
_EXPECTED_ERRORS = (ApiError, InvalidRequestError, NoCapacityError, OverloadedError, ServingError, RateLimited)


def _error_response(path: str, error: ApiError, metrics: Metrics) -> JSONResponse:
    """An error in OpenAI's shape; a generation endpoint's is counted by status."""
    if path in GENERATION_ENDPOINTS:
        metrics.count_request(path, error.status)
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def answer_error(path: str, exc: Exception, metrics: Metrics) -> tuple[JSONResponse, bool]:
    """The answer to an error raised while serving a request, and whether it was unexpected (a 500,
    logged here; the caller raises it again once answered, as Starlette's outermost middleware does)."""
    error = _as_api_error(exc)
    if error.status == 500:
        log.error("unexpected error serving %s", path, exc_info=exc)
    return _error_response(path, error, metrics), not isinstance(exc, _EXPECTED_ERRORS)


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error leaves in OpenAI's shape; generation endpoints count it by status."""

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(request.url.path, _validation_error(exc), metrics)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return _error_response(request.url.path, ApiError(exc.status_code, str(exc.detail), code=code,
                                                          headers=exc.headers), metrics)

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return answer_error(request.url.path, exc, metrics)[0]

    # Starlette hands a bare Exception handler to its outermost middleware, which re-raises after answering;
    # the expected errors get handlers of their own.
    for kind in (*_EXPECTED_ERRORS, Exception):
        app.add_exception_handler(kind, on_error)
