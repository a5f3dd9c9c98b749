"""A worker's end of the channel: it listens (a Unix socket for routers on its host, TCP for the
others), takes routers that prove the cluster's token, runs their calls and sends each router its
requests' deltas, one frame per engine step. A TCP connection's frames after the hello are sealed
(wire.Link); a Unix socket's are not.

It runs on a thread of its own with its own event loop, as the KV TCP backend's receiver does: the
engine loop's thread encodes a step's deltas and writes them itself (thread_link.py: one lock with
the channel's thread, which writes whatever the socket cannot take at once, in order). A connection
opens with a fresh nonce; the router's first frame (HELLO) names it, brings the router's nonce and
proves the token over both.
Anything else — a wrong proof, a frame that is not the channel's, silence past HELLO_S — is
refused by name: logged, counted in `refused` (by why: a flood costs no memory), answered and
closed; the worker serves on. After the hello, a frame that cannot be read (not msgpack, an unknown
kind, a call whose items are no requests) is dropped and counted in `dropped` — a call of it is
answered with the error, so its router does not wait out its deadline — and the connection serves
on: the length prefix still frames the stream. So is a sealed frame whose tag is wrong (forged,
replayed, reordered: `bad_mac`), which counts as nothing heard: the router's next frame as sent
still opens. Only a frame over MAX_FRAME_BYTES ends it (its bytes are not read). A router whose
connection closes, or that says nothing for DEAD_S, is gone: `gone(router)` lets the worker stop
its requests and free their KV blocks."""

import asyncio
import functools
import hmac
import logging
import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdserve.event_loop import new_event_loop
from pdserve.channel.thread_link import ThreadLink
from pdserve.frame_seal import BadSeal
from pdserve.refusals import Refusals
from pdserve.channel.wire import (ABORT, ANSWERS, BEAT, CALL_KINDS, CALLS, DEAD_S, DELTAS, HELLO, LEN, MAX_FRAME_BYTES,
                                  MAX_HELLO_BYTES, NONCE_BYTES, RESERVE, TAKEN, WELCOME, BadFrame, Link, beat, frame,
                                  hello_proof, pack, pack_answer, pack_delta, session_keys, unframe, unpack_request)
from pdserve.hop_trace import hop

log = logging.getLogger(__name__)
HELLO_S = 10.0  # a peer that does not prove who it is within this long is dropped
IN_FLIGHT = 1  # deltas frames a router has not said it took, before the next step's output waits and joins
BLOCKING = {RESERVE}  # calls answered at a step boundary: run off the channel's loop


class ChannelServer:
    def __init__(self, worker: str, token: str | None, serve: Callable[[str, list, str], list | None],
                 gone: Callable[[str], None] = lambda router: None, host: str = "127.0.0.1",
                 met: Callable[[str], None] = lambda router: None):
        """serve(kind, items, router) -> answers (None for aborts): the worker's calls. gone(router):
        a router's connection ended; met(router): a router proved itself (both on the channel's thread)."""
        self.worker = worker
        self._token = token
        self._serve = serve
        self._gone = gone
        self._met = met
        # Connections refused ("other_cluster", "not_a_router"), and frames of proven routers
        # dropped ("malformed", "bad_mac": a sealed frame that does not open) or that ended their
        # connection ("oversized"), by why.
        self.refused = Refusals(f"router channel of {worker}", log)
        self.dropped = Refusals(f"router channel of {worker}", log)
        self._links: dict[str, _Router] = {}  # router -> its live connection
        self._heard: dict[asyncio.StreamWriter, float] = {}  # connection -> when its last frame came
        self._closing = False  # closed by its worker: the connections it drops are no router's death
        self._dir = tempfile.mkdtemp(prefix="pdserve-ch-")
        weakref.finalize(self, shutil.rmtree, self._dir, True)  # (at the latest when the process exits)
        self._ipc = os.path.join(self._dir, "w.sock")
        self._calls = ThreadPoolExecutor(4, thread_name_prefix=f"{worker}-channel-calls")
        self._loop = new_event_loop()  # (uvloop's: pdserve/event_loop.py)
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, started), name=f"{worker}-channel", daemon=True)
        self._thread.start()
        if not started.wait(10) or self._error is not None:
            raise RuntimeError(f"{worker}: the router channel did not listen: {self._error!r}")

    def _run(self, host: str, started: threading.Event) -> None:
        self._error = None
        asyncio.set_event_loop(self._loop)
        try:
            # Over TCP a connection may cross hosts: its frames are sealed.
            self._tcp = self._loop.run_until_complete(
                asyncio.start_server(functools.partial(self._accept, sealed=True), host, 0))
            self._unix = self._loop.run_until_complete(
                asyncio.start_unix_server(functools.partial(self._accept, sealed=False), self._ipc))
        except Exception as e:
            self._error = e
            started.set()
            return
        self.host, self.port = host, self._tcp.sockets[0].getsockname()[1]
        started.set()
        self._loop.run_forever()

    def address(self, node: str) -> dict:
        """Where routers reach this worker: `ipc` from its host (`node`), else TCP."""
        return {"node": node, "host": self.host, "port": self.port, "ipc": self._ipc}

    def routers(self) -> list[str]:
        return list(self._links)

    # -- deltas, from the engine loop's thread ---------------------------------------------------------

    def send_deltas(self, router: str, deltas: list) -> bool | None:
        """Send one message of deltas to `router`: True sent; False held back (the router has not
        taken the last one yet: the caller joins the next steps' output to these, so a router that
        falls behind gets fewer, larger messages, as over Ray); None: no channel to that router (the
        caller sends over Ray)."""
        r = self._links.get(router)
        if r is None or r.link.writer.is_closing():
            return None
        if r.sent - r.taken >= IN_FLIGHT:
            return False
        body = pack(DELTAS, [pack_delta(d) for d in deltas])
        hop("deltas_out")
        r.sent += 1  # (only this thread writes `sent`; only the channel's thread writes `taken`)
        r.link.write_now(body)  # (on the socket from this thread: thread_link.py)
        return True

    # -- connections -----------------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sealed: bool) -> None:
        met = await self._hello(reader, writer)
        if met is None:
            writer.close()
            return
        router, nonces = met
        # Sealed: ours (worker to router) first, then the router's.
        link = ThreadLink(writer, session_keys(self._token, nonces, router, self.worker)[::-1] if sealed else None,
                          self._loop)
        old = self._links.get(router)
        self._met(router)
        self._links[router] = r = _Router(link)
        if old is not None:  # the router connected again: its old connection is over
            old.link.writer.close()
        self._heard[writer] = self._loop.time()
        beats = asyncio.ensure_future(beat(link, lambda: self._heard.get(writer, 0.0), asyncio.current_task()))
        try:
            await self._read(router, reader, r)
        except asyncio.CancelledError:  # silent past DEAD_S (wire.beat), or the worker closes
            if not self._closing:
                log.warning("router channel %s <- %s: silent for %g s", self.worker, router, DEAD_S)
        except (asyncio.IncompleteReadError, ConnectionError, BadFrame) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                log.warning("router channel %s <- %s: %r", self.worker, router, e)
        finally:
            beats.cancel()
            self._heard.pop(writer, None)
            writer.close()
            link.close()
            if self._links.get(router) is r:  # (not replaced by a newer connection of it)
                del self._links[router]
                if not self._closing:
                    log.info("router %s's channel to %s closed: its requests here stop", router, self.worker)
                    self._gone(router)

    async def _hello(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, bytes] | None:
        """(The router's name, the hello's nonces: ours, then its) if its hello proves our cluster's
        token; else None, refused by name."""
        nonce = os.urandom(NONCE_BYTES)
        sender, reason, why, nonces = "?", "", None, b""
        try:
            writer.write(nonce)
            (n,) = LEN.unpack(await asyncio.wait_for(reader.readexactly(LEN.size), HELLO_S))
            if n > MAX_HELLO_BYTES:
                raise BadFrame(f"a first frame of {n} bytes is no hello")
            parts = unframe(await asyncio.wait_for(reader.readexactly(n), HELLO_S))
            if parts[0] != HELLO or len(parts) != 4 or not isinstance(parts[3], bytes) or len(parts[3]) != NONCE_BYTES:
                raise BadFrame(f"a first frame {parts[0]!r} is no hello")
            sender, nonces = str(parts[1]), nonce + parts[3]
            if not hmac.compare_digest(str(parts[2]), hello_proof(self._token, nonces, sender, self.worker)):
                reason, why = "other_cluster", f"{sender!r} belongs to another cluster: its cluster token differs"
        except (BadFrame, TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            reason, why = "not_a_router", f"not a pdserve router: {e or type(e).__name__}"
        if why is None:
            writer.write(frame(WELCOME, True, ""))
            return sender, nonces
        self.refused.refuse(reason, f"a connection from {sender}: {why}")
        try:
            writer.write(frame(WELCOME, False, why))
            await asyncio.wait_for(writer.drain(), 1.0)
        except Exception:  # (it left already)
            pass
        return None

    async def _read(self, router: str, reader: asyncio.StreamReader, r: "_Router") -> None:
        heard, writer = self._heard, r.link.writer
        while True:
            (n,) = LEN.unpack(await reader.readexactly(LEN.size))
            if n > MAX_FRAME_BYTES:
                self.dropped.refuse("oversized", f"a frame of {n} bytes from {router}; its connection closed")
                raise BadFrame(f"a frame of {n} bytes")
            body = await reader.readexactly(n)
            hop("frame_in")
            try:
                body = r.link.open(body)
            except BadSeal as e:  # not the router's (nothing heard from it): its next frame may still open
                self.dropped.refuse("bad_mac", f"a frame to {router}'s connection: {e}")
                continue
            heard[writer] = self._loop.time()
            try:
                self._take(router, unframe(body), r)
            except BadFrame as e:  # a broken frame, not a dead router: it goes, the connection serves on
                self.dropped.refuse("malformed", f"a frame from {router}: {e}")

    def _take(self, router: str, parts: list, r: "_Router") -> None:
        """Act on one frame of a proven router; raises BadFrame where it is none of the channel's."""
        link = r.link
        if parts[0] == TAKEN:
            r.taken += 1
            return
        if parts[0] == BEAT:
            return
        if parts[0] != CALLS or len(parts) != 4 or parts[2] not in CALL_KINDS or type(parts[1]) is not int:
            raise BadFrame(f"unexpected frame {parts[0]!r}")
        _, seq, kind, items = parts
        if kind != ABORT:
            try:
                items = [unpack_request(a) for a in items]
            except Exception as e:  # its router waits on the call: it hears why
                self._answer(link, seq, None, f"BadFrame: a {kind} call whose items are no requests")
                raise BadFrame(f"a {kind} call whose items are no requests ({type(e).__name__})") from None
        elif not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise BadFrame("an abort of no request ids")
        if kind in BLOCKING:
            asyncio.ensure_future(self._call_aside(link, seq, kind, items, router))
        else:
            self._answer(link, seq, *self._call(kind, items, router))

    def _call(self, kind: str, items: list, router: str) -> tuple[list | None, str | None]:
        try:
            return self._serve(kind, items, router), None
        except Exception as e:  # the worker's call raised: the router hears it, as from a Ray call
            log.exception("%s: %s call from %s failed", self.worker, kind, router)
            return None, f"{type(e).__name__}: {e}"

    async def _call_aside(self, link: Link, seq: int, kind: str, items: list, router: str) -> None:
        answers, error = await self._loop.run_in_executor(self._calls, self._call, kind, items, router)
        self._answer(link, seq, answers, error)

    def _answer(self, link: Link, seq: int, answers: list | None, error: str | None) -> None:
        if seq:
            packed = None if answers is None else [pack_answer(a) for a in answers]
            link.write_if_open(pack(ANSWERS, seq, packed, error))

    def close(self) -> None:
        """Stop listening and drop every router's connection (a flip's old role, a worker's end)."""
        self._closing = True

        async def _close():
            self._tcp.close()
            self._unix.close()
            for r in list(self._links.values()):
                r.link.writer.close()
            # Every connection's tasks end here, not destroyed pending when the loop stops.
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=2)
        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(_close(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._calls.shutdown(wait=False)
        shutil.rmtree(self._dir, ignore_errors=True)


class _Router:
    """A router's connection, and the deltas frames sent on it and taken by the router."""

    def __init__(self, link: Link):
        self.link = link
        self.sent = 0
        self.taken = 0
