"""OpenAI-compatible HTTP front end over a ServingCore: completions, chat completions, models, health, metrics."""

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Annotated, Any, Literal, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.protocol import TokenLogprob
from pdserve.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, InvalidRequestError, SamplingParams
from pdserve.router import limits
from pdserve.router.http_limits import DEFAULT_MAX_BODY_BYTES, RequestLimits
from pdserve.router.metrics import Metrics, RequestTimer
from pdserve.router.types import (Delta, GenerateRequest, NoCapacityError, ReplicaUnavailableError, ServingCore,
                          ServingError)

log = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
_GENERATION_ENDPOINTS = (COMPLETIONS, CHAT)
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value
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


# -- request bodies -----------------------------------------------------------------------------

# Python's JSON parser accepts NaN and Infinity; the sampler must never see them.
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _only(value: Any, allowed: tuple, what: str) -> Any:
    if value not in allowed:
        raise ValueError(f"is not supported; only {what} is accepted")
    return value


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool | None = False


class _SamplingRequest(BaseModel):
    """Fields both generation endpoints take. Unknown fields (e.g. `user`) are ignored, as OpenAI does;
    known-but-unsupported ones are accepted only at their no-op value, since silently ignoring, say, a
    penalty would return output the caller did not ask for."""

    model_config = ConfigDict(extra="ignore")

    model: Annotated[str, Field(min_length=1)]
    max_tokens: int | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None  # vLLM extension; 0 or -1 = off
    seed: Annotated[int, Field(ge=-2**63, le=2**64 - 1)] | None = None  # the range torch generators take
    stop: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    ignore_eos: bool | None = False  # vLLM extension
    frequency_penalty: FiniteFloat | None = 0.0
    presence_penalty: FiniteFloat | None = 0.0
    repetition_penalty: FiniteFloat | None = 1.0  # vLLM extension
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("stop")
    @classmethod
    def _stop_lengths(cls, v: Any) -> Any:
        if v and any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"each stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("stream_options")
    @classmethod
    def _needs_stream(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true")
        return v

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: Any) -> Any:
        return _only(v, (None, 1), "n=1")

    @field_validator("frequency_penalty", "presence_penalty")
    @classmethod
    def _no_penalty(cls, v: Any) -> Any:
        return _only(v, (None, 0), "0")

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, v: Any) -> Any:
        return _only(v, (None, 1), "1")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: Any) -> Any:
        return _only(v, (None, {}), "an empty map")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; SamplingParams checks the ranges (InvalidRequestError names the field)."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),  # vLLM clients send -1 for "off"
            seed=self.seed,
            stop=list(self.stop or []),
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    # A string, or token ids; a batch of one of either is taken too (`_one_prompt`).
    prompt: Annotated[str | list[int], Field(json_schema_extra={"anyOf": [  # what `_one_prompt` checks
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "integer", "minimum": 0},
                                             "minItems": 1}]})]
    logprobs: int | None = None  # completions style: how many alternatives per token (0..20)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one
        if isinstance(v, str) and v:
            return v
        if isinstance(v, list) and v and all(type(t) is int and t >= 0 for t in v):
            return v
        raise ValueError("must be a non-empty string, a list of one string, or a non-empty list of token ids")

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: Any) -> Any:
        return _only(v, (None, False), "false")

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, v: Any) -> Any:
        return _only(v, (None, 1), "1")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: Any) -> Any:
        return _only(v, (None, ""), "no suffix")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None  # null only for an assistant's turn (OpenAI sends it with tool calls)

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, v: Any) -> Any:
        if not isinstance(v, list):
            return v
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
            raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts; '
                             "only text is supported")
        return "\n".join(p["text"] for p in v)

    @field_validator("content")
    @classmethod
    def _text_unless_assistant(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("must be a string (only an assistant message may have null content)")
        return v

    def for_template(self) -> dict:
        """The message as chat templates read it: content always a string."""
        return {"role": self.role, "content": self.content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("requires logprobs: true")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: Any) -> Any:
        if v:
            raise ValueError("tool calling is not supported; send no tools")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        return _only(v, (None, "none", "auto"), '"none"')

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _only(v, (None, {"type": "text"}), '{"type": "text"}')


# -- response bodies ----------------------------------------------------------------------------


def _alternatives(t: TokenLogprob) -> list[tuple[str, float]]:
    """A token's most likely alternatives as (text, logprob). Tokens are named by their text, as vLLM
    does: the engine's detokenizer gives each its own (TokenLogprob.text, .top_texts)."""
    return [(text, value) for text, (_, value) in zip(t.top_texts, t.top)]


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class _Shape:
    """How one endpoint words its response, its stream chunks and its logprobs."""

    endpoint = ""
    object = ""
    chunk_object = ""

    def __init__(self, request_id: str, model: str, want_logprobs: bool, include_usage: bool):
        self.id, self.model = request_id, model
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, deltas: list[Delta], usage: dict) -> dict:
        return self._envelope(self.object, [self._choice(deltas)], usage=usage)

    def opening_chunks(self) -> list[dict]:
        return []

    def chunk(self, delta: Delta, text_offset: int) -> dict | None:
        """The stream chunk for one delta, or None when it has nothing to show."""
        if not delta.text and delta.finish_reason is None and not (self.want_logprobs and delta.logprobs):
            return None
        extra = {"usage": None} if self.include_usage else {}
        return self._envelope(self.chunk_object, [self._choice_delta(delta, text_offset)], **extra)

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage)

    def _choice(self, deltas: list[Delta]) -> dict:
        raise NotImplementedError

    def _choice_delta(self, delta: Delta, text_offset: int) -> dict:
        raise NotImplementedError


class _CompletionShape(_Shape):
    endpoint, object, chunk_object = COMPLETIONS, "text_completion", "text_completion"

    def __init__(self, request_id: str, model: str, want_logprobs: bool, include_usage: bool):
        super().__init__(request_id, model, want_logprobs, include_usage)
        # Streaming: where the next token's text starts. Offsets follow the tokens' own texts, not the
        # chunks' (text that may begin a stop string is held back from a chunk, never from its token).
        self._next_offset = 0

    def _choice(self, deltas: list[Delta]) -> dict:
        logprobs, offset = None, 0
        if self.want_logprobs:
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for d in deltas:
                part, offset = self._logprobs(d.logprobs, offset)
                for key, values in part.items():
                    logprobs[key] += values
        text = "".join(d.text for d in deltas)
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": deltas[-1].finish_reason}

    def _choice_delta(self, delta: Delta, text_offset: int) -> dict:
        logprobs = None
        if self.want_logprobs:
            logprobs, self._next_offset = self._logprobs(delta.logprobs, self._next_offset)
        return {"index": 0, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    @staticmethod
    def _logprobs(lps: list[TokenLogprob], text_offset: int) -> tuple[dict, int]:
        """The tokens' entries, each token's text_offset where its own text starts in the completion's
        text (from `text_offset` on); and where the next token's text starts."""
        offsets = []
        for t in lps:
            offsets.append(text_offset)
            text_offset += len(t.text)
        return {"tokens": [t.text for t in lps],
                "token_logprobs": [_lp(t.logprob) for t in lps],
                "top_logprobs": [{text: _lp(v) for text, v in _alternatives(t)} for t in lps],
                "text_offset": offsets}, text_offset


class _ChatShape(_Shape):
    endpoint, object, chunk_object = CHAT, "chat.completion", "chat.completion.chunk"

    def opening_chunks(self) -> list[dict]:
        # OpenAI sends the role alone first; clients key the assistant message on it.
        extra = {"usage": None} if self.include_usage else {}
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._envelope(self.chunk_object, [first], **extra)]

    def _choice(self, deltas: list[Delta]) -> dict:
        text = "".join(d.text for d in deltas)
        logprobs = self._logprobs([t for d in deltas for t in d.logprobs]) if self.want_logprobs else None
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": deltas[-1].finish_reason}

    def _choice_delta(self, delta: Delta, text_offset: int) -> dict:
        logprobs = self._logprobs(delta.logprobs) if self.want_logprobs else None
        return {"index": 0, "delta": {"content": delta.text} if delta.text else {}, "logprobs": logprobs,
                "finish_reason": delta.finish_reason}

    @staticmethod
    def _logprobs(lps: list[TokenLogprob]) -> dict:
        def entry(text: str, value: float) -> dict:  # the token's text and its UTF-8 bytes, as OpenAI
            return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}
        return {"content": [entry(t.text, t.logprob) | {"top_logprobs": [entry(*a) for a in _alternatives(t)]}
                            for t in lps]}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


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


async def _stream_events(deltas, first: Delta, shape: _Shape, timer: RequestTimer,
                         prompt_tokens: int) -> AsyncIterator[str]:
    """SSE events of a started request; however it ends, the core's stream is closed (aborting it if unfinished)."""
    try:
        for chunk in shape.opening_chunks():
            yield _sse(chunk)
        delta, offset, num_tokens = first, 0, 0
        while True:
            num_tokens += len(delta.token_ids)
            if (chunk := shape.chunk(delta, offset)) is not None:
                yield _sse(chunk)
            offset += len(delta.text)
            if delta.finish_reason is not None:
                break
            delta = await _next_delta(deltas, timer)
        if shape.include_usage:
            yield _sse(shape.usage_chunk(_usage(prompt_tokens, num_tokens)))
        yield _sse("[DONE]")
        timer.finished(200)
    except (ServingError, NoCapacityError, InvalidRequestError) as e:
        # The 200 and its headers are already sent: report the failure in the stream, as vLLM does.
        error = _as_api_error(e)
        yield _sse(error.body())
        yield _sse("[DONE]")
        timer.finished(error.status)
    finally:
        await deltas.aclose()
        if not timer.done:  # cancelled or closed mid-stream: the client went away
            timer.aborted()


async def _serve(request: Request, core: ServingCore, metrics: Metrics, shape: _Shape,
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
        return JSONResponse(shape.response(result, _usage(len(req.prompt_ids), num_tokens)))
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
        metrics.count_request(path, status) if path in _GENERATION_ENDPOINTS else None))
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
        shape = _CompletionShape(rid, core.model_name, body.logprobs is not None, body.include_usage)
        return await _serve(request, core, metrics, shape, GenerateRequest(rid, prompt_ids, params), bool(body.stream))

    @app.post(CHAT, responses=_GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        try:
            text = core.apply_chat_template([m.for_template() for m in body.messages])
        except ValueError as e:  # no chat template, or the template rejects these messages
            raise ApiError(400, str(e), param="messages", code="invalid_value") from e
        prompt_ids = _tokenize(core, text, "messages", add_special_tokens=False)  # the template has its BOS
        requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                            if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
        # No default cap, as OpenAI and vLLM: generate until a stop or the end of the context.
        max_tokens = limits.max_tokens(requested, param, None, len(prompt_ids), core.max_model_len)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        shape = _ChatShape(rid, core.model_name, logprobs is not None, body.include_usage)
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


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """Every error's body, in OpenAI's shape."""

    error: ErrorDetail


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
        if request.url.path in _GENERATION_ENDPOINTS:
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
