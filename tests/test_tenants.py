"""API keys, per-key rate limits, per-key metrics and TLS (router/tenants.py, rate_limits.py,
http_auth.py, tls.py). The keys file and PDSERVE_API_KEYS are checked naming the entry; the token
buckets run on a clock the test moves, so that every figure is exact; then for real over a LocalCore
on tiny-moe: the openai client and raw HTTP (401, 429 with Retry-After and x-ratelimit-*, another key
served meanwhile, refunds, per-key metrics), gRPC stubs (UNAUTHENTICATED, RESOURCE_EXHAUSTED with
retry-after), HTTPS and gRPC over TLS with a CA made here (trustme). `pdserve up` with a keys file and
the variable: tests/test_tenant_cluster.py."""

import hashlib
import math
import ssl
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import httpx
import openai
import pytest
import trustme
import yaml
from cryptography.hazmat.primitives import serialization

from pdserve.config import ClusterConfig, ConfigError, EngineConfig, ModelConfig, RouterConfig, load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.protocol import InvalidRequestError
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2 as pb
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2_grpc as pb_grpc
from pdserve.router.grpc_server import GrpcLimits, start_grpc_server
from pdserve.router.http_api import build_app
from pdserve.router.metrics import Metrics
from pdserve.router.rate_limits import KeyLimits, RateLimited, duration
from pdserve.router.tenants import ApiKey, Tenants, Unauthenticated, key_digest, load_api_keys
from pdserve.router.tls import check_tls, grpc_credentials, uvicorn_options
from pdserve.router import types as types_module
from pdserve.router.types import DEFAULT_MAX_TOKENIZE_QUEUE, NoCapacityError, limit_tokenize_queue
from local_core import LocalCore, Served
from serving_cluster import until
from test_grpc_api import LoopThread

MODEL = "tiny-moe"
PROMPT = "Once upon a time"
STOP_PROMPT = "abc"  # its greedy text has a "?" after a few tokens (test_http_api)
ALPHA = ApiKey("alpha", key_digest("sk-alpha"), tokens_per_minute=120)
BETA = ApiKey("beta", key_digest("sk-beta"), priority=3)
GAMMA = ApiKey("gamma", key_digest("sk-gamma"), requests_per_minute=2)
OPS = ApiKey("ops", key_digest("sk-ops"), admin=True)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Keyed:
    url: str
    metrics: Metrics
    tenants: Tenants
    clock: Clock

    def client(self, key: str | None, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kw)

    def sample(self, name: str, **labels) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def core():
    core = LocalCore(Engine(EngineConfig(model=ModelConfig(path=MODEL), num_kv_blocks=256)), MODEL)
    yield core
    core.close()


@pytest.fixture
def serve(core):
    """serve(*keys) -> Keyed: the app over `core` with these keys (fresh buckets, a clock of its own)."""
    servers = []

    def start(*keys: ApiKey, **uvicorn_config) -> Keyed:
        clock, metrics = Clock(), Metrics()
        tenants = Tenants(list(keys), metrics=metrics, clock=clock)
        servers.append(Served(build_app(core, metrics, tenants=tenants), **uvicorn_config))
        return Keyed(servers[-1].url, metrics, tenants, clock)

    yield start
    for served in servers:
        served.stop()


def prompt_tokens(core) -> int:
    return len(core.tokenize(PROMPT))


def complete(client: openai.OpenAI, max_tokens: int, prompt: str = PROMPT, **kw):
    """The raw response (its headers) of a greedy completion that generates all of max_tokens."""
    return client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, extra_body={"ignore_eos": True}, **kw)


# -- the keys, as configured ----------------------------------------------------------------------


def test_a_keys_file_and_the_variable_give_names_hashes_limits_and_priorities(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"keys": [
        {"name": "team-a", "key": "sk-team-a-0123", "requests_per_minute": 600, "tokens_per_minute": 90000,
         "priority": 2},
        {"name": "batch", "key": "sk-batch-4567"}]}))
    keys = load_api_keys(str(path), "ops:sk-ops, sk-anon ", routers=1)
    assert [(k.name, k.requests_per_minute, k.tokens_per_minute, k.priority) for k in keys] == [
        ("team-a", 600, 90000, 2), ("batch", None, None, 0), ("ops", None, None, 0), ("env-2", None, None, 0)]
    assert [k.digest for k in keys] == [hashlib.sha256(k).digest() for k in (b"sk-team-a-0123", b"sk-batch-4567",
                                                                          b"sk-ops", b"sk-anon")]
    assert "sk-" not in repr(keys)  # what travels to the routers holds no key
    assert load_api_keys(None, None) == []  # nothing configured: the service stays open
    tenants = Tenants(keys)
    assert tenants.authenticate("Bearer sk-team-a-0123").priority == 2  # the key's default priority
    assert tenants.authenticate("bearer  sk-anon").name == "env-2"  # the scheme is case-insensitive
    for header, reason in ((None, "missing"), ("", "missing"), ("Basic c2stb3Bz", "missing"), ("Bearer", "missing"),
                           ("Bearer sk-team-a-012", "invalid"), ("Bearer sk-team-a-01234", "invalid")):
        with pytest.raises(Unauthenticated) as e:
            tenants.authenticate(header)
        assert e.value.reason == reason


BAD_FILES = [  # (the file's text, what the error says)
    ("[1, 2]", "must be a mapping with one key, keys"),
    ("keys: []", "must be a mapping with one key, keys"),
    ("keys: [{name: a, key: sk-a}]\nextra: 1", "must be a mapping with one key, keys"),
    ("keys: [sk-a]", "keys[0]: must be a mapping with name and key"),
    ("keys: [{name: a}]", "keys[0] (name 'a'): key: missing"),
    ("keys: [{name: a, key: sk-a}, {name: b, key: 'sk b'}]", "keys[1] (name 'b'): key: must be a non-empty string"),
    ("keys: [{name: a, key: sk-a, requests_per_minute: 0}]",
     "keys[0] (name 'a'): requests_per_minute: 0 is not allowed"),
    ("keys: [{name: a, key: sk-a, tokens_per_minute: '1000'}]", "keys[0] (name 'a'): tokens_per_minute: '1000'"),
    ("keys: [{name: a, key: sk-a, priority: high}]", "keys[0] (name 'a'): priority: 'high' is not allowed"),
    ("keys: [{name: a, key: sk-a, rpm: 5}]", "keys[0] (name 'a'): rpm: unknown field (allowed: name, key, "),
    ("keys: [{name: 'a b', key: sk-a}]", "keys[0] (name 'a b'): name: 'a b' is not allowed — must be 1 to 64"),
    ("keys: [{name: a, key: sk-a}, {name: a, key: sk-b}]", "keys[1] (name 'a'): name 'a' is taken by "),
    ("keys: [{name: a, key: sk-a}, {name: b, key: sk-a}]", "keys[1] (name 'b'): its key is the key of "),
    ("keys: [{name: a, key: sk-a, requests_per_minute: 1}]",
     "keys[0] (name 'a'): requests_per_minute: 1 is not allowed — router.replicas is 2"),
    ("keys: {", "not valid YAML"),
]


@pytest.mark.parametrize("text, says", BAD_FILES)
def test_a_bad_keys_file_fails_naming_the_entry_never_the_key(tmp_path, text, says):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_api_keys(str(path), None, routers=2)
    message = str(e.value)
    assert message.startswith(f"router.api_keys_file: {path}: ") and says in message, message
    assert "sk-a" not in message and "sk b" not in message


def test_a_bad_variable_or_a_missing_file_fails_naming_it(tmp_path):
    for env, says in (("sk-a,,sk-b", "PDSERVE_API_KEYS: entry 2 is empty"),
                      ("", "PDSERVE_API_KEYS: entry 1 is empty"),  # set but empty: refused, never open by mistake
                      ("a:sk-a,a:sk-b", "PDSERVE_API_KEYS: entry 2 (name 'a'): name 'a' is taken by "
                                        "PDSERVE_API_KEYS: entry 1 (name 'a')"),
                      ("sk-a,x:sk-a", "PDSERVE_API_KEYS: entry 2 (name 'x'): its key is the key of "
                                      "PDSERVE_API_KEYS: entry 1 (name 'env-1') too"),
                      ("a:sk a", "PDSERVE_API_KEYS: entry 1 (name 'a'): key: must be")):
        with pytest.raises(ConfigError) as e:
            load_api_keys(None, env)
        assert says in str(e.value) and "sk-a" not in str(e.value), str(e.value)
    path = tmp_path / "keys.yaml"
    path.write_text("keys: [{name: a, key: sk-a}]")
    with pytest.raises(ConfigError, match="PDSERVE_API_KEYS: entry 1 \\(name 'a'\\): name 'a' is taken by "
                                          "router.api_keys_file"):
        load_api_keys(str(path), "a:sk-other")
    with pytest.raises(ConfigError, match=f"router.api_keys_file: {tmp_path / 'none.yaml'}: no such file"):
        load_api_keys(str(tmp_path / "none.yaml"), None)


def test_pdserve_up_refuses_a_bad_keys_file_before_anything_starts(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: [{name: a, key: sk-a, tokens_per_minute: -5}]")
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump({"router": {"api_keys_file": str(keys), "http_port": 0, "grpc_port": None},
                                       "kv_transfer": {"backend": "tcp"}}))
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", str(cluster)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "starting Ray" not in r.stderr, r.stderr
    assert f"router.api_keys_file: {keys}: keys[0] (name 'a'): tokens_per_minute: -5 is not allowed" in r.stderr


# -- the buckets, on a clock the test moves -------------------------------------------------------


def test_token_buckets_charge_refill_refund_and_say_when():
    clock = Clock()
    limits = KeyLimits("k", requests_per_minute=3, tokens_per_minute=600, clock=clock)  # 10 tokens/s
    assert limits.charge(100, 100, "prompt", "max_tokens") == {
        "x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2", "x-ratelimit-reset-requests": "20s",
        "x-ratelimit-limit-tokens": "600", "x-ratelimit-remaining-tokens": "400", "x-ratelimit-reset-tokens": "20s"}
    limits.charge(100, 200, "prompt", "max_tokens")  # 100 tokens left
    with pytest.raises(RateLimited) as e:
        limits.charge(50, 100, "prompt", "max_tokens")  # 150 needed: 5 s away
    assert e.value.limit == "tokens" and e.value.retry_after_s == 5.0 and e.value.headers["Retry-After"] == "5"
    assert e.value.headers["x-ratelimit-remaining-tokens"] == "100"
    assert "tokens per minute" in str(e.value) and "tokens_per_minute 600: requested 150, remaining 100" in str(e.value)
    limits.refund(40)  # a request that used 40 fewer tokens than its max_tokens
    clock.advance(1)  # +10
    assert limits.charge(50, 100, "prompt", "max_tokens")["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimited) as e:  # the requests bucket is empty too, and frees last: it names the error
        limits.charge(1, 1, "prompt", "max_tokens")
    assert e.value.limit == "requests" and e.value.headers["Retry-After"] == str(math.ceil(20 - 1))
    assert "on requests and tokens per minute" in str(e.value)
    limits.refund(10_000)
    assert limits.tokens.level == 600  # never past the capacity
    clock.advance(20)  # one request back every 20 s
    limits.requests.refill()
    assert limits.headers()["x-ratelimit-remaining-requests"] == "1"
    # More than the whole bucket: a 400 naming the field to lower, since no wait could help.
    with pytest.raises(InvalidRequestError) as e:
        limits.charge(100, 501, "prompt", "max_completion_tokens")
    assert e.value.param == "max_completion_tokens" and "can never fit" in str(e.value)
    assert "set max_completion_tokens to at most 500" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        limits.charge(600, 1, "messages", "max_tokens")
    assert e.value.param == "messages" and "the prompt alone is too long" in str(e.value)


def test_several_routers_each_enforce_their_share():
    clock = Clock()
    limits = KeyLimits("k", requests_per_minute=60, tokens_per_minute=900, routers=3, clock=clock)
    headers = limits.charge(10, 290, "prompt", "max_tokens")
    assert headers["x-ratelimit-limit-requests"] == "20" and headers["x-ratelimit-limit-tokens"] == "300"
    assert headers["x-ratelimit-remaining-tokens"] == "0" and headers["x-ratelimit-reset-tokens"] == "1m0s"
    with pytest.raises(RateLimited, match=r"tokens_per_minute 900 \(this router's share of 3: 300\)"):
        limits.charge(1, 1, "prompt", "max_tokens")
    with pytest.raises(InvalidRequestError, match="set max_tokens to at most 290"):
        limits.charge(10, 291, "prompt", "max_tokens")
    assert [duration(s) for s in (0.0004, 0.25, 1, 1.5, 59.5, 60, 360.25)] == [
        "1ms", "250ms", "1s", "1.5s", "59.5s", "1m0s", "6m0.25s"]


# -- HTTP -----------------------------------------------------------------------------------------


def test_a_missing_or_wrong_key_is_401_health_stays_open_and_metrics_take_an_admin_key(serve, core):
    s = serve(ALPHA, BETA, OPS)
    with pytest.raises(openai.AuthenticationError) as e:
        s.client("sk-wrong").completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        s.client("sk-wrong").models.list()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    for path, headers in (("/v1/completions", {}), ("/v1/chat/completions", {"authorization": "Basic c2stYmV0YQ=="}),
                          ("/v1/completions", {"authorization": "Bearer sk-beta2"})):
        r = httpx.post(s.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
        assert error["param"] is None and error["message"]
    for path in ("/v1/models", "/v1/models/tiny-moe", "/v1/nothing-here"):
        assert httpx.get(s.url + path, timeout=30).status_code == 401
    assert s.client("sk-beta").models.list().data[0].id == MODEL
    assert httpx.get(s.url + "/health", timeout=30).status_code == 200
    # The operators' endpoints name tenants, replicas and their prefix-cache hits: an admin key's.
    for path in ("/metrics", "/dashboard", "/dashboard/data"):
        r = httpx.get(s.url + path, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        r = httpx.get(s.url + path, headers={"authorization": "Bearer sk-beta"}, timeout=30)
        assert r.status_code == 403 and "'beta' is not an admin key" in r.json()["error"]["message"], path
    assert httpx.get(s.url + "/dashboard/data", headers={"authorization": "Bearer sk-ops"}, timeout=30).is_success
    # vLLM's tokenizer endpoints run text through the threads every tenant shares: a key's too.
    assert httpx.post(s.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).status_code == 401
    r = httpx.post(s.url + "/tokenize", json={"prompt": PROMPT}, headers={"authorization": "Bearer sk-beta"}, timeout=30)
    assert r.json()["count"] == len(core.tokenize(PROMPT))
    text = httpx.get(s.url + "/metrics", headers={"authorization": "Bearer sk-ops"}, timeout=30).text
    assert 'pdserve_auth_failures_total{reason="missing"} 9.0' in text
    assert 'pdserve_auth_failures_total{reason="invalid"} 3.0' in text
    assert 'pdserve_requests_total{endpoint="/v1/completions",status="401"} 3.0' in text
    assert 'pdserve_requests_total{endpoint="/v1/chat/completions",status="401"} 1.0' in text
    assert "sk-alpha" not in text and "sk-beta" not in text
    r = complete(s.client("sk-beta"), 3)
    assert r.http_response.status_code == 200 and r.parse().usage.completion_tokens == 3
    assert not any(h.startswith("x-ratelimit") for h in r.headers)  # beta has no limits


def test_a_key_over_its_token_limit_gets_429_while_another_is_served(serve, core):
    s = serve(ALPHA, BETA)
    p = prompt_tokens(core)
    alpha, beta = s.client("sk-alpha"), s.client("sk-beta")
    n = 50 - p  # each request is charged 50 of alpha's 120 tokens a minute
    for left in (70, 20):
        r = complete(alpha, n)
        assert r.parse().usage.completion_tokens == n
        assert r.headers["x-ratelimit-limit-tokens"] == "120"
        assert r.headers["x-ratelimit-remaining-tokens"] == str(left)
    with pytest.raises(openai.RateLimitError) as e:
        complete(alpha, n)
    r = e.value.response
    assert r.status_code == 429
    assert r.headers["retry-after"] == "15"  # 30 tokens short, refilled at 2 a second
    assert r.headers["x-ratelimit-remaining-tokens"] == "20" and r.headers["x-ratelimit-reset-tokens"] == "50s"
    error = r.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens" and error["param"] is None
    assert "'alpha' on tokens per minute" in error["message"] and "requested 50, remaining 20" in error["message"]
    # Another key is served meanwhile, and so is alpha once its bucket holds enough.
    assert complete(beta, n).parse().usage.completion_tokens == n
    with pytest.raises(openai.RateLimitError):
        complete(alpha, n, stream=True)
    s.clock.advance(14.5)
    with pytest.raises(openai.RateLimitError) as e:
        complete(alpha, n)
    assert e.value.response.headers["retry-after"] == "1"  # 0.5 s, in whole seconds
    s.clock.advance(0.5)
    assert complete(alpha, n).headers["x-ratelimit-remaining-tokens"] == "0"
    assert s.sample("pdserve_api_key_requests_total", key="alpha", outcome="rate_limited") == 3
    assert s.sample("pdserve_api_key_requests_total", key="alpha", outcome="ok") == 3
    assert s.sample("pdserve_api_key_requests_total", key="beta", outcome="ok") == 1
    assert s.sample("pdserve_api_key_prompt_tokens_total", key="alpha") == 3 * p
    assert s.sample("pdserve_api_key_generation_tokens_total", key="alpha") == 3 * n
    assert s.sample("pdserve_api_key_generation_tokens_total", key="beta") == n
    assert s.sample("pdserve_requests_total", endpoint="/v1/completions", status="429") == 3


def test_a_key_over_its_request_limit_gets_429_naming_it(serve):
    s = serve(GAMMA)
    gamma = s.client("sk-gamma")
    first = complete(gamma, 2)
    assert (first.headers["x-ratelimit-limit-requests"], first.headers["x-ratelimit-remaining-requests"]) == ("2", "1")
    chat = gamma.chat.completions.with_raw_response.create(model=MODEL, max_tokens=2,
                                                           messages=[{"role": "user", "content": "Hi"}])
    assert chat.headers["x-ratelimit-remaining-requests"] == "0"
    assert chat.headers["x-ratelimit-reset-requests"] == "1m0s"
    assert "x-ratelimit-limit-tokens" not in chat.headers  # gamma has no token limit
    with pytest.raises(openai.RateLimitError) as e:
        complete(gamma, 2)
    r = e.value.response
    assert r.headers["retry-after"] == "30" and r.json()["error"]["type"] == "requests"
    assert "on requests per minute — requests_per_minute 2: requested 1, remaining 0" in r.json()["error"]["message"]
    s.clock.advance(30)
    assert complete(gamma, 2).headers["x-ratelimit-remaining-requests"] == "0"


def test_unused_tokens_come_back_when_a_request_ends(serve, core, monkeypatch):
    s = serve(ALPHA)
    alpha = s.client("sk-alpha")
    p, stop_p = prompt_tokens(core), len(core.tokenize(STOP_PROMPT))
    r = alpha.completions.with_raw_response.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=40, temperature=0,
                                                   stop=["?"])
    assert r.headers["x-ratelimit-remaining-tokens"] == str(120 - stop_p - 40)
    used = r.parse().usage.completion_tokens
    assert 0 < used < 40 and r.parse().choices[0].finish_reason == "stop"
    left = 120 - stop_p - used  # the 40 - used tokens it did not generate came back
    # The same through a stream (whose tokens the front end may write straight from the core).
    chunks = list(alpha.completions.create(model=MODEL, prompt=STOP_PROMPT, max_tokens=40, temperature=0, stop=["?"],
                                           stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.parse().choices[0].text
    left -= stop_p + used
    assert complete(alpha, 2).headers["x-ratelimit-remaining-tokens"] == str(left - p - 2)
    left -= p + 2
    # A request the service refuses before its first token gets all its tokens back (its request stays charged).
    async def full(request, direct=None):
        raise NoCapacityError("every decode replica is full")
        yield

    monkeypatch.setattr(core, "generate", full)
    with pytest.raises(openai.InternalServerError):
        complete(alpha, 10)
    monkeypatch.undo()
    assert complete(alpha, 2).headers["x-ratelimit-remaining-tokens"] == str(left - p - 2)
    assert s.sample("pdserve_api_key_requests_total", key="alpha", outcome="error") == 1
    assert s.sample("pdserve_api_key_requests_total", key="alpha", outcome="ok") == 4
    assert s.sample("pdserve_api_key_generation_tokens_total", key="alpha") == 2 * used + 4


def test_a_request_that_can_never_fit_is_400_naming_the_field(serve, core):
    s = serve(ALPHA)
    alpha = s.client("sk-alpha")
    p = prompt_tokens(core)
    with pytest.raises(openai.BadRequestError) as e:
        alpha.completions.create(model=MODEL, prompt=PROMPT, max_tokens=121 - p)
    error = e.value.response.json()["error"]
    assert error["param"] == "max_tokens"
    assert "can never fit the tokens_per_minute 120 of API key 'alpha'" in error["message"]
    assert f"set max_tokens to at most {120 - p}" in error["message"]
    # A chat with no max_tokens is charged the rest of the context, as OpenAI counts it: it says what to set.
    with pytest.raises(openai.BadRequestError) as e:
        alpha.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.response.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        alpha.completions.create(model=MODEL, prompt="x" * 200, max_tokens=1)
    assert e.value.response.json()["error"]["param"] == "prompt"
    assert s.sample("pdserve_api_key_requests_total", key="alpha", outcome="rate_limited") == 3
    assert complete(alpha, 120 - p).headers["x-ratelimit-remaining-tokens"] == "0"  # nothing was charged


def test_a_request_takes_its_keys_priority_or_a_worse_one_never_a_better(serve, core):
    keyed = serve(ALPHA, BETA)
    # (lower is better) A request asking for a better priority than its key's gets its key's: it
    # would otherwise displace other tenants' queued requests and preempt their running ones.
    for key, extra, want in [("sk-beta", {}, 3), ("sk-beta", {"priority": -1}, 3),
                             ("sk-beta", {"priority": -2**31}, 3), ("sk-beta", {"priority": 7}, 7),
                             ("sk-alpha", {}, 0), ("sk-alpha", {"priority": -5}, 0)]:
        keyed.client(key).completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, extra_body=extra)
        assert core.priorities[-1] == want, (key, extra)
        keyed.client(key).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=1, extra_body=extra)
        assert core.priorities[-1] == want, (key, extra)


def test_a_key_is_charged_before_its_prompt_is_tokenized(serve, core, monkeypatch):
    s = serve(GAMMA)  # 2 requests a minute
    tokenized = []
    real = core.tokenize
    monkeypatch.setattr(core, "tokenize", lambda text, **kw: tokenized.append(text) or real(text, **kw))
    gamma = s.client("sk-gamma")
    for _ in range(2):
        complete(gamma, 2)
    assert len(tokenized) == 2
    long_prompt = "many words " * 300  # (within the context: only the key can refuse it)
    for chat in (False, True):
        with pytest.raises(openai.RateLimitError) as e:
            if chat:
                gamma.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}],
                                              max_tokens=2)
            else:
                complete(gamma, 2, prompt=long_prompt)
        assert e.value.response.json()["error"]["type"] == "requests"
    assert len(tokenized) == 2  # a key out of requests has none of its prompts tokenized


CAPPED = ApiKey("capped", key_digest("sk-capped"), max_concurrent=1)


def test_a_key_over_its_concurrency_cap_gets_429_while_another_is_served(serve, core):
    s = serve(CAPPED, BETA)
    capped = s.client("sk-capped")
    tenant = s.tenants.authenticate("Bearer sk-capped")
    stream = capped.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))  # in flight now
    assert first.choices[0].text is not None and tenant.in_flight == 1
    with pytest.raises(openai.RateLimitError) as e:
        complete(capped, 2)
    error = e.value.response.json()["error"]
    assert "'capped' has 1 requests in flight" in error["message"] and "max_concurrent" in error["message"]
    assert e.value.response.headers["retry-after"] == "1"
    assert complete(s.client("sk-beta"), 2).parse().usage.completion_tokens == 2  # another key meanwhile
    stream.close()  # the client leaves: its place comes back
    until(lambda: tenant.in_flight == 0, what="the stream's place back under the cap")
    assert complete(capped, 2).parse().usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError):  # refused before it is served: its place comes back too
        complete(capped, 2, top_p=-1)
    assert tenant.in_flight == 0
    assert s.sample("pdserve_api_key_requests_total", key="capped", outcome="rate_limited") == 1


def test_a_full_tokenizer_queue_is_429(serve, core, monkeypatch):
    s = serve(BETA)
    release = threading.Event()
    real = core.tokenize
    monkeypatch.setattr(core, "tokenize", lambda text, **kw: release.wait(30) and real(text, **kw))
    limit_tokenize_queue(2)
    try:
        with ThreadPoolExecutor(2) as pool:
            held = [pool.submit(complete, s.client("sk-beta"), 2) for _ in range(2)]
            until(lambda: types_module._queue.queued == 2, what="two prompts on the tokenizer")
            with pytest.raises(openai.RateLimitError) as e:
                complete(s.client("sk-beta"), 2)
            assert "tokenizer queue is full" in e.value.response.json()["error"]["message"]
            assert "router.max_tokenize_queue" in e.value.response.json()["error"]["message"]
            release.set()
            assert [f.result(timeout=60).parse().usage.completion_tokens for f in held] == [2, 2]
    finally:
        release.set()
        limit_tokenize_queue(DEFAULT_MAX_TOKENIZE_QUEUE)


def test_keys_hash_their_prompts_apart_unless_they_share_a_group(serve, core):
    """The prefix cache salted per key (vLLM's cache_salt): the same prompt under another key finds
    none of the first key's blocks; under the same key, or a key of its cache_group, it hits."""
    a1 = ApiKey("a1", key_digest("sk-a1"), cache_group="team-a")
    a2 = ApiKey("a2", key_digest("sk-a2"), cache_group="team-a")
    s = serve(a1, a2, BETA)
    prompt = " ".join(f"w{i}" for i in range(200))  # many full blocks
    profile = core.engine.scheduler.profile
    hits = []
    for key, extra in (("sk-a1", {}), ("sk-beta", {}), ("sk-a1", {}), ("sk-a2", {}), ("sk-beta", {}),
                       ("sk-a1", {"cache_salt": "mine"}), ("sk-a1", {"cache_salt": "mine"})):
        before = profile.prefix_hits
        s.client(key).completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body=extra)
        hits.append(profile.prefix_hits - before)  # (the request has ended: the engine is idle)
    assert hits[0] == 0 and hits[1] == 0  # beta does not find a1's prompt
    assert hits[2] > 0 and hits[3] == hits[2]  # a1 again, and a2 of its group, do
    assert hits[4] == hits[2]  # beta's own, second time
    assert hits[5] == 0 and hits[6] == hits[2]  # a request's own salt splits its key's cache


def test_keys_from_the_variable_are_served_under_their_names(serve):
    s = serve(*load_api_keys(None, "ops:sk-ops,sk-anon"))
    assert complete(s.client("sk-anon"), 2).parse().usage.completion_tokens == 2
    assert complete(s.client("sk-ops"), 3).parse().usage.completion_tokens == 3
    with pytest.raises(openai.AuthenticationError):
        s.client("ops:sk-ops").models.list()
    assert s.sample("pdserve_api_key_generation_tokens_total", key="env-2") == 2
    assert s.sample("pdserve_api_key_generation_tokens_total", key="ops") == 3


# -- gRPC -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def bearer(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


def test_grpc_takes_the_key_from_metadata(core, loop):
    clock, metrics = Clock(), Metrics()
    tenants = Tenants([ALPHA, BETA, GAMMA], metrics=metrics, clock=clock)
    server = loop.run(start_grpc_server(core, 0, host="127.0.0.1", tenants=tenants,
                                        limits=GrpcLimits.of(RouterConfig(), tenants)))
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stub = pb_grpc.CompletionStub(channel)
    request = pb.CompletionRequest(prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True)
    try:
        for metadata in ((), bearer("sk-nope"), (("authorization", "sk-beta"),)):
            for call in (stub.Complete, lambda r, **kw: list(stub.CompleteStream(r, **kw))):
                with pytest.raises(grpc.RpcError) as e:
                    call(request, timeout=30, metadata=metadata)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
        assert stub.Complete(request, timeout=30, metadata=bearer("sk-beta")).usage.completion_tokens == 3
        assert core.priorities[-1] == 3  # unset: beta's default
        for own, want in ((-1, 3), (0, 3), (-2**31, 3), (5, 5)):  # never better than beta's own 3
            stub.Complete(pb.CompletionRequest(prompt=PROMPT, max_tokens=1, priority=own), timeout=30,
                          metadata=bearer("sk-beta"))
            assert core.priorities[-1] == want, own
        chunks = list(stub.CompleteStream(request, timeout=30, metadata=bearer("sk-gamma")))
        assert chunks[-1].usage.completion_tokens == 3
        stub.Complete(request, timeout=30, metadata=bearer("sk-gamma"))
        with pytest.raises(grpc.RpcError) as e:  # gamma: 2 requests a minute
            stub.Complete(request, timeout=30, metadata=bearer("sk-gamma"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests per minute" in e.value.details()
        trailing = dict(e.value.trailing_metadata())
        assert trailing["retry-after"] == "30" and trailing["grpc-retry-pushback-ms"] == "30000"
        assert stub.Complete(request, timeout=30, metadata=bearer("sk-beta")).usage.completion_tokens == 3
        # Alpha's tokens: a stream that never fits is INVALID_ARGUMENT naming max_tokens.
        with pytest.raises(grpc.RpcError) as e:
            list(stub.CompleteStream(pb.CompletionRequest(prompt=PROMPT, max_tokens=200), timeout=30,
                                     metadata=bearer("sk-alpha")))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("max_tokens:")
        # Health stays open; reflection (a map of the API) is off with keys (router.grpc_reflection unset).
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30))
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        channel.close()
        loop.run(server.stop(None))
    value = lambda name, **labels: metrics.registry.get_sample_value(name, labels) or 0.0  # noqa: E731
    assert value("pdserve_auth_failures_total", reason="missing") == 4
    assert value("pdserve_auth_failures_total", reason="invalid") == 2
    assert value("pdserve_api_key_requests_total", key="gamma", outcome="ok") == 2
    assert value("pdserve_api_key_requests_total", key="gamma", outcome="rate_limited") == 1
    assert value("pdserve_api_key_requests_total", key="alpha", outcome="rate_limited") == 1
    assert value("pdserve_api_key_generation_tokens_total", key="beta") == 3 + 4 * 1 + 3
    assert value("pdserve_api_key_prompt_tokens_total", key="gamma") == 2 * prompt_tokens(core)


# -- TLS ------------------------------------------------------------------------------------------


def test_grpc_salts_a_calls_prefix_cache_by_key_and_its_own_cache_salt(core, loop):
    a1 = ApiKey("a1", key_digest("sk-a1"), cache_group="team-a")
    a2 = ApiKey("a2", key_digest("sk-a2"), cache_group="team-a")
    server = loop.run(start_grpc_server(core, 0, host="127.0.0.1", tenants=Tenants([a1, a2, BETA])))
    prompt = " ".join(f"g{i}" for i in range(200))
    profile = core.engine.scheduler.profile
    hits = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.CompletionStub(channel)
            for key, salt in (("sk-a1", None), ("sk-beta", None), ("sk-a2", None), ("sk-a1", "x"), ("sk-a1", "x")):
                before = profile.prefix_hits
                stub.Complete(pb.CompletionRequest(prompt=prompt, max_tokens=1, cache_salt=salt), timeout=60,
                              metadata=bearer(key))
                hits.append(profile.prefix_hits - before)
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(pb.CompletionRequest(prompt=prompt, max_tokens=1, cache_salt=""), timeout=60,
                              metadata=bearer("sk-a1"))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("cache_salt:")
    finally:
        loop.run(server.stop(None))
    assert hits[0] == 0 and hits[1] == 0 and hits[2] > 0  # beta misses a1's prompt; a2 of a1's group hits
    assert hits[3] == 0 and hits[4] == hits[2]  # a call's own salt: a cache of its own


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """(CA certificate path, server certificate chain path, server key path) for localhost and 127.0.0.1."""
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    d = tmp_path_factory.mktemp("tls")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    cert.private_key_pem.write_to_path(str(d / "key.pem"))
    cert.cert_chain_pems[0].write_to_path(str(d / "cert.pem"))
    for pem in cert.cert_chain_pems[1:]:
        pem.write_to_path(str(d / "cert.pem"), append=True)
    other = ca.issue_cert("localhost")
    other.private_key_pem.write_to_path(str(d / "other-key.pem"))
    key = serialization.load_pem_private_key(cert.private_key_pem.bytes(), password=None)
    (d / "encrypted-key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.BestAvailableEncryption(b"secret")))
    return str(d / "ca.pem"), str(d / "cert.pem"), str(d / "key.pem"), str(d / "other-key.pem")


def test_https_with_the_openai_client(serve, tls_files):
    ca, cert, key, _ = tls_files
    s = serve(BETA, **uvicorn_options(cert, key))
    assert s.url.startswith("https://")
    trusted = ssl.create_default_context(cafile=ca)
    # Closed before the server stops: an idle TLS connection left open holds uvicorn's shutdown (its
    # close waits for the client's close_notify).
    with s.client("sk-beta", http_client=openai.DefaultHttpxClient(verify=trusted)) as client:
        assert complete(client, 4).parse().usage.completion_tokens == 4
    with s.client("sk-wrong", http_client=openai.DefaultHttpxClient(verify=trusted)) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA refuses the server
        s.client("sk-beta").models.list()
    with pytest.raises(httpx.HTTPError):  # and plain HTTP gets nothing served
        httpx.get(s.url.replace("https://", "http://") + "/health", timeout=5)


def test_grpc_over_tls(core, loop, tls_files):
    ca, cert, key, _ = tls_files
    tenants = Tenants([BETA])
    server = loop.run(start_grpc_server(core, 0, host="127.0.0.1", tenants=tenants,
                                        credentials=grpc_credentials(cert, key)))
    with open(ca, "rb") as f:
        trusted = grpc.ssl_channel_credentials(root_certificates=f.read())
    secure = grpc.secure_channel(f"localhost:{server.port}", trusted)
    plain = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        request = pb.CompletionRequest(prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True)
        reply = pb_grpc.CompletionStub(secure).Complete(request, timeout=30, metadata=bearer("sk-beta"))
        assert reply.usage.completion_tokens == 3
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.CompletionStub(plain).Complete(request, timeout=10, metadata=bearer("sk-beta"))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        secure.close()
        plain.close()
        loop.run(server.stop(None))


def test_tls_files_are_checked_and_go_in_pairs(tmp_path, tls_files):
    _, cert, key, other_key = tls_files
    check_tls(cert, key)
    with pytest.raises(ValueError, match="router.tls_certfile and router.tls_keyfile: cannot serve TLS with"):
        check_tls(cert, other_key)  # a key that is not the certificate's
    with pytest.raises(ValueError, match="cannot serve TLS with .*: the private key is encrypted"):
        check_tls(cert, key.replace("key.pem", "encrypted-key.pem"))  # (never a prompt on the terminal)
    with pytest.raises(ValueError, match="router.tls_certfile and router.tls_keyfile: .*none.pem: no such file"):
        check_tls(cert, str(tmp_path / "none.pem"))
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"router": {"tls_keyfile": key}}))
    with pytest.raises(ConfigError, match="router.tls_keyfile: .* is not allowed — TLS needs both "
                                          "router.tls_certfile and router.tls_keyfile: set router.tls_certfile too"):
        load_cluster_config(str(path))
    relative = ClusterConfig.model_validate({"router": {"tls_certfile": "c.pem", "tls_keyfile": "~/k.pem",
                                                        "api_keys_file": "keys.yaml"}}).router
    assert all(p.startswith("/") for p in (relative.tls_certfile, relative.tls_keyfile, relative.api_keys_file))
