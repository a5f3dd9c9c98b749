"""The HTTP front end's guard against slow clients (slowloris and its kin): uvicorn's own protocol
(httptools) with deadlines where uvicorn has none, each a router.* key (pdserve/config.py):

- header_timeout_s: a connection's request line and headers must all arrive within it, counted
  from the connection's opening (on a kept-alive connection, from the next request's first byte:
  the silence before it is uvicorn's keep-alive timeout's); else the connection is closed. uvicorn's keep-alive timer covers only the silence between
  requests, so a client dribbling a header a byte at a time held its connection (and its memory)
  for ever.
- body_timeout_s: a request's body must arrive in full within it after its headers: else 408 and
  the connection closes (a 4 MB body dribbled in held the buffer as long as the client liked).
- write_timeout_s: a response the client stops reading (its socket full, the transport paused
  above its high-water mark) for this long has its connection cut: the app then sees the client
  gone (http.disconnect), which aborts its request and frees its KV blocks (http_stream.py). A
  timer armed only while writing is paused: nothing on the path of a client that reads.
- max_connections: past it, a new connection is answered 503 and closed at once, before it can
  send anything (uvicorn's limit_concurrency answers only once a request's headers are in, so
  slow connections held under it count against everyone).

Every cut is counted by reason (Metrics.count_connection_cut)."""

import asyncio
import json
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def _answer(status: int, phrase: str, message: str, code: str) -> bytes:
    """A whole HTTP response in OpenAI's error shape, closing the connection, as raw bytes: written
    by the protocol itself, where no app is running (yet) for the connection."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    return (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def deadlined_protocol(header_timeout_s: float, body_timeout_s: float, write_timeout_s: float,
                       max_connections: int, on_cut: Callable[[str], None] | None = None) -> type:
    """uvicorn's httptools protocol with these deadlines and this cap (uvicorn.Config(http=...)).
    on_cut(reason): counts a connection cut ("header_timeout", "body_timeout", "write_timeout",
    "max_connections")."""
    busy = _answer(503, "Service Unavailable", f"the router has {max_connections} connections open, its "
                   f"router.max_connections; try again shortly", "too_many_connections")
    slow_body = _answer(408, "Request Timeout", f"the request body did not arrive within {body_timeout_s:g} s "
                        f"(router.body_timeout_s)", "request_timeout")

    class DeadlinedHttp(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _stalled: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.write(busy)
                self._cut("max_connections", abort=False)
                return
            self._arm(header_timeout_s, "header_timeout")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._deadline is None:  # the next request on a kept-alive connection (the first's runs already)
                self._arm(header_timeout_s, "header_timeout")

        def on_headers_complete(self) -> None:
            self._arm(body_timeout_s, "body_timeout")
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._stalled is not None:
                self._stalled.cancel()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stalled is None:
                self._stalled = self.loop.call_later(write_timeout_s, self._cut, "write_timeout")

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

        def _arm(self, seconds: float, reason: str) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired, reason)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self, reason: str) -> None:
            self._deadline = None
            cycle = self.cycle
            if reason == "body_timeout" and cycle is not None and not cycle.response_started:
                self.transport.write(slow_body)  # (the app is still reading: nothing of its answer went out)
                cycle.disconnected = True  # to the app the client left: its answer, if any, goes nowhere
                self._cut(reason, abort=False)
                return
            self._cut(reason)

        def _cut(self, reason: str, abort: bool = True) -> None:
            """Close the connection: abort (its buffered output dropped: the client is not reading, or
            not there) or close after the answer just written."""
            if self._stalled is not None:
                self._stalled.cancel()  # (a no-op where it is the one firing)
                self._stalled = None
            if on_cut is not None:
                on_cut(reason)
            if not self.transport.is_closing():
                self.transport.abort() if abort else self.transport.close()

    return DeadlinedHttp
