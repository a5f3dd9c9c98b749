"""A stream's ordinary deltas written by the router's `deliver` at once (RouterCore -> _DirectSSE),
without a wake of the stream's coroutine: every stream still gets every token once and in order,
also when the client reads slowly and the transport makes writes wait; and `run_now`, which runs
the ASGI send in its caller, behaves as awaiting it would."""

import asyncio
import json
import socket
import time

import httpx
import pytest
import ray

from pdserve.benchmarks import router_stream
from pdserve.benchmarks.router_stream import WORDS
from pdserve.router.eager import run_now


def expected_text(n: int) -> str:
    return "".join(WORDS[i % len(WORDS)] for i in range(n))


@pytest.fixture(scope="module")
def served():
    # One real router (RouterCore, the OpenAI front end, uvicorn) over a synthetic worker that steps
    # through the real RouterStreams: deltas come one step at a time, as from an engine (each test
    # sets the pace: `pace`).
    actors, url, _pids = router_stream.start(max_ahead=64, step_s=0.02)
    yield url, actors[-1], actors[0]
    ray.shutdown()


def test_a_router_meets_its_workers_before_it_serves(served):
    # The router opened its channel to the worker when it started, so a first request's first token
    # does not pay for the address lookup and the connection.
    _url, router, worker = served
    assert ray.get(worker.__ray_call__.remote(lambda w: w.channel.routers())) == ["pdserve-router-0"]
    assert ray.get(router.__ray_call__.remote(lambda r: r.core.in_flight())) == 0  # before any request


def pace(worker, step_s: float) -> None:
    """The synthetic worker's step from now on: slow enough that the router, even on a busy host,
    waits for each step with nothing in hand (where deltas are written at once)."""
    ray.get(worker.__ray_call__.remote(lambda w: setattr(w, "step_s", step_s)))


def router_counts(router) -> tuple[int, int]:
    return ray.get(router.__ray_call__.remote(lambda r: (
        r.core.direct_writes, __import__("pdserve.router.http_stream").router.http_stream._DirectSSE.waited)))


def test_streams_written_at_once_keep_every_token_in_order(served):
    url, router, worker = served
    pace(worker, 0.02)
    before, _ = router_counts(router)

    async def one(client: httpx.AsyncClient, n: int) -> tuple[str, int]:
        body = {"model": "tiny-moe", "prompt": [1, 2, 3], "max_tokens": n, "stream": True,
                "stream_options": {"include_usage": True}}
        text, usage = "", None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line.removeprefix("data: "))
                    if chunk["choices"]:
                        text += chunk["choices"][0]["text"]
                    if chunk.get("usage"):
                        usage = chunk["usage"]["completion_tokens"]
        return text, usage

    async def all_of_them():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, 30 + i) for i in range(24)))

    results = asyncio.run(all_of_them())
    assert results == [(expected_text(30 + i), 30 + i) for i in range(24)]
    written, _ = router_counts(router)
    # Deltas after each stream's first went straight out, while its coroutine waited with nothing in
    # hand (on a busy host the router falls behind at times, and a wake takes several through the queue).
    assert written - before >= 24


def test_a_client_reading_slowly_still_gets_every_token_in_order(served):
    url, router, worker = served
    pace(worker, 0.005)
    n = 1500  # ~250 KB of events: far more than the socket buffers and the transport's high-water mark
    # The router's send buffer small (an accepted socket inherits it from the listening one): else
    # loopback's autotuning lets the kernel take megabytes before the transport has to pause.
    ray.get(router.__ray_call__.remote(lambda r: [sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
                                                   for server in r.http.servers for sock in server.sockets]))
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": "tiny-moe", "prompt": [1], "max_tokens": n, "stream": True}).encode()
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: the window stays small)
        s.settimeout(30)
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(body), body))
        # Not reading: the router's writes back up until its transport pauses (~420 events fill the
        # buffers), and a direct write, or the stream's own, has to wait (which one meets the pause
        # first depends on the host's load: test_a_direct_write_the_transport_makes_wait_* covers the former).
        time.sleep(4)
        data = b""
        while not data.endswith(b"0\r\n\r\n"):
            chunk = s.recv(1 << 16)
            assert chunk, "the router closed the connection mid-stream"
            data += chunk
    head, _, chunked = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    payload, rest = b"", chunked
    while rest:  # undo the chunked transfer coding
        size, _, rest = rest.partition(b"\r\n")
        payload, rest = payload + rest[:int(size, 16)], rest[int(size, 16) + 2:]
    events = [e.removeprefix("data: ") for e in payload.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == expected_text(n)


def test_a_direct_write_the_transport_makes_wait_goes_out_before_any_later_one():
    from pdserve.messages import RequestDelta
    from pdserve.router.http_stream import _DirectSSE
    from pdserve.router.metrics import Metrics
    from pdserve.router.openai_responses import CompletionShape

    async def scenario():
        writable, sent = asyncio.Event(), []
        writable.set()

        async def send(message):  # as uvicorn's: it waits while the transport is paused
            if not writable.is_set():
                await writable.wait()
            sent.append(message["body"])

        shape = CompletionShape("cmpl-1", "m", False, False)
        direct = _DirectSSE(shape, Metrics("r").request_started("completions", 3))
        assert not direct.write(RequestDelta("cmpl-1", " a", [1]))  # its stream is not waiting: no
        direct.send = send
        assert direct.write(RequestDelta("cmpl-1", " a", [1])) and direct.pending is None
        writable.clear()  # the client stops reading
        waited = _DirectSSE.waited
        assert direct.write(RequestDelta("cmpl-1", " b", [2])) and direct.pending is not None
        assert _DirectSSE.waited == waited + 1
        assert not direct.write(RequestDelta("cmpl-1", " c", [3]))  # held back: the stream queues it
        assert len(sent) == 1
        writable.set()
        await direct.pending  # what the stream awaits before its own next write
        texts = [json.loads(b.decode().removeprefix("data: "))["choices"][0]["text"] for b in sent]
        assert texts == [" a", " b"] and direct.num_tokens == 2

    asyncio.run(scenario())


def test_run_now_finishes_at_once_or_in_a_task_as_awaiting_would():
    async def scenario():
        log = []

        async def plain(x):
            log.append(x)
            return x

        assert run_now(plain(1)) is None and log == [1]  # no suspension: done in the call

        async def fails():
            raise ValueError("refused")
        with pytest.raises(ValueError, match="refused"):
            run_now(fails())

        gate = asyncio.Event()

        async def waits(x):
            await gate.wait()
            await asyncio.sleep(0)  # a bare yield too
            log.append(x)
        task = run_now(waits(2))
        assert task is not None and log == [1]
        gate.set()
        await task
        assert log == [1, 2]

        fut = asyncio.get_running_loop().create_future()

        async def raises_later():
            await fut
        task = run_now(raises_later())
        fut.set_exception(KeyError("gone"))
        with pytest.raises(KeyError):
            await task

        closed = []

        async def cancelled():
            try:
                await asyncio.Event().wait()
            finally:
                closed.append(True)
        task = run_now(cancelled())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == [True]  # the coroutine ended where it waited

    asyncio.run(scenario())


def test_a_direct_write_goes_straight_to_uvicorns_chunked_transport():
    """Under uvicorn's httptools server (the router's) a started chunked response's cycle is found
    behind its `send`, and a chunk written to it directly reaches the client as uvicorn's own `send`
    would frame it; a plain callable keeps the ASGI path."""
    import uvicorn

    from pdserve.router.http_stream import _chunked_cycle

    found = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        cycle = _chunked_cycle(send)
        found.append(cycle)
        await send({"type": "http.response.body", "body": b"one,", "more_body": True})
        body = b"two,"
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))  # as _DirectSSE.write does
        await send({"type": "http.response.body", "body": b"three", "more_body": False})

    async def go() -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, http="httptools", log_level="warning"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient() as c:
                r = await c.get(f"http://127.0.0.1:{sock.getsockname()[1]}/", timeout=10)
            return r.text
        finally:
            server.should_exit = True
            await task

    assert asyncio.run(go()) == "one,two,three"
    assert found[0] is not None and found[0].chunked_encoding

    async def plain(message):
        pass

    assert _chunked_cycle(plain) is None
