"""The serving path through `pdserve up`: real Ray, real NIXL/TCP KV transfer between worker
processes (or colocated replicas doing both phases), the `openai` client over HTTP and a gRPC
client from the .proto."""

import asyncio
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2, completion_pb2_grpc
from serving_cluster import Cluster, until

SPECULATIVE = {"method": "ngram", "num_tokens": 4}
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. " * 3, "x", "Hello, world! " * 20]


@pytest.fixture(scope="module")
def reference() -> Engine:
    """`pdserve generate` in one process: the oracle for every answer of a cluster."""
    return Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=512))


_GREEDY: dict[tuple[int, str, int], str] = {}


def greedy(engine: Engine, prompt: str, max_tokens: int) -> str:
    """The engine's greedy text, generated alone; each (prompt, max_tokens) once per module: every
    cluster here is checked against the same prompts (the 64 streams' alone 64 generations a cluster)."""
    key = (id(engine), prompt, max_tokens)
    if key not in _GREEDY:
        _GREEDY[key] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text
    return _GREEDY[key]


# These start clusters of their own: they run before the shared one exists (one Ray at a time).
# TCP rides on the two-prefill cluster (its decode end shakes hands with two prefill peers) instead
# of a 1+1 cluster of its own: one cluster start less (~35 s on 2 cores). 1+1 over NIXL is the shared
# cluster's below; NIXL between several peers is the round-robin cluster's and test_prefix_routing's.
@pytest.mark.parametrize("sections, replicas", [
    ({"prefill": {"replicas": 2}, "kv_transfer": {"backend": "tcp"}}, 3),
    # Round-robin: consecutive requests go to every replica of each role. Speculating (n-gram drafts
    # verified in the step): the same greedy text. Every prompt remote (prefill_site): adaptive, short
    # prompts go local as their forecasts say, and a prefill replica may see none of the eight (one CI
    # run: 7 local, 1 remote).
    ({"colocated": {"replicas": 2, "num_kv_blocks": 512, "speculative": SPECULATIVE},
      "router": {"policy": "round-robin"}}, 2),
    ({"prefill": {"replicas": 2}, "decode": {"replicas": 2},
      "router": {"policy": "round-robin", "prefill_site": "remote"}}, 4),
], ids=["2-prefill-1-decode-tcp", "2-colocated", "2-prefill-2-decode-round-robin"])
def test_other_topologies_give_the_same_greedy_text(tmp_path, reference, sections, replicas):
    c = Cluster(tmp_path, **sections)
    try:
        c.wait_ready()
        oa = client(c)
        for prompt in PROMPTS * 2:  # enough requests to use two replicas of a role
            r = oa.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0)
            assert r.choices[0].text == greedy(reference, prompt, 12)
        stats = c.wait_idle()
        assert len(stats) == replicas
        assert all(s["used"] == 0 for s in stats.values()), stats
        if "speculative" in sections.get("colocated", {}):
            assert_drafts_accepted(c)
        if sections.get("router", {}).get("policy") == "round-robin":
            placed = {line.split('replica="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                      for line in c.metrics().splitlines() if line.startswith("pdserve_replica_requests_total{")}
            assert len(placed) == replicas and all(placed.values()), placed
    finally:
        assert c.stop() == 0, c.output()


# The client tests below run against one prefill and one decode replica, again against an
# expert-parallel decode replica (2 ranks), and again against one colocated replica (the
# baseline: both phases in one engine); all must look the same from outside. The expert-parallel
# threshold is low so that busy steps take the all-to-all exchange and quiet ones the all-gather one.
# The last two overlap their steps (on by default on GPUs only), which nothing outside may notice.
@pytest.fixture(scope="module", params=[
    # The decode replica speculates (n-gram drafts from the prompt and output it holds, checked in
    # its steps): every client test below sees the same tokens as without.
    {"decode": {"speculative": SPECULATIVE}},
    {"decode": {"ep_size": 2, "ep_threshold": 8, "overlap_scheduling": True}},
    {"colocated": {"replicas": 1, "num_kv_blocks": 512, "overlap_scheduling": True}},
], ids=["decode", "decode-ep2", "colocated"])
def cluster(request, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("up"), **request.param)
    c.ep_size = request.param.get("decode", {}).get("ep_size", 1)
    c.role = "colocated" if "colocated" in request.param else "decode"  # the role that generates
    c.speculative = "speculative" in request.param.get("decode", {})
    c.replicas = {"pdserve-colocated-0"} if c.role == "colocated" else {"pdserve-prefill-0", "pdserve-decode-0"}
    try:
        c.wait_ready()
        yield c
    finally:
        code = c.stop()
        assert code == 0, c.output()


def client(c: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)


def test_completion_and_chat_equal_generate(cluster, reference):
    oa = client(cluster)
    for prompt in PROMPTS:
        r = oa.completions.create(model="tiny-moe", prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].text == greedy(reference, prompt, 20)
        assert r.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
        stream = oa.completions.create(model="tiny-moe", prompt=prompt, max_tokens=20, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == r.choices[0].text
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat_ids = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    expected = reference.generate([chat_ids], SamplingParams(max_tokens=16, temperature=0))[0].text
    r = oa.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == expected
    stream = oa.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=16, temperature=0,
                                        stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == r.choices[0].message.content
    assert all(s["used"] == 0 for s in cluster.wait_idle().values())
    if cluster.speculative:  # ("Hello, world! " * 20 repeats itself: its drafts are taken)
        assert_drafts_accepted(cluster)


def assert_drafts_accepted(c: Cluster) -> None:
    """The cluster's replicas checked draft tokens and accepted some (vLLM's counters, polled from the
    replicas every half second)."""
    until(lambda: metric(c.metrics(), "vllm:spec_decode_num_accepted_tokens_total") > 0, 10,
          "accepted draft tokens in /metrics")
    m = c.metrics()
    assert metric(m, "vllm:spec_decode_num_draft_tokens_total") >= metric(m, "vllm:spec_decode_num_accepted_tokens_total")


def test_tokenizer_endpoints_count_as_generation_does(cluster, reference):
    # vLLM's /tokenize, /detokenize, /version, answered by the router (router/http_tokens.py).
    prompt = PROMPTS[0]
    body = httpx.post(f"{cluster.url}/tokenize", json={"model": "tiny-moe", "prompt": prompt}, timeout=30).json()
    assert body["tokens"] == reference.tokenizer.encode(prompt)
    assert client(cluster).completions.create(model="tiny-moe", prompt=prompt, max_tokens=1).usage.prompt_tokens \
        == body["count"]
    r = httpx.post(f"{cluster.url}/detokenize", json={"tokens": body["tokens"][1:]}, timeout=30)
    assert r.json() == {"prompt": prompt}
    assert httpx.get(f"{cluster.url}/version", timeout=30).json()["version"]


LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def completion_logprobs(oa: openai.OpenAI, stream: bool, **kw) -> tuple[str, dict]:
    """(text, logprobs) of a completion, a stream's chunks joined."""
    r = oa.completions.create(model="tiny-moe", temperature=0, stream=stream, **kw)
    if not stream:
        return r.choices[0].text, r.choices[0].logprobs.model_dump()
    chunks = [ch.choices[0] for ch in r if ch.choices]
    lps = [c.logprobs.model_dump() for c in chunks if c.logprobs]
    return "".join(c.text for c in chunks), {k: [v for lp in lps for v in lp[k]] for k in LOGPROB_KEYS}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_logprobs_one_entry_per_token_named_by_its_text(cluster, reference, stream):
    """The first token is sampled where the prompt is computed (the prefill replica): its logprob
    goes with it to the decode replica, so N tokens get N entries. Each token is named by its own
    text, and its text_offset is where that text starts in the completion's."""
    oa = client(cluster)
    prompt = "The quick brown fox"
    for n in (1, 2, 5):
        want = reference.generate([prompt], SamplingParams(max_tokens=n, temperature=0, logprobs=1))[0]
        text, lp = completion_logprobs(oa, stream, prompt=prompt, max_tokens=n, logprobs=1)
        assert text == want.text and len(want.token_ids) == n
        assert [len(lp[k]) for k in LOGPROB_KEYS] == [n] * 4, lp
        assert "".join(lp["tokens"]) == text and lp["tokens"] == [t.text for t in want.logprobs]
        assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(n)]
        assert lp["token_logprobs"] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-3)
        assert [list(alt) for alt in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]  # greedy: its own best
        assert not any(t.startswith("token_id:") for t in lp["tokens"])
    messages = [{"role": "user", "content": "Tell me a story."}]
    chat_ids = reference.tokenizer.encode(reference.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    want = reference.generate([chat_ids], SamplingParams(max_tokens=3, temperature=0, logprobs=2))[0]
    r = oa.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                   top_logprobs=2, stream=stream)
    if stream:
        chunks = [ch.choices[0] for ch in r if ch.choices]
        content = [c for ch in chunks if ch.logprobs for c in ch.logprobs.content]
        text = "".join(ch.delta.content or "" for ch in chunks)
    else:
        content, text = r.choices[0].logprobs.content, r.choices[0].message.content
    assert len(want.token_ids) == len(content) == 3 and text == want.text
    assert [c.token for c in content] == [t.text for t in want.logprobs] and "".join(c.token for c in content) == text
    assert all(bytes(c.bytes) == c.token.encode() and len(c.top_logprobs) == 2 for c in content)
    assert [c.logprob for c in content] == pytest.approx([t.logprob for t in want.logprobs], abs=1e-3)


def test_grpc_gives_the_http_output(cluster):
    oa = client(cluster)
    prompt = PROMPTS[0]
    http_text = oa.completions.create(model="tiny-moe", prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = completion_pb2_grpc.CompletionStub(channel)
        req = completion_pb2.CompletionRequest(prompt=prompt, max_tokens=24, temperature=0.0)
        assert stub.Complete(req, timeout=60).text == http_text
        assert "".join(ch.text for ch in stub.CompleteStream(req, timeout=60)) == http_text
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(completion_pb2.CompletionRequest(prompt="", max_tokens=4), timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_64_concurrent_streams_each_get_their_own_text(cluster, reference):
    prompts = [f"Request number {i}: " + "abc " * (i % 13) for i in range(64)]
    lengths = [4 + i % 29 for i in range(64)]
    expected = [greedy(reference, p, n) for p, n in zip(prompts, lengths)]
    aoa = openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(p, n):
        stream = await aoa.completions.create(model="tiny-moe", prompt=p, max_tokens=n, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def all_of_them():
        return await asyncio.gather(*[one(p, n) for p, n in zip(prompts, lengths)])

    assert asyncio.run(all_of_them()) == expected
    stats = cluster.wait_idle()
    assert set(stats) == cluster.replicas and all(s["used"] == 0 for s in stats.values()), stats
    metrics = cluster.metrics()
    local = 0.0
    if cluster.role == "colocated":  # both phases in one engine: no KV moves
        assert metric(metrics, "pdserve_kv_bytes_moved_total") == 0
    else:
        assert metric(metrics, "pdserve_kv_bytes_moved_total") > 0
        # Each prompt computed on a prefill replica (its KV moved) or, adaptive, on its decode replica.
        local = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("pdserve_prefill_site_total{") and 'site="local"' in line)
        assert metric(metrics, "pdserve_kv_transfer_seconds_count") + local >= 64
    # Where the time to a first token went, per phase, for every one of these requests too; a KV
    # reservation for each prompt computed remotely.
    assert all(phase_count(metrics, ph) >= len(prompts) for ph in ("admit", "dispatch", "first_token"))
    assert metric(metrics, "pdserve_router_loop_lag_seconds_count") > 0  # the loop's pauses, sampled
    # ... only while requests stream: an idle router's loop sleeps (router/idle.py), after the tick
    # under way when the last stream ended
    time.sleep(2 * 0.05)
    idle = metric(cluster.metrics(), "pdserve_router_loop_lag_seconds_count")
    time.sleep(0.5)
    assert metric(cluster.metrics(), "pdserve_router_loop_lag_seconds_count") == idle
    if cluster.role == "colocated":  # nothing to reserve: no decode replica
        assert phase_count(metrics, "reserve") == 0
    else:
        assert phase_count(metrics, "reserve") >= len(prompts) - local


def test_client_disconnect_aborts_everywhere(cluster):
    before = cluster.metrics()
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60,
                      json={"model": "tiny-moe", "prompt": "Never ending story", "max_tokens": 4000,
                            "temperature": 0, "stream": True, "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    stats = cluster.wait_idle()
    assert all(s["used"] == 0 for s in stats.values()), stats
    role = cluster.role  # the replica that was generating
    deadline = time.time() + 10
    while time.time() < deadline:  # workers report their abort counts every half second
        after = cluster.metrics()
        if aborted(after, role) > aborted(before, role):
            break
        time.sleep(0.3)
    assert aborted(after, "router") > aborted(before, "router")
    assert aborted(after, role) > aborted(before, role)


def metric(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def phase_count(metrics: str, phase: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("pdserve_request_phase_seconds_count{") and f'phase="{phase}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def aborted(metrics: str, role: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("pdserve_requests_aborted_total{") and f'role="{role}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("body, status, param", [
    ("{not json", 400, None),
    ({"model": "tiny-moe", "max_tokens": 4}, 400, "prompt"),
    ({"model": "tiny-moe", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny-moe", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, None),
    ({"model": "tiny-moe", "prompt": "x" * 5000, "max_tokens": 1}, 400, "prompt"),
    # Past the router's checks: the worker refuses it (tiny-moe has 512 token ids).
    ({"model": "tiny-moe", "prompt": [7, 100000], "max_tokens": 1}, 400, "prompt"),
])
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(cluster, body, status, param):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"]
    if param:
        assert err["param"] == param
    ok = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                    json={"model": "tiny-moe", "prompt": "still here?", "max_tokens": 2})
    assert ok.status_code == 200


def test_expert_parallel_replica_counts_tokens_per_expert(cluster):
    if cluster.ep_size == 1:
        pytest.skip("expert load is counted where experts are sharded")
    lines = [line for line in cluster.metrics().splitlines()
             if line.startswith('pdserve_expert_tokens_total{') and 'replica="pdserve-decode-0"' in line]
    experts = {line.split('expert="', 1)[1].split('"', 1)[0] for line in lines}
    assert experts == {str(e) for e in range(8)}  # tiny-moe: every expert got tokens by now
    assert all(float(line.rsplit(" ", 1)[1]) > 0 for line in lines)


def test_pdserve_down_stops_what_up_started(cluster):
    # The address names this cluster: test files running beside this one start clusters of their own.
    address = cluster.up.ray_address()
    assert address, cluster.output()
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "down", "--address", address], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cluster.proc.wait(60)  # `pdserve up` notices and exits on its own
    assert cluster.proc.returncode == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{cluster.url}/health", timeout=5)


def test_bad_cluster_yaml_fails_before_anything_starts(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("prefill: {replicas: 0}\nkv_transfer: {backend: carrier-pigeon}\nrouter: {htp_port: 1}\n")
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    for needle in ("prefill.replicas", "kv_transfer.backend", "carrier-pigeon", "router.htp_port", "unknown key"):
        assert needle in r.stderr
    assert "Traceback" not in r.stderr and "starting Ray" not in r.stderr
