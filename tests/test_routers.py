"""Several routers on one port (router.replicas: 3), through `pdserve up` as an operator runs it:
the kernel spreads connections over them (SO_REUSEPORT), each streams its own requests' tokens,
and one that dies leaves the others serving."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import openai
import pytest

from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2, completion_pb2_grpc

from serving_cluster import Cluster

MODEL = "tiny-moe"
PROMPTS = [f"Story {i}: once upon a time" for i in range(8)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("routers"), router={"replicas": 3})
    try:
        c.wait_ready()
        yield c
    finally:
        assert c.stop() == 0, c.output()


def served(url: str) -> float:
    """Completions this router answered with 200, by its own /metrics."""
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith('pdserve_requests_total{endpoint="/v1/completions",status="200"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def status(cluster: Cluster) -> str:
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "status", "--address", cluster.up.ray_address()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def alone(url: str) -> dict[str, str]:
    """Each prompt's greedy text, one request at a time: the oracle for the concurrent streams."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    return {p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
            for p in PROMPTS}


async def streams(url: str, prompts: list[str]) -> list[str]:
    """All prompts at once, each its own stream (and connection)."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        async def one(prompt: str) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                     stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        return await asyncio.gather(*(one(p) for p in prompts))


def test_three_routers_listen_on_one_port_each_with_its_own_address(cluster):
    own = cluster.router_urls()
    assert sorted(own) == ["pdserve-router-0", "pdserve-router-1", "pdserve-router-2"], cluster.output()
    for url in own.values():
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    text = status(cluster)
    for name, url in own.items():
        assert f"{name} (pid " in text and url in text, text


def test_96_streams_through_the_port_give_their_texts_alone_and_load_every_router(cluster):
    expected = alone(cluster.url)
    own = cluster.router_urls()
    before = {name: served(url) for name, url in own.items()}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(96)]
    texts = asyncio.run(streams(cluster.url, prompts))
    assert texts == [expected[p] for p in prompts]
    gained = {name: served(url) - before[name] for name, url in own.items()}
    assert sum(gained.values()) == 96, gained
    assert all(n > 0 for n in gained.values()), gained  # 96 connections, 3 routers: each got some


def test_grpc_through_the_shared_port_gives_the_texts_of_http(cluster):
    expected = alone(cluster.url)
    # A channel is one connection: one channel per call, so that the calls spread over the routers.
    for prompt in PROMPTS * 3:
        with grpc.insecure_channel(cluster.grpc_address) as channel:
            stub = completion_pb2_grpc.CompletionStub(channel)
            r = stub.Complete(completion_pb2.CompletionRequest(prompt=prompt, max_tokens=12, temperature=0.0),
                              timeout=60)
            assert r.text == expected[prompt]


def test_killing_one_router_leaves_the_others_serving(cluster):
    own = cluster.router_urls()
    line = next(ln for ln in status(cluster).splitlines() if ln.startswith("pdserve-router-1 (pid "))
    # A long stream on the router to be killed (its own address): it must end, and the decode
    # replica must stop generating it (nobody is left to stream to) rather than run its 3500 tokens.
    long = {"model": MODEL, "prompt": "Once", "max_tokens": 3500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{own['pdserve-router-1']}/v1/completions", json=long, timeout=30) as r:
        lines = r.iter_lines()
        assert next(ln for ln in lines if ln.startswith("data: "))  # it streams
        os.kill(int(line.split("(pid ", 1)[1].split(")", 1)[0]), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(httpx.HTTPError):
            for _ in lines:
                pass
        assert time.monotonic() - t0 < 15
    stats = cluster.wait_idle(timeout=10)
    assert stats and all(s["used"] == 0 for s in stats.values()), stats  # its KV blocks came back
    expected = alone(cluster.url)
    # New connections reach only the live routers: every request answers, with the right text.
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(30)]
    assert asyncio.run(streams(cluster.url, prompts)) == [expected[p] for p in prompts]
    for name in ("pdserve-router-0", "pdserve-router-2"):
        assert httpx.get(f"{own[name]}/health", timeout=10).status_code == 200
    # The controller starts a new one in its place, on the same port.
    deadline = time.monotonic() + 60
    while True:
        text = status(cluster)
        if "restarted 1x" in next((ln for ln in text.splitlines() if ln.startswith("pdserve-router-1 (pid")), ""):
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.5)
    assert "state: running" in text
    assert "pdserve-router-1 is down (its process died); starting a replacement" in cluster.output()
    stats = cluster.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats
