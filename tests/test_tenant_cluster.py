"""Tenants kept apart in a real cluster: `pdserve up` (a subprocess) of one prefill and one decode
replica behind a router with API keys from a keys file and PDSERVE_API_KEYS, one cluster for the
module. A prompt cached under one key is no hit under another — across the prefill -> decode
hand-off and the router's prefix-aware routing — but is under the same key or a key of its
cache_group; /metrics takes an admin key; a streaming client that stops reading is cut off and the
KV blocks of its request come back, and so is one dribbling its headers (others are served
meanwhile); gRPC takes the key from its metadata. And `pdserve up` says
once, plainly, when it would serve a public address with no keys."""

import json
import socket
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2 as pb
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2_grpc as pb_grpc
from pdserve.router.tenants import ENV_VAR
from serving_cluster import Cluster, until

MODEL = "tiny-moe"
PROMPT = "Once upon a time"
KEYS = [{"name": "team-a", "key": "sk-team-a", "requests_per_minute": 600, "cache_group": "team"},
        {"name": "team-a2", "key": "sk-team-a2", "cache_group": "team"},
        {"name": "team-b", "key": "sk-team-b", "priority": 1},
        {"name": "ops", "key": "sk-ops-admin", "admin": True}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenants")
    keys = tmp / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": KEYS}))
    mp = pytest.MonkeyPatch()
    mp.setenv(ENV_VAR, "env-key:sk-env")
    c = Cluster(tmp, admin_key="sk-ops-admin", router={"api_keys_file": str(keys), "sse_write_timeout_s": 1.0,
                                                            "header_timeout_s": 2.0})
    try:
        c.wait_ready()
        yield c
    finally:
        mp.undo()
        assert c.stop() == 0


def client(cluster: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=key, max_retries=0)


def complete(cluster: Cluster, key: str, max_tokens: int, prompt: str = PROMPT, **extra):
    return client(cluster, key).completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True, **extra})


def reused(cluster: Cluster) -> float:
    """Every replica's prefix-cache reuse so far: prompt tokens found in a prefill (or local prefill)
    engine's cache, and a decode reservation's blocks found in its own, in tokens."""
    total = 0.0
    for family in text_string_to_metric_families(cluster.metrics()):
        for sample in family.samples:
            if sample.name == "pdserve_prefix_cache_hits_total":
                total += sample.value
            elif sample.name == "pdserve_kv_blocks_reused_total":
                total += 16 * sample.value
    return total


STILL_S = 1.5


def settled(cluster: Cluster, before: float) -> float:
    """The reuse once the replicas' counters (polled twice a second) stop moving: the last request's.
    Unmoved for STILL_S, several polls: two reads within one poll agree before the update arrives."""
    last = [None, time.monotonic()]

    def still() -> float | None:
        now = reused(cluster)
        if now != last[0]:
            last[:] = [now, time.monotonic()]
            return None
        return now - before if time.monotonic() - last[1] >= STILL_S else None

    # (0.0 is a result too: wrap it to tell it from "not yet")
    return until(lambda: (v := still()) is not None and [v], timeout_s=30, what="the reuse counters settled")[0]


def test_keys_with_the_serving_key_names_and_the_admin_gate(cluster):
    assert "5 API keys: team-a, team-a2, team-b, ops, env-key" in cluster.output()
    assert "WARNING: no API keys" not in cluster.output()
    with pytest.raises(openai.AuthenticationError):
        client(cluster, "sk-nope").models.list()
    assert complete(cluster, "sk-env", 2).parse().usage.completion_tokens == 2
    for path in ("/metrics", "/dashboard/data"):
        assert httpx.get(cluster.url + path, timeout=30).status_code == 401
        assert httpx.get(cluster.url + path, headers={"authorization": "Bearer sk-team-b"}, timeout=30).status_code == 403
    assert httpx.get(cluster.url + "/health", timeout=30).status_code == 200
    metrics = cluster.metrics()  # the admin's
    assert 'pdserve_api_key_generation_tokens_total{key="env-key"} 2.0' in metrics
    assert not any(k["key"] in cluster.output() + metrics for k in KEYS)
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = pb_grpc.CompletionStub(channel)
        request = pb.CompletionRequest(prompt=PROMPT, max_tokens=2, temperature=0, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as e:
            stub.Complete(request, timeout=60)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Complete(request, timeout=60, metadata=(("authorization", "Bearer sk-team-b"),)
                             ).usage.completion_tokens == 2


def test_a_prompt_cached_under_one_key_is_no_hit_under_another(cluster):
    prompt = " ".join(f"probe{i}" for i in range(120))  # ~50 full blocks
    before = reused(cluster)
    complete(cluster, "sk-team-a", 2, prompt)
    first = settled(cluster, before)
    assert first == 0  # a prompt never seen
    before = reused(cluster)
    complete(cluster, "sk-team-b", 2, prompt)  # another tenant probes for it
    assert settled(cluster, before) == 0
    for key, extra in (("sk-team-a", {}), ("sk-team-a2", {})):  # the same key, and a key of its group, hit
        before = reused(cluster)
        complete(cluster, key, 2, prompt, **extra)
        assert settled(cluster, before) > 0, key
    before = reused(cluster)
    complete(cluster, "sk-team-a", 2, prompt, cache_salt="private")  # a request's own salt: its own cache
    assert settled(cluster, before) == 0


def test_a_stream_its_client_stops_reading_is_cut_off_and_its_blocks_come_back(cluster):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    s.connect((host, int(port)))
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3500, "temperature": 0, "ignore_eos": True,
                       "logprobs": 20, "n": 16, "stream": True}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Authorization: Bearer sk-team-b\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    s.settimeout(60)
    assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
    try:  # ... and reads no more: cut off by router.sse_write_timeout_s, its 16 choices aborted
        # Its blocks in use first: read before the request was scheduled, the stats said "all back"
        # at once, the client read on, and the stream ran to its end.
        until(lambda: (stats := cluster.replica_stats()) and any(v.get("used", 0) > 0 for v in stats.values()),
              timeout_s=60, what="the stalled stream's KV blocks in use")
        until(lambda: (stats := cluster.replica_stats()) and all(v.get("used") == 0 for v in stats.values()),
              timeout_s=60, what="the stalled stream's KV blocks back")
        got, closed = b"", False
        try:
            while chunk := s.recv(65536):
                got += chunk
            closed = True
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            pass
        assert closed and b"data: [DONE]" not in got  # the router closed it, unfinished
    finally:
        s.close()
    assert complete(cluster, "sk-team-b", 2).parse().usage.completion_tokens == 2


def test_a_client_dribbling_its_headers_is_cut_off_while_others_are_served(cluster):
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    slow = socket.create_connection((host, int(port)))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    served = 0
    try:
        for _ in range(200):  # a header byte now and then, until the router's header deadline cuts it
            slow.sendall(b"X")
            served += complete(cluster, "sk-team-b", 1).parse().usage.completion_tokens  # others go on
    except (BrokenPipeError, ConnectionResetError):
        pass
    else:
        pytest.fail("the router kept a connection whose headers never ended")
    finally:
        slow.close()
    assert served >= 1


@pytest.mark.parametrize("keys", [False, True])
def test_pdserve_up_on_a_public_address_without_keys_says_so_once(tmp_path, monkeypatch, keys):
    # The port is taken here, so `pdserve up` stops right after its checks, before Ray starts.
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    monkeypatch.delenv(ENV_VAR, raising=False)
    if keys:
        monkeypatch.setenv(ENV_VAR, "a:sk-a")
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"router": {"host": "0.0.0.0", "http_port": taken.getsockname()[1],
                                               "grpc_port": None}}))
    try:
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", str(path)], capture_output=True, text=True,
                           timeout=120)
    finally:
        taken.close()
    assert r.returncode != 0 and "router.http_port" in r.stderr and "starting Ray" not in r.stderr, r.stderr
    warning = ("[pdserve] WARNING: no API keys, and the router listens on 0.0.0.0 (every network interface): "
               "anyone who reaches its ports can generate")
    assert r.stderr.count(warning) == (0 if keys else 1), r.stderr
