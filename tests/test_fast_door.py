"""The HTTP app's fast door (router/http_fast.py) against the FastAPI app alone, the way every request
took before it: the same requests, over real HTTP, to two servers over one engine, must get the same
status, headers and bytes (ids and timestamps aside), count the same in /metrics, and the door must
take the requests its model validates and hand every other one to the app. A client leaving is
noticed on both ways in; with API keys, a missing or wrong key (401) and a key over its limit (429)
are answered alike on both."""

import json
import math
import random
import re
import struct
import time

import httpx
import pytest
from pydantic_core import from_json

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.router.http_api import build_app
from pdserve.router.http_fast import FastDoor
from pdserve.router.metrics import Metrics
from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest
from pdserve.router.tenants import ApiKey, Tenants, key_digest
from pdserve.router.types import NoCapacityError, ServingError
from local_core import LocalCore, Served
from test_http_api import BAD, MODEL, OK, OK_CHAT, PROMPT
from pdserve.messages import RequestDelta


def delta(text: str, token_ids: list[int], finish_reason: str | None = None, logprobs=()) -> RequestDelta:
    """A core's output for a front end (request id, error and `more` as a worker leaves them)."""
    return RequestDelta("", text, token_ids, finish_reason, None, logprobs)

MAX_BODY = 3 << 19  # 1.5 MiB: the costliest bodies of BAD (1 MB) within it, one over it cheap to send

# Valid bodies: the door takes them (but two), whatever the engine or the limits say of them then.
TAKEN = [
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}),
    ("/v1/completions", OK | {"prompt": [256, 79, 110, 99, 101], "max_tokens": 6, "temperature": 0}),
    ("/v1/completions", OK | {"prompt": [[79, 110, 99, 101]], "max_tokens": 4, "temperature": 0}),  # a batch of one
    ("/v1/completions", OK | {"prompt": ["Once"], "max_tokens": 4, "temperature": 0, "user": "someone"}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1, "stream": True}),
    ("/v1/completions", OK | {"prompt": "abc", "max_tokens": 24, "temperature": 0, "stop": "?"}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.8, "top_p": 0.9, "top_k": 5,
                              "seed": 7, "n": 1, "frequency_penalty": 0, "logit_bias": {}, "echo": False}),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 5, "temperature": 0}),
    ("/v1/chat/completions", OK_CHAT | {"max_completion_tokens": 5, "temperature": 0, "stream": True,
                                        "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]}),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 4, "temperature": 0, "tool_choice": "auto",
                                        "response_format": {"type": "text"}}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "priority": -3}),
    # Several choices (router/http_choices.py), vLLM's sampling parameters.
    ("/v1/completions", OK | {"prompt": [PROMPT, "abc"], "max_tokens": 4, "temperature": 0, "n": 2, "echo": True}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "n": 3, "stream": True,
                              "stream_options": {"include_usage": True}}),
    ("/v1/completions", OK | {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "presence_penalty": 1.5,
                              "repetition_penalty": 1.3, "logit_bias": {"65": 3}, "min_tokens": 2,
                              "stop_token_ids": [66]}),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 4, "temperature": 0, "n": 2, "stream": True}),
    ("/v1/chat/completions", OK_CHAT | {"max_tokens": 4, "temperature": 0, "priority": 7, "stream": True}),
    # Valid bodies the serving path refuses: the door takes them, the app's error handlers answer.
    # (The two with a lone surrogate, which the door's JSON parser does not read, go to the app.)
    ("/v1/completions", OK | {"model": "gpt-4"}),
    ("/v1/completions", OK | {"max_tokens": 5000}),
    ("/v1/completions", OK | {"temperature": -1}),
    ("/v1/completions", OK | {"top_p": 1.5, "stream": True}),
    ("/v1/completions", OK | {"prompt": [100000]}),
    ("/v1/completions", OK | {"prompt": "a" * 5000}),
    ("/v1/completions", OK | {"stop": [""]}),
    ("/v1/completions", OK | {"n": 40}),
    ("/v1/completions", OK | {"logit_bias": {"100000": 1}, "n": 2}),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "\\ud800"}'),
    ("/v1/chat/completions", OK_CHAT | {"model": "nope"}),
    ("/v1/chat/completions", json.dumps(OK_CHAT | {"messages": [{"role": "user", "content": "\ud800"}]}).encode()),
]
# Bodies the model refuses or that are not JSON objects (with those of BAD that are): the app's to answer.
REFUSED = [
    ("/v1/completions", b""),
    ("/v1/completions", b"null"),
    ("/v1/completions", b'"a string"'),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "hi", "max_tokens": Infinity}'),
    ("/v1/completions", b'{"model": "tiny-moe", "prompt": "hi"' + b"\xff}"),  # not UTF-8
    ("/v1/completions", b"[" * 50_000),  # nested past Python's recursion limit
    ("/v1/chat/completions", OK_CHAT | {"stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", OK_CHAT | {"messages": [{"role": "user", "content": 1}]}),
]
MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def taken(path: str, body) -> bool:
    """Whether the door takes the body: its JSON parser reads it and the endpoint's model validates it.
    (A lone UTF-16 surrogate, which json.loads reads and the door's parser does not, goes to the app.)"""
    try:
        MODELS[path].model_validate(from_json(body if isinstance(body, bytes) else json.dumps(body).encode()))
        return True
    except ValueError:
        return False


class Counting:
    """The app behind the door, counting the requests that reach it (by path)."""

    def __init__(self, app):
        self.app, self.paths = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def pair():
    """(door URL, app URL, the door's counter, core, the door's metrics, the app's metrics)."""
    engine = Engine(EngineConfig(model=ModelConfig(path=MODEL), num_kv_blocks=256))
    core, door_metrics, app_metrics = LocalCore(engine, MODEL), Metrics(), Metrics()
    door = build_app(core, door_metrics, MAX_BODY)
    assert isinstance(door, FastDoor)
    counting = door.app = Counting(door.app)
    servers = [Served(door), Served(build_app(core, app_metrics, MAX_BODY).app)]
    try:
        yield servers[0].url, servers[1].url, counting, core, door_metrics, app_metrics
    finally:
        for served in servers:
            served.stop()
        core.close()


_VARYING = re.compile(rb'"(id|created)": ?("[a-z]+-[0-9a-f]+"|\d+)')


def exchange(url: str, path: str, body, headers: dict | list | None = None) -> tuple[int, dict, bytes]:
    """POST -> (status, the headers that matter, the body with ids and timestamps blanked). A callable
    body is sent chunked (no Content-Length)."""
    content = body() if callable(body) else body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, timeout=60,
                   headers={"content-type": "application/json"} if headers is None else headers)
    kept = {k: r.headers.get(k) for k in ("content-type", "content-length", "retry-after", "cache-control",
                                          "www-authenticate", "x-ratelimit-limit-requests",
                                          "x-ratelimit-remaining-requests")}
    return r.status_code, kept, _by_choice(_VARYING.sub(rb'"\1": "-"', r.content))


def _by_choice(body: bytes) -> bytes:
    """A stream's events grouped by choice, each choice's in its order: how the choices of one request
    (n > 1) interleave depends on when each child's tokens come, not on the front end."""
    if not body.startswith(b"data: "):
        return body
    events = body.split(b"\n\n")
    index = [re.search(rb'"index": (\d+)', e) for e in events]
    order = sorted(range(len(events)), key=lambda i: (int(index[i][1]) if index[i] else 1 << 30, i))
    return b"\n\n".join(events[i] for i in order)


def counts(metrics: Metrics) -> dict:
    """Requests answered, by endpoint and status."""
    return {tuple(sorted(s.labels.items())): s.value for family in metrics.requests.collect()
            for s in family.samples if s.name.endswith("_total")}


def same_answers(pair, cases, **kw) -> list[tuple[int, bool]]:
    """Each case to both servers: the same answer, and the same in /metrics; -> (status, went past
    the door to the app) per case."""
    door, app, counting, _, door_metrics, app_metrics = pair
    out = []
    for path, body in cases:
        before = counts(door_metrics), counts(app_metrics), len(counting.paths)
        got, want = exchange(door, path, body, **kw), exchange(app, path, body, **kw)
        assert got == want, (path, body if len(repr(body)) < 300 else "(long)")
        counted = [{k: v - seen.get(k, 0) for k, v in counts(m).items() if v != seen.get(k, 0)}
                   for m, seen in ((door_metrics, before[0]), (app_metrics, before[1]))]
        assert counted[0] == counted[1], (path, body)
        out.append((got[0], len(counting.paths) > before[2]))
    return out


def test_a_valid_body_is_taken_at_the_door_and_answered_as_the_app_would(pair):
    answers = same_answers(pair, TAKEN)
    assert [past for _, past in answers] == [not taken(path, body) for path, body in TAKEN]
    assert sum(past for _, past in answers) == 2  # the two lone surrogates
    statuses = [status for status, _ in answers]
    assert statuses.count(200) == 21 and {404, 400} <= set(statuses)


def test_every_bad_body_is_answered_as_the_app_would(pair):
    cases = [(path, body) for path, body, _, _ in BAD] + REFUSED
    answers = same_answers(pair, cases)
    assert [past for _, past in answers] == [not taken(path, body) for path, body in cases]
    assert [status for status, _ in answers] == [status for _, _, status, _ in BAD] + [400] * len(REFUSED)
    assert sum(past for _, past in answers) >= 40  # most of them: the model's 400s


def test_what_the_door_does_not_read_goes_to_the_app(pair):
    body = OK | {"max_tokens": 3, "temperature": 0}
    raw = json.dumps(body).encode()
    assert same_answers(pair, [("/v1/completions", raw)], headers={"content-type": "text/plain"}) == [(415, True)]
    assert same_answers(pair, [("/v1/completions", raw)], headers={}) == [(400, True)]  # no content type
    twice = [("content-type", "text/plain"), ("content-type", "application/json")]  # read as JSON by one part only
    assert same_answers(pair, [("/v1/completions", raw)], headers=twice)[0][1]
    assert same_answers(pair, [("/v1/completions", raw)], headers=twice[::-1])[0][1]
    assert same_answers(pair, [("/v1/completions", OK | {"prompt": "x" * MAX_BODY})]) == [(413, True)]
    # No Content-Length: a chunked body, read by the app, which counts it against the limit.
    assert same_answers(pair, [("/v1/completions", lambda: iter([raw[:10], raw[10:]]))]) == [(200, True)]
    [(_, past)] = same_answers(pair, [("/v1/completions/", body)])  # not the endpoint's path
    assert past
    r = httpx.get(pair[0] + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]


def test_a_serving_error_is_answered_as_the_app_would(pair, monkeypatch):
    core = pair[3]
    for error in (NoCapacityError("every decode replica is full", retry_after_s=2.5), ServingError("it died"),
                  RuntimeError("a bug")):
        async def refuse(request, direct=None, error=error):
            raise error
            yield  # an async generator, like the real one
        monkeypatch.setattr(core, "generate", refuse)
        for stream in (False, True):
            [(status, past)] = same_answers(pair, [("/v1/completions", OK | {"stream": stream})])
            assert status == (500 if type(error) is RuntimeError else 503) and not past

    async def fail_later(request, direct=None):
        yield delta("x", [120])
        raise ServingError("decode replica died")
    monkeypatch.setattr(core, "generate", fail_later)
    assert same_answers(pair, [("/v1/completions", OK | {"stream": True})]) == [(200, False)]


LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}


@pytest.mark.parametrize("side", [0, 1], ids=["door", "app"])
def test_a_client_leaving_aborts_its_request(pair, side):
    url, metrics = pair[side], pair[4 + side]

    def aborted() -> float:
        return metrics.registry.get_sample_value("pdserve_requests_aborted_total", {"role": "router"}) or 0.0

    before = aborted()
    with httpx.stream("POST", url + "/v1/completions", json=LONG | {"stream": True}, timeout=30) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    with pytest.raises(httpx.ReadTimeout):  # waiting for the whole answer
        httpx.post(url + "/v1/completions", json=LONG, timeout=httpx.Timeout(30, read=1.0))
    deadline = time.monotonic() + 30  # the server notices a closed connection on its own schedule
    while aborted() < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted() == before + 2
    core = pair[3]
    while core._streams and time.monotonic() < deadline:  # both closed in the core: aborted there
        time.sleep(0.1)
    assert not core._streams


# -- API keys: the same check on both ways in ----------------------------------------------------

KEYS = [ApiKey("alpha", key_digest("sk-alpha"), requests_per_minute=1), ApiKey("beta", key_digest("sk-beta"))]


@pytest.fixture(scope="module")
def keyed(pair):
    """As `pair`, over its core, with API keys: each server's Tenants (and buckets) its own."""
    core = pair[3]
    door_metrics, app_metrics = Metrics(), Metrics()
    door = build_app(core, door_metrics, MAX_BODY, Tenants(KEYS, metrics=door_metrics))
    counting = door.app = Counting(door.app)
    servers = [Served(door), Served(build_app(core, app_metrics, MAX_BODY, Tenants(KEYS, metrics=app_metrics)).app)]
    try:
        yield servers[0].url, servers[1].url, counting, core, door_metrics, app_metrics
    finally:
        for served in servers:
            served.stop()


def key_counts(metrics: Metrics) -> dict:
    """Per-key requests and tokens, and the refusals for want of a key."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for counter in (metrics.key_requests, metrics.key_prompt_tokens, metrics.key_generation_tokens,
                            metrics.auth_failures)
            for family in counter.collect() for s in family.samples if s.name.endswith("_total")}


def test_a_key_is_checked_and_limited_alike_on_both_ways_in(keyed):
    json_type = {"content-type": "application/json"}
    body, chat = OK | {"max_tokens": 2, "temperature": 0}, OK_CHAT | {"max_tokens": 2, "temperature": 0}
    cases = [("/v1/completions", body), ("/v1/chat/completions", chat), ("/v1/completions", OK | {"max_tokens": 0})]
    for auth in ({}, {"authorization": "Basic c2stYmV0YQ=="}, {"authorization": "Bearer sk-gamma"},
                 {"authorization": "Bearer"}):
        # Refused at the door, before its body is read: a bad body too is a 401 first.
        assert same_answers(keyed, cases, headers=json_type | auth) == [(401, False)] * 3
        # What the door does not take, the app refuses alike.
        assert same_answers(keyed, [("/v1/completions", json.dumps(body).encode())],
                            headers={"content-type": "text/plain"} | auth) == [(401, True)]
    beta = json_type | {"authorization": "Bearer sk-beta"}
    assert same_answers(keyed, cases, headers=beta) == [(200, False), (200, False), (400, False)]
    assert same_answers(keyed, [("/v1/completions", json.dumps(body).encode())],
                        headers={"content-type": "text/plain", "authorization": "Bearer sk-beta"}) == [(415, True)]
    alpha = json_type | {"authorization": "Bearer sk-alpha"}  # one request a minute
    assert same_answers(keyed, [("/v1/completions", body)] * 3 + [("/v1/chat/completions", chat)],
                        headers=alpha) == [(200, False)] + [(429, False)] * 3
    assert same_answers(keyed, [("/v1/completions", lambda: iter([b"{", json.dumps(body).encode()[1:]]))],
                        headers=alpha) == [(429, True)]  # chunked: the app reads it, and refuses it alike
    door_metrics, app_metrics = keyed[4], keyed[5]
    assert key_counts(door_metrics) == key_counts(app_metrics)
    assert door_metrics.registry.get_sample_value("pdserve_api_key_requests_total",
                                                  {"key": "alpha", "outcome": "rate_limited"}) == 4
    assert door_metrics.registry.get_sample_value("pdserve_auth_failures_total", {"reason": "missing"}) == 12


# -- the door's JSON parser against the app's ------------------------------------------------------


def _same(a, b) -> bool:
    """Equal values of the same types, floats to the bit (NaN, -0.0), keys in the same order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


EDGES = [b'{"a":"x\ny"}', b'"\x01"', b"{} x", b"\xef\xbb\xbf{}", '{"a":1}'.encode("utf-16"), b"01", b"1.", b".5",
         b"+1", b"-0.0", b"1e400", b"-1e400", b"NaN", b"-Infinity", b"nan", b'"\\x"', b'"\\u12"', b'"\xff"',
         b'"\xed\xa0\x80"', b'"\\ud800"', b'"\\ud800\\udc00"', b'"\\uDFFF"', b'"\\u0000"', b"[1,]", b'{"a":1,}',
         b"True", b"\x00{}", b"{}\x00", b"\x0c[1]", b"123456789012345678901234567890", b"2.4703282292062327e-324",
         b"9007199254740993.0", b"1.7976931348623159e308", b"[" * 3000 + b"]" * 3000, b'{"a":1,"a":2}',
         b"[00]", b"[-01]", b"[0E-0]", b"[1.0e]"]


def test_the_doors_parser_reads_nothing_the_apps_would_not_read_alike():
    """pydantic-core's from_json (the door's) against json.loads (the app's): whatever the first takes,
    the second takes too and reads as the same values. (What from_json refuses goes to the app.)"""
    rng = random.Random(0)
    alphabet = b'{}[]":,0123456789.-+eEtrufalsn \\u\n\t\xc3\xa9\xff\x00abNI'
    cases = EDGES + [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(20_000)]
    valid = bytearray(json.dumps(OK | {"prompt": [1, 2, 300], "temperature": 0.7, "stop": ["é", "x\\"]}).encode())
    for _ in range(5_000):  # a body with a few bytes changed, added or lost
        body = bytearray(valid)
        for _ in range(rng.randint(1, 3)):
            i, op = rng.randrange(len(body)), rng.random()
            if op < 0.4:
                body[i] = rng.choice(alphabet)
            elif op < 0.7:
                del body[i]
            else:
                body.insert(i, rng.choice(alphabet))
        cases.append(bytes(body))
    taken = 0
    for case in cases:
        try:
            door = from_json(case)
        except ValueError:
            continue
        taken += 1
        app = json.loads(case)  # raises if the door took what the app refuses
        assert _same(door, app), case
    assert taken > 1_000
