"""OpenAI-compatible HTTP front end over a ServingCore: the app and its routes (completions, chat completions,
models, health, metrics), errors in OpenAI's shape, and each request's life (streaming, client disconnects).
The request bodies are in openai_protocol.py, the response shapes in openai_responses.py."""

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.protocol import InvalidRequestError
from pdserve.router import limits
from pdserve.router.http_limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from pdserve.router.metrics import Metrics, RequestTimer
from pdserve.router.openai_protocol import (CHAT, COMPLETIONS, GENERATION_ENDPOINTS, ChatCompletionRequest,
                                            CompletionRequest, ErrorBody)
from pdserve.router.openai_responses import ChatShape, CompletionShape, ResponseShape, sse_event, token_usage
from pdserve.router.types import (Delta, GenerateRequest, NoCapacityError, ReplicaUnavailableError, ServingCore,
                                  ServingError)

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


async def _wait_for_disconnect(request: Request) -> None:
    # Once the body is read, the server's receive() returns only when the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (which aborts the request) and raise _ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
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


async def _next_delta(deltas: AsyncIterator[Delta], timer: RequestTimer) -> Delta:
    async for delta in deltas:
        timer.tokens(len(delta.token_ids))
        return delta
    raise ServingError("the request's output ended before it finished")


async def _collect(deltas: AsyncIterator[Delta], timer: RequestTimer) -> list[Delta]:
    out = [await _next_delta(deltas, timer)]
    while out[-1].finish_reason is None:
        out.append(await _next_delta(deltas, timer))
    return out


async def _stream_events(deltas, first: Delta, shape: ResponseShape, timer: RequestTimer,
                         prompt_tokens: int) -> AsyncIterator[str]:
    """SSE events of a started request; however it ends, the core's stream is closed (aborting it if unfinished)."""
    try:
        for chunk in shape.opening_chunks():
            yield sse_event(chunk)
        delta, offset, num_tokens = first, 0, 0
        while True:
            num_tokens += len(delta.token_ids)
            if (chunk := shape.chunk(delta, offset)) is not None:
                yield sse_event(chunk)
            offset += len(delta.text)
            if delta.finish_reason is not None:
                break
            delta = await _next_delta(deltas, timer)
        if shape.include_usage:
            yield sse_event(shape.usage_chunk(token_usage(prompt_tokens, num_tokens)))
        yield sse_event("[DONE]")
        timer.finished(200)
    except (ServingError, NoCapacityError, InvalidRequestError) as e:
        # The 200 and its headers are already sent: report the failure in the stream, as vLLM does.
        error = _as_api_error(e)
        yield sse_event(error.body())
        yield sse_event("[DONE]")
        timer.finished(error.status)
    finally:
        await deltas.aclose()
        if not timer.done:  # cancelled or closed mid-stream: the client went away
            timer.aborted()


async def _serve(request: Request, core: ServingCore, metrics: Metrics, shape: ResponseShape,
                 req: GenerateRequest, stream: bool) -> Response:
    timer = metrics.request_started(shape.endpoint, len(req.prompt_ids))
    deltas = core.generate(req)
    try:
        # Streaming waits for the first delta too, so that a refused request still gets a proper 4xx/503.
        work = _next_delta(deltas, timer) if stream else _collect(deltas, timer)
        result = await _unless_disconnected(request, work)
    except _ClientGone:
        await deltas.aclose()
        timer.aborted()
        return Response(status_code=499)
    except BaseException:
        await deltas.aclose()
        raise
    if not stream:
        await deltas.aclose()
        timer.finished(200)
        num_tokens = sum(len(d.token_ids) for d in result)
        return JSONResponse(shape.response(result, token_usage(len(req.prompt_ids), num_tokens)))
    events = _stream_events(deltas, result, shape, timer, len(req.prompt_ids))
    # Starlette cancels the response when the client disconnects; closing the generator afterwards runs its
    # cleanup (the abort) at once, even when the cancel caught it between two chunks.
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(events.aclose))


def _tokenize(core: ServingCore, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return core.tokenize(text, add_special_tokens=add_special_tokens)
    except UnicodeError as e:  # JSON may carry lone UTF-16 surrogates (\ud800); no UTF-8 tokenizer takes them
        raise ApiError(400, f"{param}: text is not valid Unicode ({e.reason})", param=param,
                       code="invalid_value") from e


def _chat_prompt(core: ServingCore, body: ChatCompletionRequest) -> str:
    """The chat rendered by the model's template, with the request's tools and template variables."""
    messages = [m.for_template() for m in body.messages]
    tools, template_kwargs = body.template_tools(), body.chat_template_kwargs
    try:
        return core.apply_chat_template(messages, tools=tools, template_kwargs=template_kwargs)
    except ValueError as e:  # no chat template, a reserved variable, or the template rejects its input
        param = _template_culprit(core, messages, tools, template_kwargs)
        message = str(e) if str(e).startswith(f"{param}:") else f"{param}: {e}"  # the tokenizer may name it
        raise ApiError(400, message, param=param, code="invalid_value") from e


def _template_culprit(core: ServingCore, messages: list[dict], tools: list[dict] | None,
                      template_kwargs: dict | None) -> str:
    """Which field a chat template's error is about. A template says only what went wrong, so render again
    without the request's extras: the one whose removal makes it render is at fault, else the messages."""
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
        prompt_ids = _tokenize(core, body.prompt, "prompt") if isinstance(body.prompt, str) else body.prompt
        max_tokens = limits.max_tokens(body.max_tokens, "max_tokens", 16, len(prompt_ids), core.max_model_len)
        params = body.sampling_params(max_tokens, body.logprobs)
        rid = f"cmpl-{uuid.uuid4().hex}"
        shape = CompletionShape(rid, core.model_name, body.logprobs is not None, body.include_usage)
        return await _serve(request, core, metrics, shape, GenerateRequest(rid, prompt_ids, params), bool(body.stream))

    @app.post(CHAT, responses=_GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        text = _chat_prompt(core, body)
        prompt_ids = _tokenize(core, text, "messages", add_special_tokens=False)  # the template has its BOS
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
        if core.ready():
            return JSONResponse({"status": "ok"})
        error = ApiError(503, "not ready: some role has no live replica", code="not_ready")
        return JSONResponse(error.body(), status_code=503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

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
