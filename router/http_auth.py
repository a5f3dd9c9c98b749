"""API keys on HTTP: every request under /v1 carries `Authorization: Bearer <key>` of a configured
key, or gets 401 in OpenAI's shape with `WWW-Authenticate: Bearer`, before its body is read. A
plain ASGI middleware of the FastAPI app, whose check the app's fast door (http_fast.py) makes
too, with the same answer: a request is checked on whichever way it comes in.

/health, /metrics and /dashboard stay open, as vLLM's --api-key leaves them: a load balancer's
probe and a Prometheus scrape carry no key, and none of them generates anything or shows a key
(per-key series are labelled by the key's name). Keep them off the public network if the names
or the load are not for everyone."""

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.tenants import Tenant, Tenants, Unauthenticated

TENANT = "pdserve.tenant"  # the scope's entry holding the request's Tenant, once authorized


def protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/")


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, tenants: Tenants, on_refused: Callable[[str, int], None]):
        """on_refused(path, status): counts a refusal (the generation endpoints' metrics)."""
        self.app, self.tenants, self.on_refused = app, tenants, on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and TENANT not in scope and not await self.authorize(scope, send):
            return
        await self.app(scope, receive, send)

    async def authorize(self, scope: Scope, send: Send) -> bool:
        """Puts the request's tenant in scope[TENANT], or answers 401 itself (False)."""
        if not protected(scope["path"]):
            return True
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            scope[TENANT] = self.tenants.authenticate(authorization)
            return True
        except Unauthenticated as e:
            self.on_refused(scope["path"], 401)
            body = json.dumps({"error": {"message": str(e), "type": "invalid_request_error", "param": None,
                                         "code": "invalid_api_key"}}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": body})
            return False


def tenant_of(scope: Scope) -> Tenant | None:
    """The request's tenant; None when the service has no keys."""
    return scope.get(TENANT)
