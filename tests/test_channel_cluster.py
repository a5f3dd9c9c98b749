"""The direct channel in a real `pdserve up` cluster (one prefill, one decode, one router; real Ray,
real processes): the router process imports no torch; peers that do not prove the cluster's token
are refused by the worker, which serves on; a router killed with SIGKILL leaves nothing held on the
decode worker (its streams stop there and their KV blocks go back to the pool at once, long before
they would have finished). A decode worker killed mid-stream is test_recovery.py's: its streams
move over the channel's loss as they did over Ray's."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading

import httpx
import pytest

from pdserve.channel.wire import HELLO, LEN, NONCE_BYTES, frame, hello_proof, unframe
from tests.serving_cluster import Cluster, until


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("channel"), decode={"num_kv_blocks": 512})
    try:
        c.wait_ready()
        yield c
    finally:
        assert c.stop() == 0, c.output()


ASK = """
import json, sys
from pdserve.control.commands import _use_token_if_present
_use_token_if_present()  # (before Ray's import, as `pdserve status`)
import ray
ray.init(address=sys.argv[1], namespace="pdserve", logging_level="ERROR", log_to_driver=False)
actor = ray.get_actor(sys.argv[2])
print(json.dumps(eval(sys.argv[3])))
"""


def ask(cluster: Cluster, actor: str, expression: str):
    """`expression` (over `ray` and the named `actor`'s handle) evaluated in a process joined to the
    cluster's Ray, as `pdserve status` joins it."""
    r = subprocess.run([sys.executable, "-c", ASK, cluster.up.ray_address(), actor, expression],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def mapped(pid: int, library: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return library in f.read()


def test_the_router_process_imports_no_torch(cluster):
    router, decode = cluster.pid("pdserve-router-0"), cluster.pid("pdserve-decode-0")
    assert mapped(decode, "libtorch")  # (the check sees torch where it is)
    assert not mapped(router, "libtorch")
    torch, engine = ask(cluster, "pdserve-router-0", "[ray.get(actor.imported.remote(m), timeout=30) "
                                                     "for m in ('torch', 'pdserve.engine')]")
    assert torch == []
    # Only the prefix cache's block hashing (router/policy.py hashes prompts as the engines do): no torch there.
    assert set(engine) <= {"pdserve.engine", "pdserve.engine.block_pool", "pdserve.engine.kv_events"}, engine


def _frame_to(host: str, port: int, data_after_nonce) -> bytes:
    """Connect to a worker's channel over TCP, send what `data_after_nonce(nonce)` gives, and read
    its answer to the end (it closes a peer it refuses)."""
    with socket.create_connection((host, port), timeout=10) as s:
        nonce = b""
        while len(nonce) < NONCE_BYTES:
            nonce += s.recv(NONCE_BYTES - len(nonce))
        s.sendall(data_after_nonce(nonce))
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_peers_without_the_cluster_token_are_refused_and_the_worker_serves_on(cluster):
    address = ask(cluster, "pdserve-decode-0", "ray.get(actor.channel_address.remote(), timeout=30)")
    junk = _frame_to(address["host"], address["port"], lambda nonce: b"\x00\x00\x00\x08notframe")
    assert b"not a pdserve router" in junk
    wrong = _frame_to(address["host"], address["port"],
                      lambda nonce: frame(HELLO, "intruder", hello_proof("not-the-token", nonce, "intruder",
                                                                         "pdserve-decode-0")))
    (n,) = LEN.unpack(wrong[:LEN.size])
    assert unframe(wrong[LEN.size:LEN.size + n])[:2] == ["welcome", False]
    refused = ask(cluster, "pdserve-decode-0",
                  "ray.get(actor.__ray_call__.remote(lambda w: dict(w._now().channel.refused)), timeout=30)")
    assert refused == {"not_a_router": 1, "other_cluster": 1}  # counted by why, not kept
    r = httpx.post(f"{cluster.url}/v1/completions", json={"model": "tiny-moe", "prompt": "still serving",
                                                          "max_tokens": 8}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def _held(cluster: Cluster) -> tuple[int, int]:
    """The decode worker's KV blocks in use and the requests it holds, as it says itself."""
    return tuple(ask(cluster, "pdserve-decode-0",
                     "(lambda s: (s.total_blocks - s.free_blocks, s.held))(ray.get(actor.stats.remote(), timeout=30))"))


def test_a_killed_routers_requests_free_their_blocks_on_the_decode_worker(cluster):
    assert _held(cluster) == (0, 0)
    streaming: list[int] = []

    async def streams():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int):
                body = {"model": "tiny-moe", "prompt": f"stream {i} " * 20, "max_tokens": 3000, "stream": True,
                        "ignore_eos": True}
                try:
                    async with client.stream("POST", f"{cluster.url}/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            if i not in streaming:
                                streaming.append(i)
                except httpx.HTTPError:  # the router died under it
                    pass
            await asyncio.gather(*(one(i) for i in range(8)))

    clients = threading.Thread(target=asyncio.run, args=(streams(),), daemon=True)
    clients.start()
    until(lambda: len(streaming) == 8, timeout_s=120, what="8 streams under way")
    router = cluster.pid("pdserve-router-0")
    used, held = _held(cluster)
    assert used > 0 and held >= 8  # (each request counts in the engine and in the streams)
    os.kill(router, signal.SIGKILL)
    # 3000 tokens each would take minutes on this CPU: the blocks come back because the router is gone.
    until(lambda: _held(cluster) == (0, 0), timeout_s=30, what="the decode worker's blocks back to idle")
    clients.join(timeout=60)
    until(lambda: cluster.replacements("pdserve-router-0") >= 1, timeout_s=120, what="the router replaced")
