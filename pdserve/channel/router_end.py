"""A router's end of the channel to one worker (on the router's event loop): it connects once the
worker's address is known (asked over Ray: `locate`), proves the cluster's token, sends each
turn's calls as one frame and hands the answers and deltas back. Over TCP its frames after the hello
are sealed both ways (wire.Link); a frame from the worker that does not open ends the connection.

The link connects on its first use and again after a loss, so a worker that was only slow is
reached again once its stats say it is back. A closed connection, a refusal, or DEAD_S of silence
(the worker beats every BEAT_S) fails every call waiting on it with ChannelClosed and calls
`lost(worker, error)` once per connection: the replica set counts the replica down and its
requests move, as after a failed Ray call."""

import asyncio
import logging
import os
import socket
from collections.abc import Awaitable, Callable

from pdserve.channel.wire import (ABORT, ANSWERS, BEAT, CALLS, DEAD_S, DELTAS, HELLO, LEN, MAX_FRAME_BYTES, NONCE_BYTES,
                                  TAKEN, WELCOME, BadFrame, ChannelClosed, Link, beat, frame, hello_proof, pack,
                                  pack_request, session_keys, unframe, unpack_answer, unpack_delta)
from pdserve.hop_trace import hop

log = logging.getLogger(__name__)
CONNECT_S = 10.0  # the worker's address, the connection and its hello, each within this


class ChannelCallError(RuntimeError):
    """A worker's call raised there (as a RayTaskError would say): not a lost replica."""


class WorkerLink:
    def __init__(self, router: str, worker: str, token: str | None, node: str | None,
                 locate: Callable[[], Awaitable[dict]], deliver: Callable[[list], None],
                 lost: Callable[[str, BaseException], None]):
        """node: this router's host address (a worker there is reached over its Unix socket); None:
        every worker over TCP, sealed (`router.channel_transport: tcp`). locate() -> the worker's
        address (ChannelServer.address, over Ray). deliver(deltas): a step's deltas for our
        requests. lost(worker, error): the connection ended."""
        self.router, self.worker = router, worker
        self._token, self._node = token, node
        self._locate, self._deliver, self._lost = locate, deliver, lost
        self._link: Link | None = None  # the live connection's frames
        self._opening: asyncio.Future | None = None  # the connection being made
        self._unsent: list[bytes] = []  # frames' bodies of calls made while it connects
        self._waiting: dict[int, asyncio.Future] = {}  # call seq -> its answers' future
        self._seq = 0
        self._tasks: list[asyncio.Task] = []
        self.closed = False  # closed by the router: the worker left its set

    # -- calls -----------------------------------------------------------------------------------------

    def call(self, kind: str, items: list) -> asyncio.Future | None:
        """Send one batch of calls; the future of their answers (None for aborts)."""
        if kind == ABORT:
            seq, out = 0, None
        else:
            self._seq += 1
            seq, out = self._seq, asyncio.get_running_loop().create_future()
            self._waiting[seq] = out
            items = [pack_request(r) for r in items]
        body = pack(CALLS, seq, kind, items)
        hop(f"out_{kind}")
        if self._connected():
            self._link.write(body)
        else:
            self._unsent.append(body)
            self.open()
        return out

    def _connected(self) -> bool:
        return self._link is not None and not self._link.writer.is_closing()

    def open(self) -> asyncio.Future:
        """Connect, unless connected or connecting; the future of the connection."""
        if self._connected():
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._connect())
        return self._opening

    async def _connect(self) -> None:
        try:
            address = await asyncio.wait_for(self._locate(), CONNECT_S)
            (reader, writer), sealed = await asyncio.wait_for(self._dial(address), CONNECT_S)
            try:
                mine = os.urandom(NONCE_BYTES)
                nonces = await asyncio.wait_for(reader.readexactly(NONCE_BYTES), CONNECT_S) + mine
                proof = hello_proof(self._token, nonces, self.router, self.worker)
                writer.write(frame(HELLO, self.router, proof, mine))
                parts = await asyncio.wait_for(_read_frame(reader, Link(writer, None)), CONNECT_S)  # (unsealed)
                if parts[0] != WELCOME or not parts[1]:
                    raise ChannelClosed(f"the worker {self.worker} refused this router: {parts[2:]}")
            except BaseException:
                writer.close()
                raise
        except Exception as e:
            error = e if isinstance(e, ChannelClosed) else ChannelClosed(
                f"no channel to the worker {self.worker}: {type(e).__name__}: {e}")
            self._fail(error)
            return
        if self.closed:
            writer.close()
            return
        keys = session_keys(self._token, nonces, self.router, self.worker) if sealed else None  # (ours first)
        self._link = link = Link(writer, keys)
        for body in self._unsent:
            link.write(body)
        self._unsent.clear()
        self._heard = asyncio.get_running_loop().time()
        reading = asyncio.ensure_future(self._read(reader, link))
        self._tasks = [reading, asyncio.ensure_future(beat(link, lambda: self._heard, reading))]

    async def _dial(self, address: dict):
        """(reader, writer), and whether the connection's frames are sealed (TCP: it may cross hosts)."""
        if address["node"] == self._node:
            return await asyncio.open_unix_connection(address["ipc"]), False
        reader, writer = await asyncio.open_connection(address["host"], address["port"])
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return (reader, writer), True

    async def _read(self, reader: asyncio.StreamReader, link: Link) -> None:
        loop, taken, writer = asyncio.get_running_loop(), pack(TAKEN), link.writer
        try:
            while True:
                parts = await _read_frame(reader, link)
                self._heard = loop.time()
                kind = parts[0]
                if kind == DELTAS:
                    hop("deltas_in")
                    self._deliver([unpack_delta(a) for a in parts[1]])
                    link.write(taken)
                elif kind == ANSWERS:
                    hop("answer_in")
                    self._answered(*parts[1:])
                elif kind != BEAT:
                    raise BadFrame(f"unexpected frame {kind!r}")
        except asyncio.CancelledError:  # closed by us, or the worker fell silent (wire.beat)
            self._drop(writer, f"silent for {DEAD_S:g} s")
            raise
        except Exception as e:
            why = "it closed the connection (its process died)" if isinstance(e, asyncio.IncompleteReadError) \
                else f"{type(e).__name__}: {e}"
            self._drop(writer, why)

    def _drop(self, writer: asyncio.StreamWriter, why: str) -> None:
        if self._link is not None and self._link.writer is writer:
            self._link = None
            writer.close()
            self._fail(ChannelClosed(f"the channel to {self.worker} closed: {why}"))

    def _answered(self, seq: int, answers: list | None, error: str | None) -> None:
        out = self._waiting.pop(seq, None)
        if out is None or out.done():
            return
        if error is not None:
            out.set_exception(ChannelCallError(f"{self.worker}: {error}"))
        else:
            out.set_result([unpack_answer(a) for a in answers])

    def _fail(self, error: ChannelClosed) -> None:
        """Every call waiting on the connection hears it; the replica set is told once."""
        waiting, self._waiting = self._waiting, {}
        self._unsent.clear()
        for out in waiting.values():
            if not out.done():
                out.set_exception(error)
        if not self.closed:
            self._lost(self.worker, error)

    def close(self) -> None:
        """The worker left the router's set: drop the connection (the worker stops what we left)."""
        self.closed = True
        self._link, link = None, self._link  # (its reader's cancellation then fails nothing)
        if link is not None:
            link.writer.close()
        for t in self._tasks:
            t.cancel()
        waiting, self._waiting = self._waiting, {}
        for out in waiting.values():
            if not out.done():
                out.set_exception(ChannelClosed(f"the worker {self.worker} left this router's set"))


async def _read_frame(reader: asyncio.StreamReader, link: Link) -> list:
    """The next frame (opened where the link is sealed); raises BadFrame, or BadSeal (a worker's
    frame that does not open: the connection ends)."""
    (n,) = LEN.unpack(await reader.readexactly(LEN.size))
    if n > MAX_FRAME_BYTES:
        raise BadFrame(f"a frame of {n} bytes")
    return unframe(link.open(await reader.readexactly(n)))
