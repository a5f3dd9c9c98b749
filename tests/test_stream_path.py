"""The router's streaming path at line rate: a wake of a stream (the deltas the core already holds)
goes out in one write with the events it always had, a worker joins the steps a router has not
taken, and tokenizing or templating never stalls the event loop that writes every stream."""

import asyncio
import itertools
import json
import socket
import threading
import time

import grpc
import httpx
import pytest
import uvicorn

from pdserve.engine.outputs import RequestOutput
from pdserve.engine.sequence import FinishReason
from pdserve.protocol import TokenLogprob
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2 as pb
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2_grpc as pb_grpc
from pdserve.router.grpc_server import start_grpc_server
from pdserve.router.http_api import build_app
from pdserve.router.metrics import Metrics
from pdserve.router.openai_responses import ChatShape, CompletionShape, sse_event
from pdserve.router.types import ServingError
from pdserve.worker.router_streams import RouterStreams
from pdserve.messages import RequestDelta


def delta(text: str, token_ids: list[int], finish_reason: str | None = None, logprobs=()) -> RequestDelta:
    """A core's output for a front end (request id, error and `more` as a worker leaves them)."""
    return RequestDelta("", text, token_ids, finish_reason, None, logprobs)

MODEL = "scripted"


class ScriptedCore:
    """A ServingCore that plays every request one script: wakes of deltas (all of a wake but its
    last marked `more`, as RouterCore marks the deltas it already holds), a pause before each later
    wake. An exception in a wake is raised there, as the core raises a failure."""

    model_name = MODEL
    max_model_len = 4096

    def __init__(self, wakes: list[list], pause_s: float = 0.0, slow_s: float = 0.0):
        self.wakes, self.pause_s, self.slow_s = wakes, pause_s, slow_s
        self.tokenized_on: list[int] = []  # the thread of each tokenize or template call
        self.closed: list[bool] = []  # per request whose stream was closed: had it finished?

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.tokenized_on.append(threading.get_ident())
        time.sleep(self.slow_s)  # a long prompt holds its thread
        return list(text.encode())

    def apply_chat_template(self, messages: list[dict], tools=None, template_kwargs=None,
                            add_generation_prompt=True) -> str:
        self.tokenized_on.append(threading.get_ident())
        time.sleep(self.slow_s)
        return "".join(m["content"] for m in messages)

    def ready(self) -> bool:
        return True

    def degraded(self) -> dict[str, str]:
        return {}

    async def generate(self, request, direct=None):  # (no direct writes: every delta through the iterator)
        finished = False
        try:
            for i, wake in enumerate(self.wakes):
                if i:
                    await asyncio.sleep(self.pause_s)
                for j, item in enumerate(wake):
                    if isinstance(item, Exception):
                        raise item
                    finished = item.finish_reason is not None
                    yield item._replace(more=j < len(wake) - 1)
        finally:
            self.closed.append(finished)


def text_wakes(*wakes: str, finish: str = "length") -> list[list[RequestDelta]]:
    """Wakes of one-token text deltas, e.g. ("ab", "c") -> [[a, b], [c]]; the last delta finishes."""
    out = [[delta(ch, [ord(ch)]) for ch in wake] for wake in wakes]
    out[-1][-1] = delta(out[-1][-1].text, out[-1][-1].token_ids, finish)
    return out


async def call_asgi(app, body: dict, leave_after_sends: int | None = None) -> list[dict]:
    """POST /v1/completions straight into the ASGI app; the ASGI messages it sent. The client
    stays until the response ends, or leaves once it got `leave_after_sends` messages."""
    raw = json.dumps(body).encode()
    sent: list[dict] = []
    read, leave = False, asyncio.Event()

    async def receive() -> dict:
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if leave_after_sends is not None and len(sent) >= leave_after_sends:
            leave.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    await app(scope, receive, send)
    return sent


def events_of(sent: list[dict]) -> list[str]:
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert body.endswith("\n\n")
    return [e.removeprefix("data: ") for e in body.split("\n\n")[:-1]]


STREAM = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 50, "stream": True,
          "stream_options": {"include_usage": True}}


# -- one write per wake ----------------------------------------------------------------------------


def test_a_wake_is_one_write_and_every_delta_keeps_its_event():
    core = ScriptedCore(text_wakes("abc", "d", "ef"))
    sent = asyncio.run(call_asgi(build_app(core, Metrics()), STREAM))
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert len(bodies) == 3  # a write per wake; the last carries the usage and [DONE] too
    events = events_of(sent)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == list("abcdef")
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 5 + ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    assert all(json.dumps(json.loads(e)) == e for e in events[:-1])  # json.dumps' own bytes
    assert core.closed == [True]


def test_a_failure_behind_held_deltas_comes_after_them_in_the_stream():
    core = ScriptedCore([[delta("x", [1]), delta("y", [2]), ServingError("decode replica died")]])
    events = events_of(asyncio.run(call_asgi(build_app(core, Metrics()), STREAM)))
    assert [json.loads(e)["choices"][0]["text"] for e in events[:2]] == ["x", "y"]
    assert json.loads(events[2])["error"]["code"] == "service_error" and events[3] == "[DONE]"


def test_a_client_leaving_between_wakes_closes_the_request_at_once():
    metrics = Metrics()
    core = ScriptedCore(text_wakes("ab", "c", "d"), pause_s=30)  # the next wake would come much later
    t0 = time.monotonic()
    asyncio.run(call_asgi(build_app(core, metrics), STREAM, leave_after_sends=2))  # headers, the first wake
    assert time.monotonic() - t0 < 10
    assert core.closed == [False]  # closed unfinished: RouterCore aborts it on its replica
    assert metrics.registry.get_sample_value("pdserve_requests_aborted_total", {"role": "router"}) == 1


def test_a_wake_of_several_tokens_is_one_inter_token_latency():
    metrics = Metrics()
    core = ScriptedCore(text_wakes("a", "bcd", "e"))
    asyncio.run(call_asgi(build_app(core, metrics), STREAM))
    assert metrics.registry.get_sample_value("pdserve_inter_token_latency_seconds_count") == 2
    assert metrics.registry.get_sample_value("pdserve_generation_tokens_sum") == 5


@pytest.mark.parametrize("shape", [CompletionShape, ChatShape])
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_text_event_is_the_bytes_json_dumps_gives(shape, include_usage):
    texts = ["plain", ' "quoted" ', "back\\slash", "new\nline\ttab", "\x00\x1f", "é", "😀", "\u2028", "</script>"]
    for text in texts:
        s = shape("cmpl-1", MODEL, want_logprobs=False, include_usage=include_usage)
        d = delta(text, [1])
        assert s.event(d) == sse_event(s.chunk(d))
    # A token whose text is held back (part of a UTF-8 character, a possible stop string) still has
    # its chunk, with empty text, as vLLM sends it: a client stamps its first token on it.
    s = shape("cmpl-1", MODEL, want_logprobs=False, include_usage=include_usage)
    d = delta("", [1])
    assert s.event(d) == sse_event(s.chunk(d))
    choice = json.loads(s.event(d).removeprefix("data: "))["choices"][0]
    assert (choice["text"] if shape is CompletionShape else choice["delta"]["content"]) == ""
    assert s.event(delta("", [])) is None  # no token, no text: nothing to show


def test_logprob_events_keep_their_offsets():
    s = CompletionShape("cmpl-1", MODEL, want_logprobs=True, include_usage=False)
    lps = [TokenLogprob(token_id=i, logprob=-1.0, text=t, top=[], top_texts=[]) for i, t in enumerate(["ab", "c"])]
    first = json.loads(s.event(delta("abc", [0, 1], logprobs=lps)).removeprefix("data: "))
    second = json.loads(s.event(delta("d", [2], logprobs=[lps[0]])).removeprefix("data: "))
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 2]
    assert second["choices"][0]["logprobs"]["text_offset"] == [3]


# -- a worker joins the steps its router has not taken --------------------------------------------


class _Inbox:
    """A router handle that keeps what it is sent."""

    def __init__(self):
        self.messages: list[list] = []
        self.deliver = self

    def remote(self, deltas: list):
        self.messages.append(deltas)


def step(rid: str, i: int, text: str, last: bool = False, logprobs: list | None = None) -> RequestOutput:
    return RequestOutput(rid, [i], text, logprobs=logprobs or [], finished=last,
                         finish_reason=FinishReason.LENGTH if last else None)


def test_steps_a_router_has_not_taken_go_as_one_delta_per_request():
    streams, router = RouterStreams("unused"), _Inbox()
    streams._router = lambda name: router  # no Ray: the first flush of a router sends at once
    for rid in ("a", "b"):
        streams.add(rid, "router-0")
    lp = TokenLogprob(token_id=0, logprob=-0.5, top=[], text="x")
    for i in range(3):
        streams.output(step("a", i, f"a{i}", last=i == 2, logprobs=[lp]))
        streams.output(step("b", 10 + i, f"b{i}"))
    streams.fail("b", "the KV transfer failed")
    streams.flush()
    [message] = router.messages
    assert [(d.request_id, d.text, d.token_ids, d.finish_reason, len(d.logprobs)) for d in message] == [
        ("a", "a0a1a2", [0, 1, 2], "length", 3),
        ("b", "b0b1b2", [10, 11, 12], None, 0),
        ("b", "", [], "error", 0),  # after the output it had, on its own
    ]
    assert message[2].error == "the KV transfer failed"
    assert len(streams) == 0


# -- tokenizing off the event loop -------------------------------------------------------------------


@pytest.fixture
def server():
    """(URL, the server's thread, its core): uvicorn over a ScriptedCore whose tokenizer and chat
    template take a second, and whose streams wake every 20 ms for 2 s."""
    core = ScriptedCore(text_wakes(*("x" * 100)), pause_s=0.02, slow_s=1.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(core, Metrics()), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", thread, core
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_a_slow_tokenizer_does_not_stall_the_streams(server):
    url, thread, core = server
    arrivals: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=30) as r:
        lines = r.iter_lines()
        next(lines)  # streaming
        slow = [{"model": MODEL, "prompt": "a long prompt", "max_tokens": 5},
                {"model": MODEL, "messages": [{"role": "user", "content": "a long chat"}], "max_tokens": 5}]
        answers = []
        others = [threading.Thread(target=lambda b=b: answers.append(httpx.post(
            url + ("/v1/chat/completions" if "messages" in b else "/v1/completions"), json=b, timeout=30)))
            for b in slow]
        for t in others:
            t.start()
        for line in lines:
            if line:
                arrivals.append(time.monotonic())
    for t in others:
        t.join(timeout=30)
    assert sorted(a.status_code for a in answers) == [200, 200]
    assert len(core.tokenized_on) == 3 and thread.ident not in core.tokenized_on  # prompt, chat template, its text
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < 0.5, f"the stream stalled {max(gaps):.2f} s while a prompt was tokenized"


def grpc_stream(core: ScriptedCore) -> tuple[list, grpc.RpcError | None, int]:
    """CompleteStream over a real gRPC server on a loop thread: the chunks, the error that ended
    it, and the loop thread's id."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(start_grpc_server(core, 0, host="127.0.0.1"), loop).result(30)
    chunks, error = [], None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            try:
                for c in pb_grpc.CompletionStub(channel).CompleteStream(pb.CompletionRequest(prompt="hi"), timeout=30):
                    chunks.append(c)
            except grpc.RpcError as e:
                error = e
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
    return chunks, error, thread.ident


def test_grpc_sends_the_tokens_held_before_a_failure_then_its_status():
    chunks, error, _ = grpc_stream(ScriptedCore([[delta("x", [1]), delta("y", [2]), ServingError("decode died")]]))
    assert [c.text for c in chunks] == ["xy"] and list(chunks[0].token_ids) == [1, 2]
    assert error is not None and error.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_tokenizes_off_the_loop_and_streams_a_chunk_per_wake():
    core = ScriptedCore(text_wakes("ab", "cde", "f"))
    chunks, error, loop_thread = grpc_stream(core)
    assert error is None
    assert [c.text for c in chunks] == ["ab", "cde", "f"]
    assert [list(c.token_ids) for c in chunks] == [[97, 98], [99, 100, 101], [102]]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage.completion_tokens == 6
    assert core.tokenized_on and loop_thread not in core.tokenized_on
