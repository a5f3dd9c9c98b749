"""The HTTP front end sheds slow clients (router/http_deadlines.py), served for real by uvicorn with
the router's own protocol (router/server.py:http_config) over a LocalCore on tiny-moe, and
attacked over raw sockets: a client dribbling its headers (slowloris) or its body is cut off by
its deadline while others are served; a streaming client that stops reading is cut off and its
request aborted, its KV blocks back in the pool; past the connection cap a new connection gets 503
at once. Also: /docs and /openapi.json are off unless router.openapi_docs; gRPC answers
RESOURCE_EXHAUSTED past router.grpc_max_concurrent_rpcs."""

import json
import socket
import time

import grpc
import httpx
import openai
import pytest

from pdserve.config import EngineConfig, ModelConfig, RouterConfig
from pdserve.engine.engine import Engine
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2 as pb
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2_grpc as pb_grpc
from pdserve.router.grpc_server import GrpcLimits, start_grpc_server
from pdserve.router.http_api import build_app
from pdserve.router.metrics import Metrics
from pdserve.router.server import http_config
from local_core import LocalCore, Served
from serving_cluster import until
from test_grpc_api import LoopThread

MODEL = "tiny-moe"
DEADLINE_S = 1.0  # every deadline of these servers: short, so that a test waits little for one


@pytest.fixture(scope="module")
def core():
    core = LocalCore(Engine(EngineConfig(model=ModelConfig(path=MODEL), num_kv_blocks=512)), MODEL)
    yield core
    core.close()


class Front:
    """The app over `core` served under the router's protocol with `router`'s deadlines and cap."""

    def __init__(self, core, **router):
        self.metrics = Metrics(model_name=MODEL)
        cfg = RouterConfig(**({"header_timeout_s": DEADLINE_S, "body_timeout_s": DEADLINE_S,
                               "sse_write_timeout_s": DEADLINE_S} | router))
        config = http_config(build_app(core, self.metrics, openapi_docs=cfg.openapi_docs), router=cfg,
                             metrics=self.metrics)
        self.served = Served(config.app, http=config.http, timeout_keep_alive=config.timeout_keep_alive)
        self.url = self.served.url
        self.port = int(self.url.rsplit(":", 1)[1])

    def cuts(self, reason: str) -> float:
        return self.metrics.connections_cut[reason]

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf is not None:  # (before connecting: the window it advertises)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", self.port))
        return s

    def complete(self, max_tokens: int = 3) -> int:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=max_tokens, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.usage.completion_tokens


@pytest.fixture
def front(core):
    fronts = []

    def start(**router) -> Front:
        fronts.append(Front(core, **router))
        return fronts[-1]

    yield start
    for f in fronts:
        f.served.stop()


def closed_by_server(s: socket.socket, timeout_s: float = 30) -> bytes:
    """Everything the server sent until it closed the connection (a reset counts as closed)."""
    s.settimeout(timeout_s)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_a_client_dribbling_its_headers_is_cut_off_while_others_are_served(front):
    f = front()
    silent = f.connect()  # opens and sends nothing
    slow = f.connect()
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    start = time.monotonic()
    closed = False
    while time.monotonic() - start < 20 * DEADLINE_S:  # a header byte now and then: each resets no deadline
        try:
            slow.sendall(b"X")
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
        assert f.complete() == 3  # others are served meanwhile
        time.sleep(0.2)
    assert closed, "the server kept a connection whose headers never ended"
    assert closed_by_server(silent) == b""  # cut without an answer: there is no request to answer
    assert f.cuts("header_timeout") == 2
    assert f.complete() == 3


def test_a_kept_alive_connection_serves_again_until_idle_for_router_http_keep_alive_s(front):
    # The default outlasts the clients' own pools (httpx keeps an idle connection 5 s, aiohttp 15 s):
    # one that reuses a connection just as the server closes it loses its request.
    assert http_config(None).timeout_keep_alive == RouterConfig().http_keep_alive_s == 75.0
    f = front(http_keep_alive_s=1.0)
    s = f.connect()
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    s.settimeout(10)
    for idle_s in (0.0, 0.5):  # within it: the same connection answers again
        time.sleep(idle_s)
        s.sendall(health)
        answer = b""  # the whole answer, however many segments it came in

        def more() -> bytes:
            chunk = s.recv(65536)  # (a 10 s timeout: a server that answers nothing fails the test)
            assert chunk, (idle_s, "the server closed the connection within its keep-alive", answer)
            return chunk

        while b"\r\n\r\n" not in answer:
            answer += more()
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
        while len(body) < length:
            body += more()
        assert head.startswith(b"HTTP/1.1 200 ") and len(body) == length, (idle_s, answer)
    assert closed_by_server(s, 5.0) == b""  # idle past it: the server closes it


def test_a_body_not_in_within_its_deadline_gets_408(front):
    f = front()
    s = f.connect()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"model\": ")
    answer = closed_by_server(s)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), answer
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and "router.body_timeout_s" in error["message"]
    assert f.cuts("body_timeout") == 1
    assert f.complete() == 3


def test_past_the_connection_cap_a_new_connection_gets_503_at_once(front):
    f = front(max_connections=2, header_timeout_s=60.0)
    held = [f.connect(), f.connect()]
    extra = f.connect()
    answer = closed_by_server(extra)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert "router.max_connections" in json.loads(body)["error"]["message"]
    with pytest.raises(openai.APIStatusError) as e:
        f.complete()
    assert e.value.status_code == 503
    for s in held:
        s.close()
    until(lambda: _serves(f), what="a connection served once the held ones closed")
    assert f.cuts("max_connections") >= 2


def _serves(f: Front) -> bool:
    try:
        return f.complete() == 3
    except openai.APIStatusError:
        return False


def test_a_stream_its_client_stops_reading_is_cut_off_and_its_request_aborted(front, core):
    f = front()
    total = core.engine.pool.num_free_blocks
    s = f.connect(rcvbuf=4096)
    # 16 choices with 20 logprobs a token: a step's events are large, so the socket fills within seconds.
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3500, "temperature": 0,
                       "ignore_eos": True, "logprobs": 20, "n": 16, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.settimeout(30)
    assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    # ... and reads no more: the router's writes fill the socket, its transport pauses, and the
    # write deadline cuts the connection; its choices are aborted long before their 3500 tokens.
    until(lambda: f.cuts("write_timeout") == 1, timeout_s=60, what="the stalled stream cut off")
    until(lambda: not core.engine.has_unfinished() and core.engine.pool.num_free_blocks == total,
          what="the aborted request's blocks back in the pool")
    got = closed_by_server(s)
    assert b"data: [DONE]" not in got  # cut off, not finished
    assert f.complete() == 3


def test_the_api_map_is_off_unless_asked_for(front):
    f = front()
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f.url + path, timeout=30).status_code == 404, path
    on = front(openapi_docs=True)
    assert "/v1/completions" in httpx.get(on.url + "/openapi.json", timeout=30).json()["paths"]


def test_grpc_sheds_calls_past_its_concurrency_limit(core):
    loop = LoopThread()
    server = loop.run(start_grpc_server(core, 0, host="127.0.0.1", limits=GrpcLimits(max_concurrent_rpcs=1)))
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.CompletionStub(channel)
            held = stub.CompleteStream(pb.CompletionRequest(prompt="Once upon a time", max_tokens=2000,
                                                            ignore_eos=True), timeout=60)
            next(held)  # in flight now
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(pb.CompletionRequest(prompt="Once upon a time", max_tokens=2), timeout=60)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held.cancel()
            until(lambda: not core.engine.has_unfinished(), what="the held call aborted")
            reply = stub.Complete(pb.CompletionRequest(prompt="Once upon a time", max_tokens=2, ignore_eos=True),
                                  timeout=60)
            assert reply.usage.completion_tokens == 2
    finally:
        loop.run(server.stop(None))
        loop.close()
