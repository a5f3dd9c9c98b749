"""API keys on HTTP: every request under /v1 (and to /tokenize, /detokenize) carries `Authorization: Bearer <key>` of a configured
key, or gets 401 in OpenAI's shape with `WWW-Authenticate: Bearer`, before its body is read. A
plain ASGI middleware of the FastAPI app, whose check the app's fast door (http_fast.py) makes
too, with the same answer: a request is checked on whichever way it comes in.

The operators' endpoints — /metrics, /dashboard and its data — name tenants, their volumes, the
replicas, their prefix-cache hits and pids: with keys configured they take an admin key (a key
with `admin: true`; a Prometheus scrape sends it as its bearer credential), 401 without a valid
key and 403 with another. /health stays open: a load balancer's probe carries no key, and it
shows only which replicas are down."""

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.openai_protocol import DETOKENIZE, TOKENIZE
from pdserve.router.tenants import Tenant, Tenants, Unauthenticated

TENANT = "pdserve.tenant"  # the scope's entry holding the request's Tenant, once authorized


def protected(path: str) -> bool:
    """Paths that take a key: the API, and vLLM's tokenizer endpoints beside it (they run prompts
    through the router's tokenizing threads, which every tenant shares)."""
    return path == "/v1" or path.startswith("/v1/") or path in (TOKENIZE, DETOKENIZE)


def for_admins(path: str) -> bool:
    return path == "/metrics" or path == "/dashboard" or path.startswith("/dashboard/")


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, tenants: Tenants, on_refused: Callable[[str, int], None]):
        """on_refused(path, status): counts a refusal (the generation endpoints' metrics)."""
        self.app, self.tenants, self.on_refused = app, tenants, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and TENANT not in scope and not await self.authorize(scope, send):
            return
        await self.app(scope, receive, send)

    async def authorize(self, scope: Scope, send: Send) -> bool:
        """Puts the request's tenant in scope[TENANT], or answers 401 (403: an operators' endpoint
        with a key that is not an admin's) itself (False)."""
        admins = for_admins(scope["path"])
        if not admins and not protected(scope["path"]):
            return True
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            tenant = self.tenants.authenticate(authorization)
        except Unauthenticated as e:
            self.on_refused(scope["path"], 401)
            await _refuse(send, 401, str(e), "invalid_api_key", [(b"www-authenticate", b"Bearer")])
            return False
        if admins and not tenant.admin:
            await _refuse(send, 403, f"{scope['path']} is for operators: API key {tenant.name!r} is not an admin "
                                     f"key (admin: true in router.api_keys_file)", "forbidden")
            return False
        scope[TENANT] = tenant
        return True


async def _refuse(send: Send, status: int, message: str, code: str, headers: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or ())]})
    await send({"type": "http.response.body", "body": body})


def tenant_of(scope: Scope) -> Tenant | None:
    """The request's tenant; None when the service has no keys."""
    return scope.get(TENANT)
