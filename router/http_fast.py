"""The HTTP app's fast door: a plain ASGI callable in front of the FastAPI app that takes the
generation endpoints' requests itself when their body is a JSON object its model validates, and
hands everything else to the app unchanged. With API keys configured, a request's key is checked
at the door (before its body is read) by the app's own check (http_auth.py), so a request the door
takes meets it as one the app takes.

On the router's one event loop, FastAPI's way in — its middleware stack, routing, dependency
solving — cost a request about as much as all the rest of its admission and its first event, and
a burst of hundreds, which arrives when a batch ends in one engine step, queued behind it (issue
18). The body's validation itself is cheap (pydantic-core) and stays: the door validates with the
endpoint's own model, so a request it takes is the very model the app would build. Past the door
a request meets the app's code: the endpoint's handler (http_api.complete, chat_complete), its
response, and for a failure the answer the app's error handlers give. What the door does not take
— another method or path, a body of unknown length, over the limit or not JSON, a body its JSON
parser or its model refuses — the app gets with the body already read replayed, and answers as
ever: every 4xx of a bad body is the app's."""

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from pydantic_core import from_json
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.hop_trace import hop

# Content types taken at the door; others (and none) go to the app, which says what it accepts.
_JSON = (b"application/json", b"application/json; charset=utf-8")

Handle = Callable[[Any, Scope, Receive], Awaitable[Response]]  # (request model, scope, receive) -> the response
OnError = Callable[[str, Exception], tuple[Response, bool]]  # (path, error) -> the app's answer, raise after it?
Guard = Callable[[Scope, Send], Awaitable[bool]]  # may the request pass? If not, the guard has answered it


class FastDoor:
    def __init__(self, app: ASGIApp, routes: dict[str, tuple[type[BaseModel], Handle]], on_error: OnError,
                 max_body_bytes: int, guard: Guard | None = None):
        self.app = app
        self.routes = routes
        self.on_error = on_error
        self.max_body_bytes = max_body_bytes
        self.guard = guard  # the app's API-key check (http_auth.ApiKeyAuth.authorize), or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None or not self._json_within_limit(scope["headers"]):
            return await self.app(scope, receive, send)
        hop("door")
        if self.guard is not None and not await self.guard(scope, send):
            return
        read: list[Message] = []  # what was received of the body, replayed to the app if it gets the request
        size, more = 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # (as the app's BodyGuard: nobody to answer)
            read.append(message)
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_body_bytes:  # past its Content-Length: the app refuses it
                return await self.app(scope, _replay(read, receive), send)
        model, handle = route
        body = read[0].get("body", b"") if len(read) == 1 else b"".join(m.get("body", b"") for m in read)
        try:
            # Validated as the app validates (its model, on the Python objects of the body), parsed
            # by pydantic-core's JSON parser: three times json.loads' speed on a prompt of token ids,
            # and it takes no text json.loads refuses, nor reads any differently
            # (tests/test_fast_door.py); what it refuses, the app's json.loads gets.
            request = model.model_validate(from_json(body))
            hop("validated")
        except Exception:  # not JSON or not valid: the app tries again, and its 400 says why
            return await self.app(scope, _replay(read, receive), send)
        try:
            response = await handle(request, scope, receive)
        except Exception as e:
            response, unexpected = self.on_error(scope["path"], e)
            await response(scope, receive, send)
            if unexpected:  # as the app's outermost middleware: answered, then raised for the server's log
                raise
            return
        await response(scope, receive, send)

    def _json_within_limit(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """One JSON Content-Type and one Content-Length within the limit. (Twice the same header the
        app's parts read differently: its limits the last, FastAPI the first. The app's to answer.)"""
        content_type = length = None
        for name, value in headers:
            if name == b"content-type":
                if content_type is not None:
                    return False
                content_type = value
            elif name == b"content-length":
                if length is not None:
                    return False
                length = value
            elif name == b"transfer-encoding":
                return False
        return (content_type is not None and content_type.lower() in _JSON and length is not None
                and length.isdigit() and int(length) <= self.max_body_bytes)


def _replay(read: list[Message], receive: Receive) -> Receive:
    """`receive` with the messages already read first."""
    pending = list(read)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
