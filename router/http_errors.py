"""The OpenAI HTTP front end's errors: ApiError (an HTTP status with OpenAI's error fields), each
serving error's HTTP form (a rate limit or an overload 429, no capacity 503 with Retry-After, a
request's own mistake 400 naming its field), the app's handlers that answer every error in that
shape and count a generation endpoint's by status, and the OpenAPI schema's note of which errors
the generation endpoints answer (its 400s, not FastAPI's default 422).
"""

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve.protocol import InvalidRequestError
from pdserve.router.metrics import Metrics
from pdserve.router.openai_protocol import GENERATION_ENDPOINTS, ErrorBody
from pdserve.router.rate_limits import RateLimited
from pdserve.router.types import NoCapacityError, OverloadedError, ReplicaUnavailableError, ServingError

log = logging.getLogger(__name__)


class ApiError(Exception):
    """A request the front end answers with an error: HTTP status plus OpenAI's error fields."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")  # OpenAI's `type`

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def as_api_error(exc: Exception) -> ApiError:
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


GENERATION_ERRORS: dict = {
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


def document_errors(app: FastAPI) -> None:
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
    error = as_api_error(exc)
    if error.status == 500:
        log.error("unexpected error serving %s", path, exc_info=exc)
    return _error_response(path, error, metrics), not isinstance(exc, _EXPECTED_ERRORS)


def add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
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
