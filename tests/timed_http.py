"""An HTTP/1.1 client for timing a server's answers: a streamed completion per call on a keep-alive
connection, spoken byte by byte, each answer timed by the kernel's arrival time of its bytes."""

import asyncio
import json
import socket
import struct
import time

PROMPT = list(range(1, 21))  # token ids: nothing to tokenize on the way in

SO_TIMESTAMPNS = 35  # Linux: each segment read carries the kernel's time of its arrival (CLOCK_REALTIME)


class Connection:
    """One HTTP/1.1 keep-alive connection, spoken byte by byte. An answer is timed from just before
    the request is written to the kernel's arrival time of the answer's first bytes (SO_TIMESTAMPNS):
    the service's latency, not this test process's — the client's own pauses after sending (its
    turn for a core on a loaded machine, its collector) would read as the server's."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.arrived: list[tuple[int, float]] = []  # (offset in buf, kernel arrival time) of each segment
        self.status: int | None = None  # the latest answer's, once its status line came

    @classmethod
    async def open(cls, url: str) -> "Connection":
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        return cls(sock)

    async def _fill(self) -> None:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(self.sock, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(self.sock)
        data, ancillary, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(16))
        now = time.time()
        assert data, "the server closed the connection"
        stamps = [struct.unpack("qq", payload[:16]) for level, kind, payload in ancillary
                  if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS]
        # Linux turns receive stamping on for the whole host lazily, from a work queue, as sockets ask
        # for it, and off as they close: a segment that came in meanwhile carries none (once in a whole
        # suite run, beside other tests' sockets). It is timed by its read then, which counts this
        # process's delay in reading it too.
        self.arrived.append((len(self.buf), stamps[0][0] + stamps[0][1] * 1e-9 if stamps else now))
        self.buf += data

    async def _until(self, sep: bytes) -> bytes:
        while (i := self.buf.find(sep)) < 0:
            await self._fill()
        return self._take(i + len(sep))

    async def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        return self._take(n)

    def _take(self, n: int) -> bytes:
        out, self.buf = self.buf[:n], self.buf[n:]
        shifted = [(at - n, t) for at, t in self.arrived]
        head = [t for at, t in shifted if at <= 0][-1:]  # the segment the rest of the buffer begins in
        self.arrived = [(0, t) for t in head if self.buf] + [(at, t) for at, t in shifted if at > 0]
        return out

    def _arrival(self) -> float:
        """When the bytes at the head of the buffer arrived (the kernel's time)."""
        at, t = self.arrived[0]
        assert at == 0 and self.buf
        return t

    async def complete(self, max_tokens: int, priority: int = 0, enough: asyncio.Event | None = None) -> dict:
        """One streamed completion: its status, when the answer began after sending (a 429's status
        line, or the first token's event; `first_at`: that event's arrival, time.time()'s clock), Retry-After,
        the error body, its events with tokens and (read to the end) its tokens. Once `enough` is set, it stops reading after 8 such events:
        the connection is then closed, which aborts the request."""
        body = json.dumps({"model": "tiny-moe", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                           "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                           "priority": priority}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: pdserve\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        t0 = time.time()  # (before: a pause of this process between the two would shorten what is timed)
        await asyncio.get_running_loop().sock_sendall(self.sock, request)
        if not self.buf:
            await self._fill()
        answered = self._arrival() - t0
        lines = (await self._until(b"\r\n\r\n")).decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        self.status = int(lines[0].split()[1])
        out = {"status": self.status, "retry_after": headers.get("retry-after"), "events": 0, "tokens": 0}
        if out["status"] != 200:
            out["after_s"] = answered
            out["error"] = json.loads(await self._exactly(int(headers["content-length"])))["error"]
            return out
        assert headers.get("transfer-encoding") == "chunked", headers
        while size := int(await self._until(b"\r\n"), 16):  # each write of the event stream
            if not self.buf:
                await self._fill()
            at = self._arrival()
            for event in (await self._exactly(size + 2))[:-2].split(b"\n\n"):
                if not event.startswith(b"data: {"):
                    continue
                chunk = json.loads(event.removeprefix(b"data: "))
                if chunk.get("error"):
                    out["error"] = chunk["error"]
                elif chunk["choices"]:
                    out.setdefault("after_s", at - t0)
                    out.setdefault("first_at", at)
                    out["events"] += 1
                    if enough is not None and enough.is_set() and out["events"] >= 8:
                        return out
                elif chunk.get("usage"):
                    out["tokens"] = chunk["usage"]["completion_tokens"]
        await self._exactly(2)
        return out

    def close(self) -> None:
        self.sock.close()
