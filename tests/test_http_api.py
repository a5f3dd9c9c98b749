"""The OpenAI-compatible front end, served for real by uvicorn over a LocalCore on tiny-moe and called with the
official openai client (and raw HTTP where the client would hide the wire)."""

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pytest
import uvicorn

try:
    import httpx2 as httpx  # what the openai client is built on in this environment
except ImportError:
    import httpx

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import Completion
from pdserve.protocol import SamplingParams
from pdserve.router.http_api import build_app
from local_core import LocalCore
from pdserve.router.metrics import Metrics
from pdserve.router.types import NoCapacityError, OverloadedError, ServingError
from pdserve.messages import RequestDelta


def delta(text: str, token_ids: list[int], finish_reason: str | None = None, logprobs=()) -> RequestDelta:
    """A core's output for a front end (request id, error and `more` as a worker leaves them)."""
    return RequestDelta("", text, token_ids, finish_reason, None, logprobs)

MODEL = "tiny-moe"
PROMPT = "Once upon a time"
STOP_PROMPT = "abc"  # its greedy text has a "?" after a few tokens
CHAT = [{"role": "user", "content": "Hi there"}]
MANY = [f"Request number {i}:" for i in range(16)]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


@dataclass
class Served:
    url: str
    engine: Engine
    core: LocalCore
    metrics: Metrics
    expected: dict[str, Completion | list[Completion]]
    client: openai.OpenAI


def _expected(engine: Engine) -> dict:
    """Greedy outputs of the engine alone: what the server must return."""
    chat_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(CHAT), add_special_tokens=False)
    return {
        "plain": engine.generate([PROMPT], greedy(12))[0],
        "logprobs": engine.generate([PROMPT], greedy(12, logprobs=2))[0],
        "stop": engine.generate([STOP_PROMPT], greedy(24, stop=["?"]))[0],
        "chat": engine.generate([chat_ids], greedy(10))[0],
        "many": engine.generate(MANY, greedy(8)),
    }


@pytest.fixture(scope="module")
def served():
    engine = Engine(EngineConfig(model=ModelConfig(path=MODEL), num_kv_blocks=256))
    expected = _expected(engine)  # before the core's loop owns the engine
    core, metrics = LocalCore(engine, MODEL), Metrics(model_name=MODEL)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # handing uvicorn the bound socket leaves no race for the port
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = build_app(core, metrics, openapi_docs=True)  # (the API's map, off by default: test_slow_clients)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        yield Served(url, engine, core, metrics, expected, client)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        core.close()
        sock.close()


def post(served: Served, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, bytes):
        kw.setdefault("headers", {"content-type": "application/json"})
        return httpx.post(served.url + path, content=body, timeout=30, **kw)
    return httpx.post(served.url + path, json=body, timeout=30, **kw)


def wait_idle(served: Served, timeout: float = 5.0) -> None:
    """Every block back in the pool and no request left in the engine."""
    deadline = time.monotonic() + timeout
    while True:
        with served.core._lock:
            idle = not served.engine.seqs and served.engine.pool.num_free_blocks == served.engine.pool.num_blocks
        if idle:
            return
        assert time.monotonic() < deadline, "the engine did not return to idle"
        time.sleep(0.05)


def sample(served: Served, name: str, labels: dict) -> float:
    return served.metrics.registry.get_sample_value(name, labels) or 0.0


# -- completions --------------------------------------------------------------------------------


def test_completion_greedy_equals_engine(served):
    want = served.expected["plain"]
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(served.engine.tokenize(PROMPT))
    assert r.usage.completion_tokens == len(want.token_ids) == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_with_usage(served):
    want = served.expected["plain"]
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(served.engine.tokenize(PROMPT))


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served):
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk's usage counts
    the tokens its choice has streamed so far; without include_usage it asks for nothing."""
    want = served.expected["plain"]
    prompt_tokens = len(served.engine.tokenize(PROMPT))
    chunks = list(served.client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in body) == want.text
    seen = [c.usage.completion_tokens for c in body]
    assert seen == sorted(seen) and seen[-1] == 12 and all(c.usage.prompt_tokens == prompt_tokens for c in body)
    assert all(c.usage.total_tokens == prompt_tokens + c.usage.completion_tokens for c in body)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    chat = list(served.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert [c.usage.completion_tokens for c in chat if c.choices][-1] == 5
    alone = list(served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                                  stream=True, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in alone)


def test_stream_wire_format(served):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    r = post(served, "/v1/completions", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0].removeprefix("data: "))
    assert first["object"] == "text_completion" and first["id"].startswith("cmpl-")


def test_token_id_prompt_equals_text_prompt(served):
    ids = served.engine.tokenize(PROMPT)
    r = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == served.expected["plain"].text
    assert r.usage.prompt_tokens == len(ids)


def test_stop_string(served):
    want = served.expected["stop"]
    r = served.client.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=24, temperature=0, stop="?")
    assert want.finish_reason.value == "stop" and len(want.token_ids) < 24
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == want.text and "?" not in r.choices[0].text
    assert r.usage.completion_tokens == len(want.token_ids)


LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def completion_logprobs(r) -> tuple[str, dict]:
    """(text, logprobs) of a completion, or of a completion's stream of chunks joined."""
    if not isinstance(r, list):
        return r.choices[0].text, r.choices[0].logprobs.model_dump()
    lps = [c.choices[0].logprobs.model_dump() for c in r if c.choices and c.choices[0].logprobs]
    text = "".join(c.choices[0].text for c in r if c.choices)
    return text, {k: [v for lp in lps for v in lp[k]] for k in LOGPROB_KEYS}


def check_completion_logprobs(text: str, lp: dict, n: int, top: int) -> None:
    """n entries; tokens named by their own text, whose offsets walk the completion's text."""
    assert [len(lp[k]) for k in LOGPROB_KEYS] == [n] * 4, lp
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert all(v <= 0 for v in lp["token_logprobs"]) and all(len(alt) == top for alt in lp["top_logprobs"])
    assert not any(t.startswith("token_id:") for t in lp["tokens"] + [a for alt in lp["top_logprobs"] for a in alt])


def test_logprobs(served):
    want = served.expected["logprobs"]
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    text, lp = completion_logprobs(r)
    check_completion_logprobs(text, lp, 12, 2)
    assert text == want.text and lp["tokens"] == [t.text for t in want.logprobs]
    assert lp["token_logprobs"] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-4)
    # Greedy: each token is its own most likely alternative, under the same name.
    assert all(max(alt, key=alt.get) == tok for tok, alt in zip(lp["tokens"], lp["top_logprobs"]))
    chunks = list(served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                                   logprobs=2, stream=True))
    s_text, s_lp = completion_logprobs(chunks)
    assert s_text == text and s_lp["tokens"] == lp["tokens"] and s_lp["text_offset"] == lp["text_offset"]
    assert s_lp["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)


def test_seeded_sampling_is_reproducible(served):
    def run():
        return served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                                top_p=0.9, seed=7, extra_body={"top_k": 50, "ignore_eos": True})
    assert run().choices[0].text == run().choices[0].text


# -- chat ---------------------------------------------------------------------------------------


def test_chat_greedy_equals_engine(served):
    want = served.expected["chat"]
    r = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason.value
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)


def test_chat_stream(served):
    want = served.expected["chat"]
    parts = [{"type": "text", "text": "Hi there"}]  # list-of-parts content renders like the plain string
    chunks = list(served.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason.value
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_logprobs(served):
    r = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 3
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(bytes(c.bytes) == c.token.encode() for c in content)
    assert all(len(c.top_logprobs) == 3 for c in content)
    assert all(bytes(a.bytes) == a.token.encode() and not a.token.startswith("token_id:")
               for c in content for a in c.top_logprobs)


# -- the other endpoints ------------------------------------------------------------------------


def test_a_session_is_named_by_its_header_or_by_user(served):
    """Routing affinity's key (router/policy.py): the x-session-id header, else OpenAI's `user`."""
    body = {"model": "tiny-moe", "prompt": "Hi", "max_tokens": 2, "temperature": 0}
    chat = {"model": "tiny-moe", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "user": "u-2"}
    for path, b, headers, want in [("/v1/completions", body, {}, None),
                                   ("/v1/completions", {**body, "user": "u-1"}, {}, "u-1"),
                                   ("/v1/completions", {**body, "user": "u-1"}, {"x-session-id": "s-9"}, "s-9"),
                                   ("/v1/chat/completions", chat, {}, "u-2")]:
        assert post(served, path, b, headers=headers).status_code == 200
        assert served.core.sessions[-1] == want, (path, b, headers)
    r = post(served, "/v1/completions", {**body, "user": "x" * 513})
    assert r.status_code == 400 and r.json()["error"]["param"] == "user"


def test_models(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == served.engine.max_model_len
    assert served.client.models.retrieve(MODEL).id == MODEL


def test_health(served, monkeypatch):
    r = httpx.get(served.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    # Every role serves, but a replica is down (its replacement starting): still 200, named.
    down = {"pdserve-decode-1": "down: its process died"}
    monkeypatch.setattr(served.core, "degraded", lambda: down)
    r = httpx.get(served.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "degraded", "replicas": down}
    monkeypatch.setattr(served.core, "ready", lambda: False)
    r = httpx.get(served.url + "/health")
    assert r.status_code == 503 and "pdserve-decode-1 down: its process died" in r.json()["error"]["message"]


def test_metrics(served):
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    r = httpx.get(served.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'pdserve_requests_total{endpoint="/v1/completions",status="200"}' in text
    for name in ("pdserve_ttft_seconds_count", "pdserve_inter_token_latency_seconds_count",
                 "pdserve_e2e_latency_seconds_count", "pdserve_prompt_tokens_count",
                 "pdserve_generation_tokens_count", "pdserve_kv_bytes_moved_total"):
        assert name in text
    assert sample(served, "pdserve_ttft_seconds_count", {}) >= 1
    assert sample(served, "pdserve_generation_tokens_sum", {}) >= 2


# -- errors -------------------------------------------------------------------------------------

OK = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
OK_CHAT = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
BAD = [
    # (path, body, status, param)
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": ', 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", OK | {"model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt"),
    ("/v1/completions", OK | {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", OK | {"prompt": []}, 400, "prompt"),
    ("/v1/completions", OK | {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", OK | {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", OK | {"prompt": [100000]}, 400, "prompt"),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "\\ud800"}', 400, "prompt"),
    ("/v1/completions", OK | {"prompt": "a" * 5000}, 400, "prompt"),
    ("/v1/completions", OK | {"max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", OK | {"max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", OK | {"max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions", OK | {"temperature": -1}, 400, "temperature"),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("/v1/completions", OK | {"top_p": 0}, 400, "top_p"),
    ("/v1/completions", OK | {"top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", OK | {"top_k": -2}, 400, "top_k"),
    ("/v1/completions", OK | {"seed": 2**64}, 400, "seed"),
    ("/v1/completions", OK | {"stop": [""]}, 400, "stop"),
    ("/v1/completions", OK | {"n": 17}, 400, "n"),  # over router.max_n (16)
    ("/v1/completions", OK | {"n": 0}, 400, "n"),
    ("/v1/completions", OK | {"n": 2, "best_of": 1}, 400, "best_of"),
    ("/v1/completions", OK | {"n": 2, "best_of": 17}, 400, "best_of"),
    ("/v1/completions", OK | {"n": 1, "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", OK | {"echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", OK | {"logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", OK | {"frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("/v1/completions", OK | {"presence_penalty": -3}, 400, "presence_penalty"),
    ("/v1/completions", OK | {"repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", OK | {"min_p": 1.5}, 400, "min_p"),
    ("/v1/completions", OK | {"min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", OK | {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("/v1/completions", OK | {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", OK | {"logit_bias": {"100000": 1}}, 400, "logit_bias"),  # outside the vocabulary
    ("/v1/completions", OK | {"stop_token_ids": [100000]}, 400, "stop_token_ids"),
    ("/v1/completions", OK | {"n": 2, "logit_bias": {"100000": 1}}, 400, "logit_bias"),  # every choice refused
    ("/v1/completions", OK | {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages.0.content"),
    ("/v1/chat/completions", json.dumps(OK_CHAT | {"messages": [{"role": "user", "content": "\ud800"}]}).encode(),
     400, "messages"),
    ("/v1/chat/completions", OK_CHAT | {"model": "nope"}, 404, "model"),
    ("/v1/chat/completions", OK_CHAT | {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", OK_CHAT | {"temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", OK_CHAT | {"n": 17}, 400, "n"),
    ("/v1/chat/completions", OK_CHAT | {"frequency_penalty": -2.5}, 400, "frequency_penalty"),
    ("/v1/chat/completions", OK_CHAT | {"logit_bias": {"100000": 1}}, 400, "logit_bias"),
    ("/v1/chat/completions", OK_CHAT | {"top_logprobs": 2}, 400, "top_logprobs"),
    # Tools reach the template, but must be OpenAI function definitions; a forced call needs tools, and a
    # named one a tool of that name.
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function"}]}, 400, "tools.0.function"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "code", "function": {"name": "f"}}]}, 400, "tools.0.type"),
    ("/v1/chat/completions", OK_CHAT | {"tools": {"type": "function"}}, 400, "tools"),
    ("/v1/chat/completions", OK_CHAT | {"tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"tool_choice": {"type": "function", "function": {"name": "f"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function", "function": {"name": "g"}}],
                                        "tool_choice": {"type": "function", "function": {"name": "f"}}},
     400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/v1/chat/completions", OK_CHAT | {"tools": [{"type": "function", "function": {
        "name": "g", "parameters": {"type": "bogus"}}}], "tool_choice": "required"}, 400, "tools"),
    # Structured outputs: a schema, regex or grammar that does not compile names its field.
    ("/v1/chat/completions", OK_CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, 400, "response_format.json_schema.schema"),
    ("/v1/chat/completions", OK_CHAT | {"response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema"),
    ("/v1/completions", OK | {"response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("/v1/completions", OK | {"structured_outputs": {"regex": "a(+"}}, 400, "structured_outputs.regex"),
    ("/v1/completions", OK | {"structured_outputs": {"json": "{not json"}}, 400, "structured_outputs.json"),
    ("/v1/completions", OK | {"structured_outputs": {"grammar": "start: missing_rule"}}, 400,
     "structured_outputs.grammar"),
    # What only the model's tokenizer knows: a special token or a token id it lacks (checked against it).
    ("/v1/completions", OK | {"structured_outputs": {"grammar": 'start: "a" <|no_such_token|>'}}, 400,
     "structured_outputs.grammar"),
    ("/v1/completions", OK | {"guided_grammar": "start: <[99999999]>"}, 400, "guided_grammar"),
    ("/v1/completions", OK | {"structured_outputs": {"choice": []}}, 400, "structured_outputs.choice"),
    ("/v1/completions", OK | {"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "structured_outputs"),
    ("/v1/completions", OK | {"guided_regex": "a(+"}, 400, "guided_regex"),
    ("/v1/completions", OK | {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     400, "structured_outputs"),
    # chat_template_kwargs: a JSON object whose keys do not replace the variables pdserve sets.
    ("/v1/chat/completions", OK_CHAT | {"chat_template_kwargs": "enable_thinking"}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", OK_CHAT | {"chat_template_kwargs": [["enable_thinking", False]]},
     400, "chat_template_kwargs"),
    ("/v1/chat/completions", OK_CHAT | {"chat_template_kwargs": {"add_generation_prompt": False}},
     400, "chat_template_kwargs"),
    ("/v1/chat/completions", OK_CHAT | {"chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", OK_CHAT | {"chat_template_kwargs": {"tools": []}}, 400, "chat_template_kwargs"),
    # Inputs that would cost the server too much, refused before any work.
    ("/v1/completions", OK | {"stop": ["x"] * 100_000}, 400, "stop"),
    ("/v1/completions", OK | {"stop": "x" * 1_000_000}, 400, "stop"),
    ("/v1/chat/completions", OK_CHAT | {"stop": ["ab"] * 65}, 400, "stop"),
    # What the OpenAPI schema says: a model and a prompt are non-empty.
    ("/v1/completions", OK | {"model": ""}, 400, "model"),
    # Only an assistant's message may have null content; a user's is a 400, not a template error.
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
    # vLLM's priority: an integer in gRPC's int32 range (the gRPC API takes the same).
    ("/v1/completions", OK | {"priority": "high"}, 400, "priority"),
    ("/v1/completions", OK | {"priority": 1.5}, 400, "priority"),
    ("/v1/chat/completions", OK_CHAT | {"priority": 2**31}, 400, "priority"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{p[0].split('/')[-1]}-{i}" for i, p in enumerate(BAD)])
def test_bad_request(served, path, body, status, param):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if param:
        assert param in error["message"] or status == 404
    if status == 404:
        assert error["code"] == "model_not_found"


def test_a_body_over_the_limit_is_413_before_it_is_read(served):
    big = OK | {"prompt": "x" * (5 * 1024 * 1024)}
    counted = {"endpoint": "/v1/completions", "status": "413"}
    before = sample(served, "pdserve_requests_total", counted)
    r = post(served, "/v1/completions", big)  # with Content-Length
    assert r.status_code == 413 and "max_request_bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted as it arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1 << 16):
            yield data[i:i + (1 << 16)]
    r = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert sample(served, "pdserve_requests_total", counted) == before + 2
    assert post(served, "/v1/completions", OK).status_code == 200


def test_a_body_that_is_not_json_is_415_naming_the_header(served):
    r = httpx.post(served.url + "/v1/completions", content=json.dumps(OK), timeout=30,
                   headers={"content-type": "text/plain"})
    assert r.status_code == 415 and "Content-Type" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "content-type"


def test_an_assistant_turn_may_have_null_content(served):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    r = post(served, "/v1/chat/completions", OK_CHAT | {"messages": messages})
    assert r.status_code == 200, r.text


def test_models_says_when_it_was_created(served):
    [card] = httpx.get(served.url + "/v1/models").json()["data"]
    assert 0 < card["created"] <= time.time()
    assert httpx.get(served.url + f"/v1/models/{MODEL}").json()["created"] == card["created"]


def test_openapi_documents_what_the_server_answers(served):
    schema = httpx.get(served.url + "/openapi.json").json()
    assert "422" not in json.dumps(schema["paths"])
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"400", "404", "413", "415", "503"} <= set(schema["paths"][path]["post"]["responses"])
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["model"]["minLength"] == 1
    assert all(branch.get("minLength", branch.get("minItems")) == 1 for branch in props["prompt"]["anyOf"])


def test_openai_client_raises_bad_request(served):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="gpt-4", messages=CHAT)


def test_unknown_route_is_openai_shaped(served):
    r = httpx.get(served.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_no_chat_template_is_400(served, monkeypatch):
    def no_template(messages, tools=None, template_kwargs=None, add_generation_prompt=True):
        raise ValueError("this model has no chat template")
    monkeypatch.setattr(served.core, "apply_chat_template", no_template)
    r = post(served, "/v1/chat/completions", OK_CHAT)
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


# What Qwen3's template does with tools and enable_thinking, in a few lines: the byte tokenizer's own ChatML
# template reads neither. It also refuses what Qwen3 would choke on, so that each kind of template error shows.
TOOLS_TEMPLATE = (
    "{% if messages[0]['role'] == 'assistant' %}{{ raise_exception('a chat must not open with the assistant') }}"
    "{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is not boolean %}"
    "{{ raise_exception('enable_thinking must be true or false') }}{% endif %}"
    "{% for tool in tools or [] %}{% if tool['function']['description'] is not defined %}"
    "{{ raise_exception('every tool needs a description') }}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


def test_chat_template_kwargs_and_tools_reach_the_template(served, monkeypatch):
    monkeypatch.setattr(served.engine.tokenizer, "chat_template", TOOLS_TEMPLATE)
    core = served.core
    plain = core.apply_chat_template(CHAT)
    no_thinking = core.apply_chat_template(CHAT, template_kwargs={"enable_thinking": False})
    with_tools = core.apply_chat_template(CHAT, tools=[WEATHER])
    assert no_thinking == plain + "<think>\n\n</think>\n\n"
    assert with_tools.endswith(plain) and json.dumps(WEATHER) in with_tools  # the definition as the client sent it

    def prompt_tokens(text: str) -> int:
        return len(core.tokenize(text, add_special_tokens=False))

    def served_prompt_tokens(**kw) -> int:
        r = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0, **kw)
        assert r.choices[0].message.tool_calls is None  # not parsed: the model's text is the content
        return r.usage.prompt_tokens

    assert served_prompt_tokens() == prompt_tokens(plain)
    assert served_prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == \
        prompt_tokens(no_thinking) > prompt_tokens(plain)
    assert served_prompt_tokens(tools=[WEATHER], tool_choice="auto") == prompt_tokens(with_tools)
    both = core.apply_chat_template(CHAT, tools=[WEATHER], template_kwargs={"enable_thinking": False})
    assert served_prompt_tokens(tools=[WEATHER], extra_body={"chat_template_kwargs": {"enable_thinking": False}}) \
        == prompt_tokens(both)


NO_DESCRIPTION = {"type": "function", "function": {"name": "f"}}
THINKING = {"enable_thinking": False}


@pytest.mark.parametrize("extra,messages,param,says", [
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, CHAT, "chat_template_kwargs", "enable_thinking"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}, "tools": [WEATHER]}, CHAT, "chat_template_kwargs",
     "enable_thinking"),
    ({"chat_template_kwargs": THINKING, "tools": [NO_DESCRIPTION]}, CHAT, "tools", "description"),
    ({"tools": [NO_DESCRIPTION]}, CHAT, "tools", "description"),
    ({"chat_template_kwargs": THINKING, "tools": [WEATHER]}, [{"role": "assistant", "content": "Hello"}],
     "messages", "assistant"),
])
def test_a_template_error_names_the_field_it_is_about(served, monkeypatch, extra, messages, param, says):
    monkeypatch.setattr(served.engine.tokenizer, "chat_template", TOOLS_TEMPLATE)
    r = post(served, "/v1/chat/completions", OK_CHAT | {"messages": messages} | extra)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: ") and says in error["message"]
    assert not error["message"].startswith(f"{param}: {param}:")  # named once


@pytest.mark.parametrize("error,code", [(NoCapacityError("all decode replicas full", retry_after_s=2.5), "no_capacity"),
                                        (ServingError("decode replica died"), "service_error")])
def test_service_errors_are_503(served, monkeypatch, error, code):
    async def refuse(request, direct=None):
        raise error
        yield  # an async generator, like the real one
    monkeypatch.setattr(served.core, "generate", refuse)
    for stream in (False, True):
        r = post(served, "/v1/completions", OK | {"stream": stream})
        assert r.status_code == 503 and r.json()["error"]["code"] == code
        if code == "no_capacity":
            assert r.headers["retry-after"] == "3"


def test_overload_is_429_with_retry_after(served, monkeypatch):
    error = OverloadedError("its first token would come in about 2500 ms", "predicted_ttft", retry_after_s=1.5)

    async def refuse(request, direct=None):
        raise error
        yield  # an async generator, like the real one
    monkeypatch.setattr(served.core, "generate", refuse)
    before = sample(served, "pdserve_requests_total", {"endpoint": "/v1/completions", "status": "429"})
    for stream in (False, True):
        r = post(served, "/v1/completions", OK | {"stream": stream, "priority": 3})
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.json()["error"] == {"message": f"overloaded: {error}; retry after 2 s", "type": "overloaded_error",
                                     "param": None, "code": "overloaded"}
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="Once", max_tokens=4, extra_body={"priority": -1})
    assert e.value.code == "overloaded" and e.value.response.headers["retry-after"] == "2"
    assert sample(served, "pdserve_requests_total", {"endpoint": "/v1/completions", "status": "429"}) == before + 3


def test_error_mid_stream_is_reported_in_stream(served, monkeypatch):
    async def fail_later(request, direct=None):
        yield delta("x", [120])
        raise ServingError("decode replica died")
    monkeypatch.setattr(served.core, "generate", fail_later)
    r = post(served, "/v1/completions", OK | {"stream": True})
    events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert events[0]["choices"][0]["text"] == "x" and events[-1]["error"]["code"] == "service_error"


def test_serves_after_bad_inputs(served):
    want = served.expected["plain"]
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == want.text
    wait_idle(served)


# -- disconnects and concurrency ------------------------------------------------------------------

LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


def test_disconnect_mid_stream_aborts(served):
    before = sample(served, "pdserve_requests_aborted_total", {"role": "router"})
    with httpx.stream("POST", served.url + "/v1/completions", json=LONG | {"stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    wait_idle(served)
    assert sample(served, "pdserve_requests_aborted_total", {"role": "router"}) == before + 1


def test_disconnect_while_waiting_aborts(served):
    before = sample(served, "pdserve_requests_aborted_total", {"role": "router"})
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=1.0))
    # The server notices the closed connection on its own schedule (a loaded machine: seconds).
    deadline = time.time() + 30
    while sample(served, "pdserve_requests_aborted_total", {"role": "router"}) < before + 1 and time.time() < deadline:
        time.sleep(0.2)
    wait_idle(served)
    assert sample(served, "pdserve_requests_aborted_total", {"role": "router"}) == before + 1


def test_concurrent_streams(served):
    def run(prompt: str) -> tuple[str, str]:
        stream = served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True)
        chunks = [c.choices[0] for c in stream]
        return "".join(c.text for c in chunks), chunks[-1].finish_reason

    with ThreadPoolExecutor(len(MANY)) as pool:
        results = list(pool.map(run, MANY))
    assert [text for text, _ in results] == [c.text for c in served.expected["many"]]
    assert all(reason == "length" for _, reason in results)
    wait_idle(served)


# -- vLLM's tokenizer endpoints (router/http_tokens.py) -----------------------------------------------


def test_tokenize_counts_a_prompt_as_completions_does(served):
    tok = served.engine.tokenizer
    r = post(served, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode(PROMPT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == served.engine.max_model_len and body["token_strs"] is None
    usage = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    bare = post(served, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(PROMPT, add_special_tokens=False)
    assert "".join(bare["token_strs"]) == PROMPT


def test_tokenize_renders_a_chat_as_chat_completions_does(served):
    tok = served.engine.tokenizer
    body = post(served, "/tokenize", {"model": MODEL, "messages": CHAT}).json()
    assert body["tokens"] == tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    usage = served.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    assert usage.prompt_tokens == body["count"]
    closed = post(served, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert body["tokens"][:closed["count"]] == closed["tokens"] and closed["count"] < body["count"]


def test_detokenize_gives_back_the_text_and_version_names_the_build(served):
    ids = post(served, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    r = post(served, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}
    import pdserve
    assert httpx.get(served.url + "/version").json() == {"version": pdserve.__version__}


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"model": MODEL}, 400, "messages"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, 400, "messages"),
    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_tokenizer_endpoints_name_the_bad_field(served, path, body, status, param):
    r = post(served, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert post(served, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_vllms_metric_names_count_what_pdserves_count(served):
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[tuple[str, tuple], float]:
        text = httpx.get(served.url + "/metrics").text
        return {(x.name, tuple(sorted(x.labels.items()))): x.value
                for f in text_string_to_metric_families(text) for x in f.samples}

    before = samples()
    served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True})
    after = samples()
    m = (("model_name", MODEL),)

    def grew(name: str, labels: tuple = m) -> float:
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert grew("vllm:request_success_total", (("finished_reason", "length"), ("model_name", MODEL))) == 1
    assert grew("vllm:generation_tokens_total") == 5
    assert grew("vllm:prompt_tokens_total") == len(served.engine.tokenizer.encode(PROMPT))
    assert grew("vllm:time_to_first_token_seconds_count") == grew("pdserve_ttft_seconds_count", ()) == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert grew("vllm:request_max_num_generation_tokens_sum") == 5


def test_vllms_guided_fields_constrain_the_output(served):
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=3,
                                         extra_body={"guided_choice": ["north", "south"]})
    assert r.choices[0].text in ("north", "south") and r.choices[0].finish_reason == "stop"
    r = served.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=3,
                                         extra_body={"guided_regex": "[xyz]{4}"})
    assert len(r.choices[0].text) == 4 and set(r.choices[0].text) <= set("xyz")
