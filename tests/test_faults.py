"""Faults as an operator meets them, through `pdserve up`: a port that is taken, and replicas
killed with SIGKILL while they serve. Recovering requests is not asked here (migration is
separate work): what is asked is a clear, prompt answer everywhere, never a hang."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest
import yaml

from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2, completion_pb2_grpc
from serving_cluster import Cluster

LONG = {"model": "tiny-moe", "prompt": "Once upon a time", "max_tokens": 3000, "temperature": 0,
        "ignore_eos": True, "stream": True}


@pytest.mark.parametrize("key", ["http_port", "grpc_port"])
def test_a_taken_port_fails_up_at_once_naming_it_and_its_holder(tmp_path, key):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        router = {"host": "127.0.0.1", "http_port": 0, "grpc_port": 0, key: port}
        path = tmp_path / "cluster.yaml"
        path.write_text(yaml.safe_dump({"router": router}))
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", str(path)], capture_output=True, text=True,
                           timeout=120)
    assert r.returncode == 2, r.stderr
    assert time.monotonic() - t0 < 30
    assert f"router.{key}" in r.stderr and f":{port}" in r.stderr and f"pid {os.getpid()}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "starting Ray" not in r.stderr  # nothing was started


def status(cluster: Cluster) -> str:
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--address", cluster.up.ray_address()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def pid_of(cluster: Cluster, replica: str) -> int:
    for line in status(cluster).splitlines():
        if line.startswith(f"{replica} (pid "):
            return int(line.split("(pid ", 1)[1].split(")", 1)[0])
    raise AssertionError(f"{replica} not in `pdserve status`:\n{status(cluster)}")


def metric(cluster: Cluster, name: str, replica: str) -> float | None:
    for line in cluster.metrics().splitlines():
        if line.startswith(name + "{") and f'replica="{replica}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def until(check, timeout_s: float = 20):
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.3)
    return result


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("faults"))
    try:
        c.wait_ready()
        yield c
    finally:
        assert c.stop() == 0, c.output()


def test_a_killed_decode_replica_ends_its_streams_and_every_answer_names_it(cluster):
    decode_pid = pid_of(cluster, "pdserve-decode-0")
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        events = r.iter_lines()
        for line in events:  # generating
            if line.startswith("data: ") and '"text"' in line:
                break
        os.kill(decode_pid, signal.SIGKILL)
        t0 = time.monotonic()
        last = [line for line in events if line.startswith("data: ")]  # ends: no hang (the read timeout is 60 s)
    assert time.monotonic() - t0 < 15
    assert last[-1] == "data: [DONE]"
    error = json.loads(last[-2].removeprefix("data: "))["error"]
    assert "decode" in error["message"] and "pdserve-decode-0" in error["message"], error

    # New requests: 503 naming the role, over HTTP and gRPC; /health says not ready.
    r = httpx.post(f"{cluster.url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 4}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "replica_unavailable" and "decode" in r.json()["error"]["message"]
    # Every router learns of the death by its own call or its next stats poll (every 0.5 s): with
    # several routers on the port, /health may reach one that has not polled yet.
    until(lambda: httpx.get(f"{cluster.url}/health", timeout=10).status_code == 503, timeout_s=5)
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            completion_pb2_grpc.CompletionStub(channel).Complete(
                completion_pb2.CompletionRequest(prompt="hi", max_tokens=4), timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "decode" in err.value.details() and "<class" not in err.value.details() and "ray." not in err.value.details()

    # The operator sees it: `pdserve status`, the `pdserve up` terminal, /metrics (no stale load figures).
    out = status(cluster)
    assert "state: degraded" in out and "pdserve-decode-0: down: its process died" in out, out
    until(lambda: "replica pdserve-decode-0 is down" in cluster.output())
    assert metric(cluster, "pdserve_replica_up", "pdserve-decode-0") == 0
    assert metric(cluster, "pdserve_replica_up", "pdserve-prefill-0") == 1
    assert metric(cluster, "pdserve_kv_blocks_used", "pdserve-decode-0") is None

    # The prefill replica goes too: the answer names that role.
    os.kill(pid_of(cluster, "pdserve-prefill-0"), signal.SIGKILL)
    until(lambda: metric(cluster, "pdserve_replica_up", "pdserve-prefill-0") == 0)
    r = httpx.post(f"{cluster.url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 4}, timeout=30)
    assert r.status_code == 503 and "prefill" in r.json()["error"]["message"], r.text
