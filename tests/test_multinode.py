"""`pdserve up` on a Ray cluster of three nodes on this machine (tests/ray_nodes.py: `ray start`
processes on 127.0.0.x addresses, one Ray cluster for the module): prefill and decode placed on
different nodes as cluster.yaml says, 32 streams whose greedy text equals one engine's, KV
crossing nodes over NIXL (chosen by `backend: auto`, as the handshake records) and over TCP, a
role no node can hold refused naming its key, and a node's death: its replica comes back on
another node."""

import asyncio
import signal

import openai
import psutil
import pytest

from pdserve.config import EngineConfig, ModelConfig
from pdserve.control.launcher import PLACE_S
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from ray_nodes import LocalRayCluster, Node
from serving_cluster import Cluster, until

PROMPTS = [f"Request number {i}: " + "abc " * (i % 11) for i in range(32)]
LENGTHS = [4 + i % 13 for i in range(32)]


@pytest.fixture(scope="module")
def ray_nodes():
    # The head gives up a node 2 s after its heartbeats stop (Ray's default is 15 s): the node-death test.
    c = LocalRayCluster([Node("head", "127.0.0.1", {"pd_head": 1}), Node("n2", "127.0.0.2", {"pd_prefill": 2}),
                         Node("n3", "127.0.0.3", {"pd_decode": 1, "pd_prefill": 2})])
    try:
        yield c.start()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def expected() -> list[str]:
    """One engine in this process, colocated: the oracle for every stream."""
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=512))
    return [engine.generate([p], SamplingParams(max_tokens=n, temperature=0))[0].text for p, n in zip(PROMPTS, LENGTHS)]


def streams(url: str) -> list[str]:
    oa = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(p, n):
        s = await oa.completions.create(model="tiny-moe", prompt=p, max_tokens=n, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in s if ch.choices])

    async def all_of_them():
        return await asyncio.gather(*[one(p, n) for p, n in zip(PROMPTS, LENGTHS)])

    return asyncio.run(all_of_them())


def placed(status: str) -> dict[str, str]:
    """replica -> the node address `pdserve status` shows it on."""
    out = {}
    for line in status.splitlines():
        if line.startswith("pdserve-") and " on node " in line:
            out[line.split(" ", 1)[0]] = line.split(" on node ", 1)[1].split(" ", 1)[0]
    return out


def kv_pairs(status: str) -> dict[tuple[str, str], str]:
    out = {}
    for line in status.splitlines():
        if line.startswith("KV "):
            pair, rest = line[3:].split(": ", 1)
            a, b = pair.split(" -> ")
            out[(a, b.split("@")[0])] = rest
    return out


def up(tmp_path, ray_nodes, monkeypatch, **sections) -> Cluster:
    for k, v in ray_nodes.env().items():
        monkeypatch.setenv(k, v)
    return Cluster(tmp_path, ray={"address": ray_nodes.address}, **sections)


def test_a_role_no_node_can_hold_is_refused_naming_its_key(tmp_path, ray_nodes, monkeypatch):
    c = up(tmp_path, ray_nodes, monkeypatch, prefill={"placement": {"labels": {"pd-node": "n9"}}})
    assert c.proc.wait(120) == 2
    out = c.output()
    assert "prefill.placement: no node of the Ray cluster qualifies — it asks labels {'pd-node': 'n9'}" in out, out
    assert "127.0.0.2 (" in out and "'pd-node': 'n2'" in out  # the nodes it could have had


def test_auto_places_prefill_and_decode_on_two_nodes_and_moves_kv_over_nixl(tmp_path, ray_nodes, monkeypatch, expected):
    c = up(tmp_path, ray_nodes, monkeypatch, kv_transfer={"backend": "auto"},
           prefill={"placement": {"labels": {"pd-node": "n2"}}},
           decode={"placement": {"resources": {"pd_decode": 1}}})
    try:
        c.wait_ready()
        assert streams(c.url) == expected
        status = c.status()
        assert placed(status) == {"pdserve-prefill-0": "127.0.0.2", "pdserve-decode-0": "127.0.0.3"}, status
        # The handshake's record: between two hosts, auto took NIXL.
        assert kv_pairs(status) == {("pdserve-prefill-0", "pdserve-decode-0"): "nixl (hosts 127.0.0.2 and 127.0.0.3 differ)"}
        assert all(s["used"] == 0 for s in c.wait_idle().values())
    finally:
        assert c.stop() == 0, c.output()


def test_tcp_between_nodes_spread_prefills_and_a_dead_node_s_replica_comes_back_elsewhere(
        tmp_path, ray_nodes, monkeypatch, expected):
    c = up(tmp_path, ray_nodes, monkeypatch, kv_transfer={"backend": "tcp"},
           prefill={"replicas": 2, "placement": {"resources": {"pd_prefill": 1}, "strategy": "spread"}},
           decode={"placement": {"labels": {"pd-node": "n3"}}})
    try:
        c.wait_ready()
        assert streams(c.url) == expected
        status = c.status()
        where = placed(status)
        # Spread: one prefill replica on each node offering pd_prefill; decode where its label is.
        assert sorted([where["pdserve-prefill-0"], where["pdserve-prefill-1"]]) == ["127.0.0.2", "127.0.0.3"], status
        assert where["pdserve-decode-0"] == "127.0.0.3"
        pairs = kv_pairs(status)
        assert set(pairs.values()) == {"tcp (kv_transfer.backend: tcp)"} and len(pairs) == 2, status
        # Node n2 dies (its raylet and every process under it): its prefill replica comes back on
        # the node left with room for it, and the cluster serves the same text.
        lost = next(r for r, ip in where.items() if ip == "127.0.0.2")
        ray_nodes.kill_node("127.0.0.2")
        # (Ray's health checks find the node dead, then the replacement loads and shakes hands.) The
        # controller may choose the dying node before Ray marks it dead: that start fails as soon as
        # the node is gone and the retry places it elsewhere, never waiting out the placement's
        # deadline (it did: 120 s of the test's 200).
        until(lambda: c.noted("serving again") and placed(c.status()).get(lost) == "127.0.0.3", 180,
              f"{lost} replaced on 127.0.0.3")
        assert f"within {PLACE_S} s" not in c.output(), c.output()
        assert streams(c.url) == expected
        assert all(s["used"] == 0 for s in c.wait_idle().values())
    finally:
        assert c.stop() == 0, c.output()
