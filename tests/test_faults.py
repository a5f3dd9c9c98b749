"""Faults as an operator meets them, through `pdserve up`: a port that is taken, and replicas
killed with SIGKILL (or hung) while they serve: a clear, prompt answer everywhere, never a hang,
and the controller replaces them. (Requests that move to a live replica: test_recovery.py.)"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from serving_cluster import Cluster, until

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


def metric(cluster: Cluster, name: str, replica: str) -> float | None:
    for line in cluster.metrics().splitlines():
        if line.startswith(name + "{") and f'replica="{replica}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def replaced(status: str, name: str, times: int = 1) -> str | None:
    """`pdserve status` if it shows `name` serving again, restarted `times`."""
    line = next((ln for ln in status.splitlines() if ln.startswith(f"{name} (pid ")), "")
    return status if f"restarted {times}x" in line else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # migration_limit 0: a request on a replica that dies ends (with a clear error) instead of moving
    # (test_recovery.py has the requests that move); replica_wait_s 0.5: a new request waits that
    # long for a replacement, then hears 503.
    c = Cluster(tmp_path_factory.mktemp("faults"), router={"migration_limit": 0, "replica_wait_s": 0.5})
    try:
        c.wait_ready()
        yield c
    finally:
        assert c.stop() == 0, c.output()


def test_a_killed_decode_replica_ends_its_streams_naming_it_and_is_replaced(cluster):
    decode_pid = cluster.pid("pdserve-decode-0")
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

    # Until its replacement serves, a new request is refused (after replica_wait_s), naming the role.
    r = until(lambda: (r := httpx.post(f"{cluster.url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 2},
                                       timeout=30)).status_code == 503 and r, timeout_s=20, what="a 503")
    assert r.json()["error"]["code"] == "replica_unavailable" and "decode" in r.json()["error"]["message"], r.text

    # The controller replaced it: `pdserve status`, the `pdserve up` terminal, /metrics; it serves.
    out = until(lambda: cluster.replacements("pdserve-decode-0") and replaced(cluster.status(), "pdserve-decode-0"),
                timeout_s=120, what="the replacement")
    assert "state: running" in out and f"pdserve-decode-0 (pid {decode_pid})" not in out, out
    assert "pdserve-decode-0 is down (its process died); starting a replacement" in cluster.output()
    until(lambda: httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200, timeout_s=10)
    r = httpx.post(f"{cluster.url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text
    assert metric(cluster, "pdserve_replica_up", "pdserve-decode-0") == 1
    assert metric(cluster, "pdserve_replica_restarts_total", "pdserve-decode-0") == 1
    stats = cluster.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats


def test_the_controller_kills_and_replaces_a_worker_whose_heartbeats_stop(cluster):
    # SIGSTOP: the process lives but answers nothing (hung). After 3 missed heartbeats it is
    # killed and replaced.
    pid = cluster.pid("pdserve-prefill-0")
    os.kill(pid, signal.SIGSTOP)
    try:
        out = until(lambda: cluster.replacements("pdserve-prefill-0")
                    and replaced(cluster.status(), "pdserve-prefill-0"), timeout_s=120, what="the replacement")
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert "no answer to 3 heartbeats in a row" in cluster.output(), cluster.output()
    assert "state: running" in out, out
    r = httpx.post(f"{cluster.url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text


def restarts(status: str, name: str) -> int:
    line = next((ln for ln in status.splitlines() if ln.startswith(f"{name} (pid ")), "")
    return int(line.split("restarted ", 1)[1].split("x", 1)[0]) if "restarted " in line else 0


def test_a_prefill_killed_while_the_decode_is_replaced_leaves_both_replaced(cluster):
    # The replacement of one must not wait on (or fail for) the other: each introduces itself to
    # the live peers only, and the later one to the earlier.
    before = cluster.status()
    decode, prefill = cluster.pid("pdserve-decode-0"), cluster.pid("pdserve-prefill-0")
    os.kill(decode, signal.SIGKILL)
    time.sleep(1.5)  # the controller is starting the decode replacement now
    os.kill(prefill, signal.SIGKILL)
    want = {n: restarts(before, n) + 1 for n in ("pdserve-decode-0", "pdserve-prefill-0")}
    until(lambda: all(cluster.replacements(n) >= k for n, k in want.items())
          and all(restarts(s := cluster.status(), n) == k for n, k in want.items()) and "state: running" in s,
          timeout_s=120, what="both replaced")
    assert "replacement failed" not in cluster.output(), cluster.output()
    r = httpx.post(f"{cluster.url}/v1/completions", json=LONG | {"stream": False, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
