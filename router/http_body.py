"""What the HTTP front end refuses before reading a request in full: a body over the size limit
(413, without buffering or tokenizing it) and a body that is not JSON (415). A plain ASGI
middleware: it sees the bytes as they arrive, before FastAPI parses anything."""

import json
from collections.abc import Callable

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # router.max_request_bytes; a 128k-token prompt is ~0.5-1 MB of text
DRAIN_FACTOR = 16  # how much of a refused body is read (and dropped) before answering, in limits


class BodyGuard:
    def __init__(self, app, max_body_bytes: int, on_refused: Callable[[str, int], None]):
        """on_refused(path, status): counts what was refused (the generation endpoints' metrics)."""
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        media = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media and media != "application/json" and not media.endswith("+json"):
            if await self._drain(receive):
                await self._refuse(scope, send, 415, f"Content-Type {media!r} is not supported; send the "
                                   "request body as JSON with Content-Type: application/json", "content-type")
            return
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            if await self._drain(receive):
                await self._refuse(scope, send, 413, self._too_large(int(length)), "body")
            return
        # Read the body here, counting, so that a chunked body with no length stops at the limit too.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                if not more or await self._drain(receive):
                    await self._refuse(scope, send, 413, self._too_large(size, at_least=True), "body")
                return
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _drain(self, receive) -> bool:
        """Read the rest of a refused body without keeping it, so that the client, still sending,
        reads the answer rather than a reset connection (a socket closed with unread data resets);
        False if the client left. A body past
        DRAIN_FACTOR times the limit is not waited for: the connection closes after the 413."""
        seen = 0
        while seen <= DRAIN_FACTOR * self.max_body_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
        return True

    def _too_large(self, size: int, at_least: bool = False) -> str:
        return (f"request body is {'over ' if at_least else ''}{size} bytes; at most {self.max_body_bytes} are "
                f"accepted (router.max_request_bytes)")

    async def _refuse(self, scope, send, status: int, message: str, param: str) -> None:
        self.on_refused(scope["path"], status)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                     "code": "request_too_large" if status == 413 else "unsupported_media_type"}})
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body.encode()})
