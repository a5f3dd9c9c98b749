"""The direct channel in a real `pdserve up` cluster (one prefill, one decode, one router; real Ray,
real processes), over TCP on this one host (`router.channel_transport: tcp`), so every frame after
the hello is sealed: the router process imports no torch; peers that do not prove the cluster's
token are refused by the worker, which serves on; a forged or replayed sealed frame is dropped and
the connection serves on; each refusal shows on the router's /metrics, by replica, endpoint and
reason; a router killed with SIGKILL leaves nothing held on the
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
from prometheus_client.parser import text_string_to_metric_families

from pdserve.channel.wire import BEAT, HELLO, LEN, NONCE_BYTES, frame, hello_proof, pack, session_keys, unframe
from pdserve.frame_seal import Sealer
from tests.serving_cluster import Cluster, until

TOKEN = "channel-cluster-token"  # the cluster's (PDSERVE_CLUSTER_TOKEN): this test speaks as a router too


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:  # (`pdserve up` starts inside: it takes the token)
        env.setenv("PDSERVE_CLUSTER_TOKEN", TOKEN)
        c = Cluster(tmp_path_factory.mktemp("channel"), decode={"num_kv_blocks": 512},
                    router={"channel_transport": "tcp"})
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
    mine = os.urandom(NONCE_BYTES)
    wrong = _frame_to(address["host"], address["port"],
                      lambda nonce: frame(HELLO, "intruder", hello_proof("not-the-token", nonce + mine, "intruder",
                                                                         "pdserve-decode-0"), mine))
    (n,) = LEN.unpack(wrong[:LEN.size])
    assert unframe(wrong[LEN.size:LEN.size + n])[:2] == ["welcome", False]
    refused = ask(cluster, "pdserve-decode-0",
                  "ray.get(actor.__ray_call__.remote(lambda w: dict(w._now().channel.refused)), timeout=30)")
    assert refused == {"not_a_router": 1, "other_cluster": 1}  # counted by why, not kept
    until(lambda: refusals_on_metrics(cluster, "pdserve-decode-0").items() >= {
        ("router_channel", "not_a_router"): 1.0, ("router_channel", "other_cluster"): 1.0}.items(),
        timeout_s=30, what="the refusals on the router's /metrics")
    assert_serves(cluster, "still serving")


def assert_serves(cluster: Cluster, prompt: str) -> None:
    """The cluster answers a completion whole (8 tokens) through its router. (Sampled at the default
    temperature, the tiny model may draw its end of text early: ignore_eos keeps the count exact.)"""
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                   json={"model": "tiny-moe", "prompt": prompt, "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def refusals_on_metrics(cluster: Cluster, replica: str) -> dict[tuple[str, str], float]:
    """pdserve_internal_refusals_total of one replica on the router's /metrics: (endpoint, reason) -> count."""
    out = {}
    for family in text_string_to_metric_families(cluster.metrics()):
        for s in family.samples:
            if s.name == "pdserve_internal_refusals_total" and s.labels["replica"] == replica:
                out[s.labels["endpoint"], s.labels["reason"]] = s.value
    return out


def test_a_forged_or_replayed_sealed_frame_is_dropped_counted_and_the_worker_serves_on(cluster):
    """A token holder's TCP connection (as a router's): its frames sealed. One sent again (replayed)
    and one whose tag was changed (forged) do not open: dropped as bad_mac, the connection serving on
    (the next frame as sealed opens: here an unknown kind, dropped as malformed). The router's own
    sealed channel serves a request meanwhile."""
    address = ask(cluster, "pdserve-decode-0", "ray.get(actor.channel_address.remote(), timeout=30)")
    worker = ask(cluster, "pdserve-decode-0", "ray.get(actor.__ray_call__.remote(lambda w: w._now().channel.worker), "
                                              "timeout=30)")
    mine = os.urandom(NONCE_BYTES)
    with socket.create_connection((address["host"], address["port"]), timeout=10) as s:
        nonces = s.recv(NONCE_BYTES, socket.MSG_WAITALL) + mine
        s.sendall(frame(HELLO, "raw-router", hello_proof(TOKEN, nonces, "raw-router", worker), mine))
        (n,) = LEN.unpack(s.recv(LEN.size, socket.MSG_WAITALL))
        assert unframe(s.recv(n, socket.MSG_WAITALL))[:2] == ["welcome", True]
        out = Sealer(session_keys(TOKEN, nonces, "raw-router", worker)[0])

        def sealed(body: bytes) -> bytes:
            body = out.seal(body)
            return LEN.pack(len(body)) + body
        beat = sealed(pack(BEAT))
        forged = bytearray(sealed(pack(BEAT)))
        forged[-1] ^= 1
        out.seq -= 1  # (never sent as sealed: the next frame takes its number)
        s.sendall(beat + beat + bytes(forged) + sealed(pack("gossip")))
        until(lambda: refusals_on_metrics(cluster, "pdserve-decode-0").items() >= {
            ("router_channel", "bad_mac"): 2.0, ("router_channel", "malformed"): 1.0}.items(),
            timeout_s=30, what="the dropped frames on the router's /metrics")
        assert_serves(cluster, "sealed all the way")


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
