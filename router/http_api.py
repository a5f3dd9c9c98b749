"""OpenAI-compatible HTTP front end over a ServingCore: the app and its routes (completions, chat completions,
models, health, metrics; the dashboard's are dashboard.py's), errors in OpenAI's shape, and each request's life
(streaming, client disconnects). The request bodies are in openai_protocol.py, the response shapes in
openai_responses.py."""

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Send

from pdserve.protocol import InvalidRequestError
from pdserve.router import limits
from pdserve.router.dashboard import add_dashboard
from pdserve.router.http_limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from pdserve.router.metrics import Metrics, RequestTimer
from pdserve.router.openai_protocol import (CHAT, COMPLETIONS, GENERATION_ENDPOINTS, ChatCompletionRequest,
                                            CompletionRequest, ErrorBody)
from pdserve.router.openai_responses import (DONE_EVENT, ChatShape, CompletionShape, ResponseShape, sse_event,
                                             token_usage)
from pdserve.router.types import (Delta, GenerateRequest, NoCapacityError, ReplicaUnavailableError, ServingCore,
                                  ServingError, off_loop)

log = logging.getLogger(__name__)

T = TypeVar("T")


# -- errors -------------------------------------------------------------------------------------


class ApiError(Exception):
    """A request the front end answers with an error: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _as_api_error(exc: Exception) -> ApiError:
    """The HTTP form of an error raised while serving a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), param=exc.param, code="invalid_value")
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


async def _wait_for_disconnect(receive: Receive) -> None:
    # Once the body is read, the server's receive() returns only when the client goes away.
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (which aborts the request) and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    gone = False
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            gone = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let the core's generator run its cleanup
    if gone:
        raise _ClientGone()
    return task.result()


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


class _EventStream(Response):
    """A started request's server-sent events, written by one coroutine that awaits the core's
    deltas and sends each wake's events in one body write (Starlette's StreamingResponse pays a
    write per event, and tasks and a thread hop per response). However it ends, the core's stream
    is closed, which aborts the request if it is unfinished: at once when the client leaves."""

    media_type = "text/event-stream"

    def __init__(self, wakes: _Wakes, first: list[Delta], shape: ResponseShape, timer: RequestTimer,
                 prompt_tokens: int):
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})
        self.wakes, self.first, self.shape, self.timer, self.prompt_tokens = wakes, first, shape, timer, prompt_tokens

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            await _unless_disconnected(receive, self._write(send))
        except _ClientGone:
            pass  # _write's cleanup aborted the request and counted it

    async def _write(self, send: Send) -> None:
        shape, timer = self.shape, self.timer
        events = [sse_event(chunk) for chunk in shape.opening_chunks()]
        wake, num_tokens = self.first, 0
        try:
            while True:
                for delta in wake:
                    num_tokens += len(delta.token_ids)
                    if (event := shape.event(delta)) is not None:
                        events.append(event)
                if wake[-1].finish_reason is not None:
                    break
                if events:
                    await send({"type": "http.response.body", "body": "".join(events).encode(), "more_body": True})
                    events = []
                wake = await self.wakes.next()
            if shape.include_usage:
                events.append(sse_event(shape.usage_chunk(token_usage(self.prompt_tokens, num_tokens))))
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


async def _serve(request: Request, core: ServingCore, metrics: Metrics, shape: ResponseShape,
                 req: GenerateRequest, stream: bool) -> Response:
    timer = metrics.request_started(shape.endpoint, len(req.prompt_ids))
    wakes = _Wakes(core.generate(req), timer)
    try:
        # Streaming waits for the first delta too, so that a refused request still gets a proper 4xx/503.
        result = await _unless_disconnected(request.receive, wakes.next() if stream else wakes.all())
    except _ClientGone:
        await wakes.aclose()
        timer.aborted()
        return Response(status_code=499)
    except BaseException:
        await wakes.aclose()
        raise
    if not stream:
        await wakes.aclose()
        timer.finished(200)
        num_tokens = sum(len(d.token_ids) for d in result)
        return JSONResponse(shape.response(result, token_usage(len(req.prompt_ids), num_tokens)))
    return _EventStream(wakes, result, shape, timer, len(req.prompt_ids))


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


# -- the app ------------------------------------------------------------------------------------


def build_app(core: ServingCore, metrics: Metrics | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """The OpenAI-compatible FastAPI app serving `core`."""
    metrics = metrics or Metrics()
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a disaggregated prefill/decode service")
    app.state.core, app.state.metrics = core, metrics
    created = int(time.time())  # /v1/models: when this server started serving the model
    _add_error_handlers(app, metrics)
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, on_refused=lambda path, status: (
        metrics.count_request(path, status) if path in GENERATION_ENDPOINTS else None))
    _document_errors(app)

    def check_model(model: str) -> None:
        if model != core.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {core.model_name!r}",
                           param="model", code="model_not_found")

    @app.post(COMPLETIONS, responses=_GENERATION_ERRORS)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        prompt_ids = await _tokenize(core, body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
        max_tokens = limits.max_tokens(body.max_tokens, "max_tokens", 16, len(prompt_ids), core.max_model_len)
        params = body.sampling_params(max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        shape = CompletionShape(rid, core.model_name, body.logprobs is not None, body.include_usage)
        return await _serve(request, core, metrics, shape, GenerateRequest(rid, prompt_ids, params), bool(body.stream))

    @app.post(CHAT, responses=_GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        text = await _chat_prompt(core, body)
        prompt_ids = await _tokenize(core, text, "messages", add_special_tokens=False)  # the template has its BOS
        requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                            if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
        # No default cap, as OpenAI and vLLM: generate until a stop or the end of the context.
        max_tokens = limits.max_tokens(requested, param, None, len(prompt_ids), core.max_model_len)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        shape = ChatShape(rid, core.model_name, logprobs is not None, body.include_usage)
        return await _serve(request, core, metrics, shape, GenerateRequest(rid, prompt_ids, params), bool(body.stream))

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(core, created)]}

    @app.get("/v1/models/{model:path}", responses={404: {"model": ErrorBody, "description": "no such model"}})
    async def get_model(model: str) -> dict:
        check_model(model)
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
    404: {"model": ErrorBody, "description": "the model is not served here"},
    413: {"model": ErrorBody, "description": "the body is over router.max_request_bytes"},
    415: {"model": ErrorBody, "description": "the body is not JSON"},
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


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Every error leaves in OpenAI's shape; generation endpoints count it by status."""

    def respond(request: Request, error: ApiError) -> JSONResponse:
        if request.url.path in GENERATION_ENDPOINTS:
            metrics.count_request(request.url.path, error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return respond(request, _validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return respond(request, ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        error = _as_api_error(exc)
        if error.status == 500:
            log.error("unexpected error serving %s", request.url.path, exc_info=exc)
        return respond(request, error)

    # Starlette hands a bare Exception handler to its outermost middleware, which re-raises after answering;
    # the expected errors get handlers of their own.
    for kind in (ApiError, InvalidRequestError, NoCapacityError, ServingError, Exception):
        app.add_exception_handler(kind, on_error)
