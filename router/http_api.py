"""OpenAI-compatible HTTP front end over a ServingCore: the app and its routes (completions, chat completions,
models, health, metrics; the dashboard's are dashboard.py's, vLLM's tokenizer endpoints http_tokens.py's), and the generation endpoints' handlers, from a
validated body to a Request (its prompt tokenized or rendered by the chat template, max_tokens checked,
charged to its API key). Errors in OpenAI's shape are http_errors.py's, each request's life (streaming, client
disconnects) http_stream.py's. The request bodies are in openai_protocol.py, the response shapes in
openai_responses.py; the generation endpoints' requests are taken past FastAPI by the app's fast door
(http_fast.py) into the same handlers."""

import functools
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive, Scope

from pdserve.router import token_budget
from pdserve.router.dashboard import add_dashboard
from pdserve.router.http_auth import ApiKeyAuth, tenant_of
from pdserve.router.http_errors import GENERATION_ERRORS, ApiError, add_error_handlers, answer_error, document_errors
from pdserve.router.http_fast import FastDoor
from pdserve.router.http_body import DEFAULT_MAX_BODY_BYTES, BodyGuard
from pdserve.router.choices import DEFAULT_MAX_N, check_n, child_params
from pdserve.router.http_choices import Choice, serve_choices
from pdserve.router.http_stream import serve
from pdserve.router.http_tokens import add_token_routes
from pdserve.router.metrics import Metrics
from pdserve.router.openai_protocol import (CHAT, COMPLETIONS, GENERATION_ENDPOINTS, ChatCompletionRequest,
                                            CompletionRequest, ErrorBody, TokenizeRequest)
from pdserve.router.openai_responses import ChatShape, CompletionShape
from pdserve.router.tenants import Charge, Tenants
from pdserve.router.tool_calls import ToolCallShape, ToolChoice
from pdserve.router.tool_parsers import ToolParser, parser_for
from pdserve.messages import Request
from pdserve.router.types import ServingCore, off_loop


async def _tokenize(core: ServingCore, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    try:
        return await off_loop(core.tokenize, text, add_special_tokens=add_special_tokens)
    except UnicodeError as e:  # JSON may carry lone UTF-16 surrogates (\ud800); no UTF-8 tokenizer takes them
        raise ApiError(400, f"{param}: text is not valid Unicode ({e.reason})", param=param,
                       code="invalid_value") from e


async def _chat_prompt(core: ServingCore, body: ChatCompletionRequest | TokenizeRequest) -> str:
    """The chat rendered by the model's template, with the request's tools and template variables."""
    messages = [m.for_template() for m in body.messages]
    tools, template_kwargs = body.template_tools(), body.chat_template_kwargs
    opened = getattr(body, "add_generation_prompt", True)  # (/tokenize may render a chat without it)
    try:
        return await off_loop(core.apply_chat_template, messages, tools=tools, template_kwargs=template_kwargs,
                              add_generation_prompt=opened)
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


def _admit(tenants: Tenants | None, scope: Scope) -> Charge | None:
    """The request charged to its API key as it arrives, before its prompt is tokenized (RateLimited:
    429); None without keys. Its tokens are charged once counted (Charge.tokens)."""
    tenant = tenant_of(scope)
    return None if tenant is None else tenants.admit(tenant)


SESSION_HEADER = b"x-session-id"


def _session(body, scope: Scope) -> str | None:
    """A conversation's key for routing affinity: the `x-session-id` header, else OpenAI's `user`."""
    for name, value in scope.get("headers", ()):
        if name == SESSION_HEADER:
            return value.decode("latin-1")[:512]
    return body.user


def _priority(body, scope: Scope) -> int:
    """The request's own `priority`, no better than its API key's (Tenant.priority_of); 0 unset without keys."""
    tenant = tenant_of(scope)
    if tenant is None:
        return body.priority or 0
    return tenant.priority_of(body.priority)


def _cache_salt(body, scope: Scope) -> str | None:
    """The request's prefix-cache salt: its API key's with its own `cache_salt` (Tenant.cache_salt),
    or its own alone without keys."""
    tenant = tenant_of(scope)
    return body.cache_salt if tenant is None else tenant.cache_salt(body.cache_salt)


@contextmanager
def _until_served(charge: Charge | None) -> Iterator[None]:
    """A request refused before it is served (a field, its prompt, its tokens) gives its charge back
    (Charge.cancel); once served, its end settles it."""
    try:
        yield
    except BaseException:
        if charge is not None:
            charge.cancel()
        raise


async def complete(core: ServingCore, metrics: Metrics, tenants: Tenants | None, body: CompletionRequest,
                   scope: Scope, receive: Receive, max_n: int = DEFAULT_MAX_N) -> Response:
    """POST /v1/completions; `receive` is the request's, its body read (it then tells of a disconnect);
    `scope` its ASGI scope, which holds its API key's tenant (http_auth.py) where keys are configured.
    max_n: router.max_n, the most choices per prompt (n, best_of)."""
    _check_model(core, body.model)
    charge = _admit(tenants, scope)
    with _until_served(charge):
        n = body.n or 1
        best_of = body.best_of or n
        check_n(n, best_of, max_n)
        prompts = body.prompts()
        salt, priority = _cache_salt(body, scope), _priority(body, scope)
        # (Built and checked off the loop: a large schema's check takes a fraction of a second, which
        # on the loop would stall every stream of this router.)
        grammar = await off_loop(body.structured_grammar, core.grammar_tokenizer) if body.asks_structure() else None
        if len(prompts) == 1 and best_of == 1 and not body.echo:  # one choice: the everyday path
            prompt = prompts[0]
            prompt_ids = await _tokenize(core, prompt, "prompt") if isinstance(prompt, str) else prompt
            max_tokens = token_budget.max_tokens(body.max_tokens, "max_tokens", 16, len(prompt_ids),
                                                 core.max_model_len)
            params = body.sampling_params(max_tokens, body.logprobs, salt, grammar)
            if charge is not None:
                charge.tokens(len(prompt_ids), max_tokens, "prompt", "max_tokens")
            rid = f"cmpl-{uuid.uuid4().hex}"
            shape = CompletionShape(rid, core.model_name, body.logprobs is not None, body.include_usage,
                                    prompt_tokens=len(prompt_ids), continuous_usage=body.continuous_usage)
            request = Request(rid, prompt_ids, params, session=_session(body, scope), priority=priority)
        else:
            request = None
            rid = f"cmpl-{uuid.uuid4().hex}"
            choices, prompt_tokens, total_max = [], 0, 0
            for i, prompt in enumerate(prompts):
                prompt_ids = await _tokenize(core, prompt, "prompt") if isinstance(prompt, str) else prompt
                max_tokens = token_budget.max_tokens(body.max_tokens, "max_tokens", 16, len(prompt_ids),
                                                     core.max_model_len)
                params = body.sampling_params(max_tokens, body.logprobs, salt, grammar)
                echo = None
                if body.echo:
                    echo = prompt if isinstance(prompt, str) else await off_loop(core.detokenize, prompt_ids)
                prompt_tokens += len(prompt_ids)
                total_max += max_tokens * best_of
                for j in range(best_of):
                    shape = CompletionShape(rid, core.model_name, body.logprobs is not None, body.include_usage,
                                            i * n + j, prompt_tokens=len(prompt_ids),
                                            continuous_usage=body.continuous_usage)
                    child = Request(f"{rid}-{i}-{j}", prompt_ids, child_params(params, j, best_of > n),
                                    session=_session(body, scope), priority=priority)
                    choices.append(Choice(child, shape, i, echo))
            if charge is not None:
                charge.tokens(prompt_tokens, total_max, "prompt", "max_tokens")
    if request is not None:
        return await serve(receive, core, metrics, shape, request, bool(body.stream), charge)
    return await serve_choices(receive, core, metrics, choices, n, bool(body.stream), prompt_tokens, total_max, charge)


async def chat_complete(core: ServingCore, metrics: Metrics, tenants: Tenants | None, body: ChatCompletionRequest,
                        scope: Scope, receive: Receive, max_n: int = DEFAULT_MAX_N,
                        tool_parser: ToolParser | None = None) -> Response:
    """POST /v1/chat/completions, as `complete`; tool_parser: the model's tool-call format (router.tool_call_parser)."""
    _check_model(core, body.model)
    charge = _admit(tenants, scope)
    with _until_served(charge):
        n = body.n or 1
        check_n(n, n, max_n)
        tools = ToolChoice(body)
        forced, grammar = (await off_loop(lambda: (tools.grammar(core.grammar_tokenizer),  # (as complete's)
                                                   body.structured_grammar(core.grammar_tokenizer)))
                           if tools.mode in ("required", "named") or body.asks_structure() else (None, None))
        if forced is not None and grammar is not None:
            raise ApiError(400, "tool_choice: a forced tool call may not be combined with structured outputs "
                                "(response_format, structured_outputs)", param="tool_choice", code="invalid_value")
        grammar = forced or grammar
        tool_parser = tool_parser or parser_for("auto", getattr(core, "chat_template", None))
        text = await _chat_prompt(core, body)
        prompt_ids = await _tokenize(core, text, "messages", add_special_tokens=False)  # the template has its BOS
        requested, param = ((body.max_completion_tokens, "max_completion_tokens")
                            if body.max_completion_tokens is not None else (body.max_tokens, "max_tokens"))
        # No default cap, as OpenAI and vLLM: generate until a stop or the end of the context.
        max_tokens = token_budget.max_tokens(requested, param, None, len(prompt_ids), core.max_model_len)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = body.sampling_params(max_tokens, logprobs, _cache_salt(body, scope), grammar)
        if charge is not None:
            charge.tokens(len(prompt_ids), max_tokens * n, "messages", param)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        priority = _priority(body, scope)

    def shape(j: int) -> ChatShape:
        usage = dict(prompt_tokens=len(prompt_ids), continuous_usage=body.continuous_usage)
        if tools.mode == "none":
            return ChatShape(rid, core.model_name, logprobs is not None, body.include_usage, j, **usage)
        return ToolCallShape(rid, core.model_name, logprobs is not None, body.include_usage, tools, tool_parser, j,
                             **usage)
    if n > 1:
        choices = [Choice(Request(f"{rid}-0-{j}", prompt_ids, child_params(params, j, False),
                                  session=_session(body, scope), priority=priority), shape(j), 0)
                   for j in range(n)]
        return await serve_choices(receive, core, metrics, choices, n, bool(body.stream), len(prompt_ids),
                                   max_tokens * n, charge)
    return await serve(receive, core, metrics, shape(0),
                       Request(rid, prompt_ids, params, session=_session(body, scope), priority=priority),
                       bool(body.stream), charge)


# -- the app ------------------------------------------------------------------------------------


def build_app(core: ServingCore, metrics: Metrics | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tenants: Tenants | None = None,
              max_n: int = DEFAULT_MAX_N, openapi_docs: bool = False, tool_call_parser: str = "auto") -> FastDoor:
    """The OpenAI-compatible app serving `core`: the FastAPI app (`.app`) behind its fast door
    (http_fast.py), which takes the generation endpoints' everyday requests past FastAPI.
    tenants: the API keys every /v1 request must carry (http_auth.py) and their limits; None: open.
    openapi_docs: serve /docs, /redoc and /openapi.json (router.openapi_docs); tool_call_parser:
    router.tool_call_parser (auto: from the model's chat template)."""
    metrics = metrics or Metrics(model_name=core.model_name)
    parser = parser_for(tool_call_parser, getattr(core, "chat_template", None))
    routes = {COMPLETIONS: (CompletionRequest, functools.partial(complete, core, metrics, tenants, max_n=max_n)),
              CHAT: (ChatCompletionRequest, functools.partial(chat_complete, core, metrics, tenants, max_n=max_n,
                                                              tool_parser=parser))}
    app = _build_fastapi(core, metrics, max_body_bytes, tenants, max_n, openapi_docs, parser)
    # The door checks a key as the app's middleware does (the same check, the same answer).
    guard = ApiKeyAuth(None, tenants, _refusal_counter(metrics)).authorize if tenants is not None else None
    return FastDoor(app, routes, functools.partial(answer_error, metrics=metrics), max_body_bytes, guard)


def _refusal_counter(metrics: Metrics) -> Callable[[str, int], None]:
    """on_refused(path, status) of the app's middlewares: a generation endpoint's refusal is counted."""
    def on_refused(path: str, status: int) -> None:
        if path in GENERATION_ENDPOINTS:
            metrics.count_request(path, status)
    return on_refused


def _build_fastapi(core: ServingCore, metrics: Metrics, max_body_bytes: int, tenants: Tenants | None,
                   max_n: int, openapi_docs: bool, parser: ToolParser) -> FastAPI:
    # The API's map is off unless asked for: it lists every endpoint and field to whoever asks.
    docs = {} if openapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="pdserve", description="OpenAI-compatible API of a disaggregated prefill/decode service",
                  **docs)
    app.state.core, app.state.metrics = core, metrics
    created = int(time.time())  # /v1/models: when this server started serving the model
    add_error_handlers(app, metrics)
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes, on_refused=_refusal_counter(metrics))
    if tenants is not None:  # outermost (added last): a request without a valid key is refused first
        app.add_middleware(ApiKeyAuth, tenants=tenants, on_refused=_refusal_counter(metrics))
    document_errors(app)

    @app.post(COMPLETIONS, responses=GENERATION_ERRORS)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        return await complete(core, metrics, tenants, body, request.scope, request.receive, max_n)

    @app.post(CHAT, responses=GENERATION_ERRORS)
    async def chat_completions(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        return await chat_complete(core, metrics, tenants, body, request.scope, request.receive, max_n, parser)

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

    add_token_routes(app, core, _tokenize, _chat_prompt, _check_model)  # /tokenize, /detokenize, /version
    add_dashboard(app, core, metrics)  # /dashboard: the live picture of `pdserve status --watch`, as charts
    return app


def _model_card(core: ServingCore, created: int) -> dict:
    return {"id": core.model_name, "object": "model", "created": created, "owned_by": "pdserve",
            "root": core.model_name, "max_model_len": core.max_model_len}

