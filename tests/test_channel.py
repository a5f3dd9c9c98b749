"""The direct channel between a router and a worker (pdserve/channel/), its two ends in this
process over real sockets: typed messages survive the frames; a router proving the cluster's token
is served, one that does not (a wrong token, bytes that are no frame) is refused by name and
logged while the worker serves on; either side hears the other's end within a deadline."""

import asyncio
import logging
import socket
import time

import pytest

from pdserve.channel.router_end import ChannelCallError, WorkerLink
from pdserve.channel.wire import (ABORT, PREFILL, RESERVE, ChannelClosed, pack_answer, pack_delta, pack_request,
                                  unpack_answer, unpack_delta, unpack_request)
from pdserve.channel import wire
from pdserve.channel.worker_end import ChannelServer
from pdserve.messages import NewRequest, Refusal, Request, RequestDelta, ReserveResult, Unpaired
from pdserve.protocol import SamplingParams, TokenLogprob

TOKEN = "cluster-secret"
MINE = b"r" * wire.NONCE_BYTES  # a hand-made router's nonce


def test_typed_messages_come_back_as_they_went():
    r = NewRequest(Request("r1", [1, 2, 3], SamplingParams(max_tokens=7, temperature=0.5, stop=["x"], seed=3,
                                                           logit_bias={5: -3.0}, min_tokens=2, presence_penalty=0.5),
                           [9], priority=-1, session="s"), handle=b"\x00\xff", prefill_id="p0")
    assert unpack_request(pack_request(r)) == r
    for a in (None, Refusal("prompt", "too long"), Unpaired("d0", "p1"),
              ReserveResult(b"h", None, None), ReserveResult(None, Refusal("a", "b"), Unpaired("c", "d"))):
        assert unpack_answer(pack_answer(a)) == a
    d = RequestDelta("r1", " a", [5, 6], "stop", None, [TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.0)], " a", ["x"])])
    assert unpack_delta(pack_delta(d)) == d
    assert unpack_delta(pack_delta(RequestDelta("r2", "", [1]))) == RequestDelta("r2", "", [1])
    for why in (508, "</s>"):  # every field crosses: the stop token id or string that ended it too
        d = RequestDelta("r3", "", [508], "stop", stop_reason=why)
        back = unpack_delta(pack_delta(d))
        assert back == d and type(back) is RequestDelta
        assert (back.stop_reason, back.more, back.logprobs) == (why, False, ())  # (built field by field: by name too)


class Worker:
    """A worker's side as EngineWorker wires it: a real ChannelServer over calls that answer as a
    prefill worker does (an Unpaired for a handle naming no peer) and record what they took."""

    def __init__(self):
        self.taken: list[tuple[str, list, str]] = []
        self.gone: list[str] = []
        self.server = ChannelServer("w0", TOKEN, self.serve, self.gone.append)

    def serve(self, kind: str, items: list, router: str):
        self.taken.append((kind, items, router))
        if kind == ABORT:
            return None
        if kind == RESERVE:
            raise RuntimeError("this worker takes no reservations")
        return [None if r.handle else Unpaired("w0", "?") for r in items]


def link(server: ChannelServer, token: str, router: str = "router-0", lost=None,
         node: str | None = "here") -> WorkerLink:
    """A router's link to the worker: over its Unix socket (node "here", the worker's), or over TCP
    with sealed frames (node None: router.channel_transport tcp)."""
    async def locate():
        return server.address("here")
    return WorkerLink(router, "w0", token, node, locate, lambda deltas: None,
                      lost or (lambda worker, error: None))


def until(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := check()):
            return got
        time.sleep(0.02)
    raise AssertionError("not within the deadline")


@pytest.fixture
def worker():
    w = Worker()
    yield w
    w.server.close()


def request(rid: str, handle: bytes | None = b"h") -> NewRequest:
    return NewRequest(Request(rid, [1, 2], SamplingParams()), handle=handle)


@pytest.mark.parametrize("node", ["here", None], ids=["unix", "tcp_sealed"])
def test_a_router_with_the_token_is_served_in_batches(worker, node):
    async def scenario():
        ch = link(worker.server, TOKEN, node=node)
        first = ch.call(PREFILL, [request("a"), request("b", None)])
        ch.call(ABORT, ["c"])
        assert await asyncio.wait_for(first, 10) == [None, Unpaired("w0", "?")]
        with pytest.raises(ChannelCallError, match="takes no reservations"):  # raised there, heard here
            await asyncio.wait_for(ch.call(RESERVE, [request("d")]), 10)
        ch.close()
    asyncio.run(scenario())
    assert [(k, len(items), r) for k, items, r in worker.taken] == [(PREFILL, 2, "router-0"), (ABORT, 1, "router-0"),
                                                                    (RESERVE, 1, "router-0")]
    assert worker.taken[0][1][0].request.request_id == "a"
    until(lambda: worker.gone == ["router-0"])  # its connection closed: the worker stops its requests


def test_an_unauthenticated_peer_is_refused_and_logged_and_the_worker_serves_on(worker, caplog):
    caplog.set_level(logging.WARNING, logger="pdserve.channel.worker_end")

    async def scenario():
        lost: list[BaseException] = []
        wrong = link(worker.server, "another-cluster", "intruder", lost=lambda w, e: lost.append(e))
        with pytest.raises(ChannelClosed, match="another cluster"):
            await asyncio.wait_for(wrong.call(PREFILL, [request("x")]), 10)
        assert lost and "refused" in str(lost[0])
        # Bytes that are no frame, over TCP as from another host: refused, the connection closed.
        host, port = worker.server.host, worker.server.port
        reader, writer = await asyncio.open_connection(host, port)
        await reader.readexactly(16)  # the nonce
        writer.write(b"\x00\x00\x00\x05junk!")
        answer = await asyncio.wait_for(reader.read(), 10)  # (read to EOF: it closes)
        assert b"not a pdserve router" in answer
        writer.close()
        # A good router still gets its answers.
        ch = link(worker.server, TOKEN)
        assert await asyncio.wait_for(ch.call(PREFILL, [request("y")]), 10) == [None]
        ch.close()
    asyncio.run(scenario())
    assert worker.server.refused == {"other_cluster": 1, "not_a_router": 1}  # counted, not kept
    assert all(r == "router-0" for _, _, r in worker.taken)  # nothing of the refused ones was run
    assert sum("refused a connection" in r.getMessage() for r in caplog.records) == 2


class RawRouter:
    """A router by hand over a raw socket: the hello, then whatever frames the test chooses; over
    TCP sealed as a router seals them (`sealed`), over the worker's Unix socket as they are."""

    def __init__(self, server: ChannelServer, sealed: bool, name: str = "router-0"):
        from pdserve.channel.wire import HELLO, frame, session_keys
        from pdserve.frame_seal import Sealer

        if sealed:
            self.s = socket.create_connection((server.host, server.port), timeout=10)
        else:
            self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.s.settimeout(10)
            self.s.connect(server.address("here")["ipc"])
        nonces = self.s.recv(wire.NONCE_BYTES, socket.MSG_WAITALL) + MINE
        self.s.sendall(frame(HELLO, name, wire.hello_proof(TOKEN, nonces, name, "w0"), MINE))
        self.welcome = wire.unframe(self._body())
        keys = session_keys(TOKEN, nonces, name, "w0") if sealed else None
        self.out, self.into = (Sealer(keys[0]), Sealer(keys[1])) if keys else (None, None)

    def _body(self) -> bytes:
        (n,) = wire.LEN.unpack(self.s.recv(wire.LEN.size, socket.MSG_WAITALL))
        return self.s.recv(n, socket.MSG_WAITALL)

    def sealed(self, body: bytes) -> bytes:
        """`body` as it goes on the wire, length first (sealed where the connection is)."""
        if self.out is not None:
            body = self.out.seal(body)
        return wire.LEN.pack(len(body)) + body

    def send(self, *parts) -> None:
        self.s.sendall(self.sealed(wire.pack(*parts)))

    def read(self) -> list:
        body = self._body()
        return wire.unframe(self.into.open(body) if self.into is not None else body)

    def answer_of(self, seq: int) -> list:
        while (f := self.read())[0] != wire.ANSWERS or f[1] != seq:
            pass
        return f


@pytest.mark.parametrize("sealed", [False, True], ids=["unix", "tcp_sealed"])
def test_a_malformed_frame_of_a_proven_router_is_dropped_and_counted_and_the_connection_serves_on(worker, sealed):
    """Past the hello: bytes that are no msgpack, an unknown kind, a call whose items are no requests
    (answered with the error: its router does not wait out a deadline), an abort of no ids. Each is
    dropped and counted; the same connection's next call is served. Over TCP, where frames are sealed,
    a forged frame and a replayed one are dropped too (`bad_mac`), and the router's next frame still
    opens. A frame over the cap ends the connection, unread; the worker serves the next one."""
    from pdserve.channel.wire import CALLS, LEN, MAX_FRAME_BYTES

    r = RawRouter(worker.server, sealed)
    with r.s as s:
        assert r.welcome[:2] == ["welcome", True]
        s.sendall(r.sealed(b"\xc1junk") + r.sealed(wire.pack("gossip", 1))
                  + r.sealed(wire.pack(CALLS, 1, PREFILL, [["not", "a request"]]))
                  + r.sealed(wire.pack(CALLS, 0, ABORT, [7])))
        assert r.answer_of(1)[2:] == [None, "BadFrame: a prefill call whose items are no requests"]
        ok = r.sealed(wire.pack(CALLS, 2, PREFILL, [pack_request(request("ok"))]))
        s.sendall(ok)
        assert r.answer_of(2)[2:] == [[None], None]
        assert worker.server.dropped == {"malformed": 4}
        if sealed:
            forged = bytearray(r.sealed(wire.pack(CALLS, 3, PREFILL, [pack_request(request("forged"))])))
            forged[-1] ^= 1  # (its tag)
            r.out.seq -= 1  # the router never sent it: its next frame takes that number
            s.sendall(bytes(forged) + ok)  # and a frame the router sent before, again
            r.send(CALLS, 4, PREFILL, [pack_request(request("after"))])
            assert r.answer_of(4)[2:] == [[None], None]
            assert worker.server.dropped == {"malformed": 4, "bad_mac": 2}
        s.sendall(LEN.pack(MAX_FRAME_BYTES + 1))
        s.settimeout(10)
        while s.recv(1 << 16):  # (beats, then the close)
            pass
    assert worker.server.dropped["oversized"] == 1
    assert [items[0].request.request_id for k, items, _ in worker.taken if k == PREFILL] == ["ok"] + ["after"] * sealed

    async def scenario():  # and the worker serves on
        ch = link(worker.server, TOKEN, router="router-1")
        assert await asyncio.wait_for(ch.call(PREFILL, [request("next")]), 10) == [None]
        ch.close()
    asyncio.run(scenario())


def test_a_silent_router_is_gone_within_the_deadline(worker):
    # A peer that proves nothing and says nothing is dropped after the hello's deadline; one that
    # proved itself and then falls silent (a host cut off) after DEAD_S: here, a raw socket that
    # says hello and nothing more.
    from pdserve.channel.wire import HELLO, LEN, frame, hello_proof

    with socket.create_connection((worker.server.host, worker.server.port)) as s:
        nonce = s.recv(16)
        s.sendall(frame(HELLO, "quiet", hello_proof(TOKEN, nonce + MINE, "quiet", "w0"), MINE))
        s.settimeout(1.0)
        assert s.recv(LEN.size)  # welcomed
        t0 = time.monotonic()
        until(lambda: worker.gone == ["quiet"], timeout_s=wire.DEAD_S + 5)
        assert time.monotonic() - t0 < wire.DEAD_S + 3


def test_a_worker_that_closes_fails_the_calls_waiting_on_it(worker):
    async def scenario():
        lost: list[BaseException] = []
        ch = link(worker.server, TOKEN, lost=lambda w, e: lost.append(e))
        assert await asyncio.wait_for(ch.call(PREFILL, [request("a")]), 10) == [None]
        worker.server.close()
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(lost) == 1 and isinstance(lost[0], ChannelClosed)
        with pytest.raises(ChannelClosed):  # and later calls: its address answers no more
            await asyncio.wait_for(ch.call(PREFILL, [request("b")]), 10)
        ch.close()
    asyncio.run(scenario())


@pytest.mark.parametrize("node", ["here", None], ids=["unix", "tcp_sealed"])
def test_deltas_reach_their_router_in_order_one_frame_in_flight(worker, node):
    # A router that has not taken a frame gets the next steps' output joined into one (the worker is
    # told False: hold and join), then the rest, in order.
    got: list[list[RequestDelta]] = []

    async def scenario():
        ch = WorkerLink("router-0", "w0", TOKEN, node, lambda: asyncio.sleep(0, worker.server.address("here")),
                        got.append, lambda w, e: None)
        await asyncio.wait_for(ch.open(), 10)
        until_async = time.monotonic() + 10
        while worker.server.routers() != ["router-0"]:
            assert time.monotonic() < until_async
            await asyncio.sleep(0.01)
        sent = [worker.server.send_deltas("router-0", [RequestDelta("a", "x", [1])]),
                worker.server.send_deltas("router-0", [RequestDelta("a", "y", [2])])]
        assert sent == [True, False]  # (the second: before the router can have taken the first)
        while not got:
            assert time.monotonic() < until_async
            await asyncio.sleep(0.01)
        while worker.server.send_deltas("router-0", [RequestDelta("a", "y", [2], "stop")]) is False:
            assert time.monotonic() < until_async
            await asyncio.sleep(0.01)
        while len(got) < 2:
            assert time.monotonic() < until_async
            await asyncio.sleep(0.01)
        assert worker.server.send_deltas("nobody", [RequestDelta("b", "", [])]) is None  # (no channel: Ray's)
        ch.close()
    asyncio.run(scenario())
    assert got == [[RequestDelta("a", "x", [1])], [RequestDelta("a", "y", [2], "stop")]]


def test_a_workers_frame_that_does_not_open_ends_the_routers_connection():
    """Over TCP the router opens each of the worker's frames: one that is not the worker's next as
    sealed (here bytes no token holder sealed, after a welcome anyone could send) ends the connection,
    and the calls waiting on it hear so at once."""
    async def scenario():
        async def impostor(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            writer.write(b"n" * wire.NONCE_BYTES)
            (n,) = wire.LEN.unpack(await reader.readexactly(wire.LEN.size))
            await reader.readexactly(n)  # the hello
            writer.write(wire.frame(wire.WELCOME, True, "") + wire.LEN.pack(40) + b"x" * 40)
            await reader.read()  # (until the router closes)
            writer.close()

        server = await asyncio.start_server(impostor, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        lost: list[BaseException] = []

        async def locate():
            return {"node": "another-host", "host": "127.0.0.1", "port": port, "ipc": ""}
        ch = WorkerLink("router-0", "w0", TOKEN, "here", locate, lambda deltas: None, lambda w, e: lost.append(e))
        with pytest.raises(ChannelClosed, match="BadSeal"):
            await asyncio.wait_for(ch.call(PREFILL, [request("a")]), 10)
        assert len(lost) == 1
        ch.close()
        server.close()
    asyncio.run(scenario())


@pytest.mark.parametrize("sealed", [False, True], ids=["unix", "sealed"])
def test_frames_from_two_threads_keep_their_order_through_a_full_socket(sealed):
    """A worker's link (channel/thread_link.py): the engine's thread writes its frames itself while
    the channel's loop writes its own, into a socket whose reader does not read at first — its
    buffer fills, and the frames that do not fit go through the loop. Every frame arrives whole (a
    sealed one opens: numbered in the stream's order), each thread's in the order it wrote them."""
    import os
    import threading

    from pdserve.channel.thread_link import ThreadLink

    keys = (os.urandom(32), os.urandom(32)) if sealed else None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    loop = asyncio.new_event_loop()
    spin = threading.Thread(target=loop.run_forever, daemon=True)
    spin.start()

    async def connect():
        _, writer = await asyncio.open_unix_connection(sock=ours)
        return ThreadLink(writer, keys, loop)
    link = asyncio.run_coroutine_threadsafe(connect(), loop).result(10)
    handed, write_later = [], link._write_later  # (frames the loop wrote for the engine's thread)
    link._write_later = lambda data: (handed.append(len(data)), write_later(data))
    pad = b"x" * 4000
    engine_frames, loop_frames = 600, 150  # 3 MB: many times a Unix socket's buffer

    def engine():
        for i in range(engine_frames):
            link.write_now(wire.pack("e", i, pad))

    writer_thread = threading.Thread(target=engine)
    writer_thread.start()
    for j in range(loop_frames):
        loop.call_soon_threadsafe(link.write, wire.pack("l", j, pad))
        time.sleep(0.001)
    peer = wire.Link(None, keys[::-1] if keys else None)
    got: dict[str, list[int]] = {"e": [], "l": []}
    theirs.settimeout(30)
    buf = b""
    while len(got["e"]) + len(got["l"]) < engine_frames + loop_frames:
        chunk = theirs.recv(1 << 16)
        assert chunk, "the connection closed early"
        buf += chunk
        while len(buf) >= wire.LEN.size and len(buf) >= wire.LEN.size + wire.LEN.unpack_from(buf)[0]:
            n = wire.LEN.unpack_from(buf)[0]
            who, i, body = wire.unframe(peer.open(buf[wire.LEN.size:wire.LEN.size + n]))
            assert body == pad
            got[who].append(i)
            buf = buf[wire.LEN.size + n:]
    writer_thread.join(10)
    assert got == {"e": list(range(engine_frames)), "l": list(range(loop_frames))}
    assert handed and link._behind == 0  # the full socket sent some through the loop
    link.close()
    link.write_now(wire.pack("e", -1, pad))  # (after its end: not written, no error)
    loop.call_soon_threadsafe(loop.stop)
    spin.join(5)
    ours.close()
    theirs.close()


def test_channel_loops_are_uvloops_unless_rays_switch_is_off(monkeypatch):
    """A worker's channel loop is uvloop's (a dependency), as Ray makes the routers' loops;
    RAY_USE_UVLOOP=0 turns it off here as it does there."""
    import uvloop

    from pdserve.event_loop import new_event_loop

    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    monkeypatch.setenv("RAY_USE_UVLOOP", "0")
    loop = new_event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
