"""Flips under a steady load: a replica turned from prefill to decode and back in place
(`pdserve scale --role REPLICA=ROLE`) fails no request and stalls none.

A real `pdserve up` cluster of 2 prefill + 1 decode replicas over NIXL, a steady Poisson load of
short greedy streams through the OpenAI client (tests/chaos.py, tests/steady_load.py) the whole
time. Each flip must leave what every chaos change leaves: 0 requests failed, TTFT p99 of the
requests sent during the flip within 2 x the steady p99 + 1 s, every KV block back to idle, every KV
pair paired; and none waits over 1 s for its first token. Besides: the flipped worker keeps its
process (same pid), a greedy answer after the flips equals the one before, the command prints the
time from the command to serving, and a restarted controller takes a flipped replica back as it is.
"""

import os
import re
import signal

import openai
import pytest

from chaos import change, pairs, steady
from pdserve.control.tune import flips
from serving_cluster import Cluster

STALL_S = 1.0  # the bound: no request's first token waits longer than this during a flip
PROMPT = "the quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("flip"), prefill={"replicas": 2}, decode={"replicas": 1},
                kv_transfer={"backend": "nixl", "lease_s": 60})
    c.backend = "nixl"
    try:
        c.wait_ready()
        c.greedy_before = greedy(c.url)  # before any load: the reference answer
        steady(c)
        yield c
    finally:
        if getattr(c, "load", None) is not None:
            c.load.stop()
        assert c.stop() == 0, c.output()


def greedy(url: str) -> list[str]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=60) as client:
        return [client.completions.create(model="tiny-moe", prompt=PROMPT * n, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for n in (1, 3)]


def flip(cluster: Cluster, replica: str, role: str, said: list):
    def do():
        r = cluster.cli("scale", "--role", f"{replica}={role}", "--grace", "60")
        assert r.returncode == 0, r.stderr
        said.append(r.stderr + r.stdout)
    return do


def test_flip_prefill_to_decode_and_back_under_load(cluster):
    pid = cluster.pid("pdserve-prefill-1")
    said = []
    figures = change(cluster, flip(cluster, "pdserve-prefill-1", "decode", said), 1, 2, "flip prefill-1 -> decode")
    m = re.search(r"flipped: pdserve-prefill-1 serves as (pdserve-decode-\d+) ([\d.]+) s after the command", said[0])
    assert m, said[0]
    as_decode = m[1]
    print(said[0].strip().splitlines()[-1])  # "flipped: ... S s after the command (drain, switch, KV pairs)"
    assert figures["max_s"] <= max(STALL_S, 2 * figures["steady_p99_s"]), figures  # no stall over 1 s
    assert cluster.pid(as_decode) == pid  # the same process: its weights and KV cache stayed
    s = cluster.status()
    assert ("pdserve-prefill-0", as_decode) in pairs(s), s
    assert greedy(cluster.url) == cluster.greedy_before

    # A restarted controller takes the flipped worker back as what it is now, not as its actor's name says.
    controller = cluster.pid("pdserve-controller")
    change(cluster, lambda: os.kill(controller, signal.SIGKILL), 1, 2, "the controller SIGKILLed after a flip",
           after=lambda: cluster.noted("; none restarted"))
    assert "recovered 3 replicas" in cluster.output(), cluster.output()
    assert cluster.pid(as_decode) == pid

    said.clear()
    change(cluster, flip(cluster, as_decode, "prefill", said), 2, 1, "flip decode -> prefill")
    m = re.search(r"flipped: \S+ serves as (pdserve-prefill-\d+) ([\d.]+) s after the command", said[0])
    assert m, said[0]
    print(said[0].strip().splitlines()[-1])
    assert cluster.pid(m[1]) == pid
    assert greedy(cluster.url) == cluster.greedy_before


def test_a_flip_refused_names_why(cluster):
    r = cluster.cli("scale", "--role", "pdserve-decode-0=prefill", "--grace", "5")
    assert r.returncode != 0 and "the only serving decode replica" in r.stderr, r.stderr
    r = cluster.cli("scale", "--role", "pdserve-prefill-0=prefill")
    assert r.returncode != 0 and "is a prefill replica already" in r.stderr, r.stderr


def test_tune_flips_where_the_roles_swap():
    assert flips((2, 1), (1, 2)) == (1, "decode")
    assert flips((1, 3), (3, 1)) == (2, "prefill")
    assert flips((1, 1), (2, 2)) == (0, None)
    assert flips((3, 1), (1, 2)) == (1, "decode")  # the second prefill replica drains (scale)
