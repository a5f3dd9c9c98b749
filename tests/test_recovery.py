"""Nothing lost when a process dies: real `pdserve up` clusters, real processes killed with SIGKILL
under a load of concurrent greedy streams through the OpenAI client. Every stream must complete
with the text it gives undisturbed, the dead are replaced, and every KV block comes back."""

import asyncio
import os
import random
import signal
import time

import httpx
import openai
import pytest

from serving_cluster import Cluster, until

MODEL = "tiny-moe"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + f" #{i}" for i in range(n)]


def undisturbed(url: str, texts: list[str], max_tokens: int) -> dict[str, str]:
    """Each prompt's greedy text, one request at a time, before anything is killed."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0, timeout=120) as client:
        return {p: client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text for p in texts}


class Load:
    """Concurrent greedy streams; `progress` counts tokens streamed so far. A stream whose
    connection breaks (its router was killed) is sent again, as a client does, and counted."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.max_tokens = url, max_tokens
        self.progress = 0
        self.resent = 0
        self.streaming: set[str] = set()

    async def run(self, texts: list[str]) -> dict[str, str]:
        async with openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=120) as client:
            outs = await asyncio.gather(*(self._one(client, p) for p in texts))
        return dict(zip(texts, outs))

    async def _one(self, client, prompt: str) -> str:
        for _ in range(3):
            text = []
            try:
                stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=self.max_tokens,
                                                         temperature=0, stream=True, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    text.append(chunk.choices[0].text)
                    self.progress += 1
                    self.streaming.add(prompt)
                return "".join(text)
            except (openai.APIConnectionError, httpx.TransportError):  # its router died under it: sent again
                self.resent += 1
        raise AssertionError(f"{prompt!r} failed three times")


async def repeated(url: str, expected: dict[str, str], max_tokens: int, going, results: list[bool]) -> None:
    """Each prompt sent again and again, one stream each, while going(); each result's text
    compared with its undisturbed one."""
    async def one(prompt: str) -> None:
        while going():
            got = await Load(url, max_tokens).run([prompt])
            results.append(got[prompt] == expected[prompt])
    await asyncio.gather(*(one(p) for p in expected))


def killed(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def replaced(cluster: Cluster, name: str, times: int = 1) -> str:
    """Until `pdserve status` shows the replica (or router) serving again, restarted `times`."""
    def check():
        if cluster.replacements(name) < times:  # until `pdserve up` printed it, status is not worth asking
            return None
        s = cluster.status()
        line = next((ln for ln in s.splitlines() if ln.startswith(f"{name} (pid ")), "")
        return s if f"restarted {times}x" in line and "state: running" in s else None
    return until(check, timeout_s=120, what=f"{name} replaced")


def idle(cluster: Cluster) -> None:
    stats = cluster.wait_idle(timeout=60)
    assert stats and all(s["used"] == 0 for s in stats.values()), stats


# These two start clusters of their own: they run before the shared one below exists, so that no
# idle cluster takes the cores their load and their replacements need (one Ray at a time, as in
# test_serving.py).


def test_down_with_grace_lets_the_streams_in_flight_finish(tmp_path):
    c = Cluster(tmp_path, colocated={"replicas": 1})
    try:
        c.wait_ready()
        texts = prompts(6, 6, seed=5)
        # Long enough that they are still streaming once `pdserve down` (a process that joins Ray
        # first: seconds on a loaded host) has begun the drain, with the replica at its serving
        # priority (pdserve/priority.py). 1,000 tokens once finished first on a loaded 2-core host.
        # The undisturbed texts come from one concurrent batch (greedy: as if each ran alone).
        expected = asyncio.run(Load(c.url, 1600).run(texts))

        async def scenario():
            load = Load(c.url, 1600)
            task = asyncio.create_task(load.run(texts))
            started = time.monotonic() + 60
            while len(load.streaming) < len(texts):  # every stream under way, or a clear failure
                if task.done():
                    task.result()  # the load's own error, if it failed
                assert not task.done() and time.monotonic() < started, \
                    f"{len(load.streaming)} of {len(texts)} streams started within 60 s"
                await asyncio.sleep(0.02)
            down = asyncio.create_task(asyncio.to_thread(c.cli, "down", "--grace", "60"))
            async with httpx.AsyncClient(timeout=30) as client:  # draining: /health says so, new requests 503
                while (await client.get(f"{c.url}/health")).status_code == 200:
                    assert not task.done(), "the streams finished before the drain began: make them longer"
                    await asyncio.sleep(0.1)
                refused = await client.post(f"{c.url}/v1/completions",
                                            json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            return await task, await down, refused

        t0 = time.monotonic()
        got, down, refused = asyncio.run(scenario())
        assert got == expected  # every stream in flight finished, whole
        assert down.returncode == 0 and time.monotonic() - t0 < 60, down.stderr
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"], refused.text
        assert c.proc.wait(timeout=60) == 0  # `pdserve up` ends with the cluster
    finally:
        c.stop()


def test_chaos_random_kills_of_workers_under_load_lose_and_leak_nothing(tmp_path):
    """Bounded in time: ~40 s of load, a worker SIGKILLed every few seconds at random."""
    c = Cluster(tmp_path, decode={"replicas": 2})
    try:
        c.wait_ready()
        texts = prompts(12, 8, seed=6)
        expected = undisturbed(c.url, texts, 40)
        rng = random.Random(7)
        results: list[bool] = []
        kills: list[str] = []
        deadline = time.monotonic() + 40

        async def chaos() -> None:
            while time.monotonic() < deadline - 8:
                await asyncio.sleep(rng.uniform(3, 6))
                s = await asyncio.to_thread(c.status)
                victims = [ln.split(" (pid ")[0] for ln in s.splitlines()
                           if ln.startswith(("pdserve-prefill", "pdserve-decode")) and " (pid " in ln]
                if victims:
                    v = rng.choice(victims)
                    kills.append(v)
                    killed(int(s.split(f"{v} (pid ", 1)[1].split(")", 1)[0]))

        async def scenario():
            await asyncio.gather(repeated(c.url, expected, 40, lambda: time.monotonic() < deadline, results), chaos())

        asyncio.run(scenario())
        assert kills, "nothing was killed"
        assert results and all(results), f"{results.count(False)} of {len(results)} requests failed or differed"
        until(lambda: "state: running" in c.status(), timeout_s=120, what="every replica replaced")
        idle(c)
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("recovery"), router={"replicas": 2})
    try:
        c.wait_ready()
        yield c
    finally:
        assert c.stop() == 0, c.output()


async def _under_load(load: Load, texts: list[str], kill, when) -> dict[str, str]:
    task = asyncio.create_task(load.run(texts))
    while not when() and not task.done():
        await asyncio.sleep(0.02)
    kill()
    return await task


def test_a_decode_a_prefill_and_a_router_killed_under_32_streams_lose_nothing(cluster):
    # Decode: killed once every stream has its first tokens; each moves to the replacement.
    texts = prompts(32, 6, seed=1)
    expected = undisturbed(cluster.url, texts, 48)
    load, pid = Load(cluster.url, 48), cluster.pid("pdserve-decode-0")
    got = asyncio.run(_under_load(load, texts, lambda: killed(pid), lambda: len(load.streaming) == len(texts)))
    assert got == expected
    assert _sum(cluster.metrics(), 'pdserve_request_migrations_total{role="decode"}') >= 1
    replaced(cluster, "pdserve-decode-0")
    idle(cluster)

    # Prefill: killed while long prompts (~150 tokens each; the decode replica holds 8k) are being
    # prefilled: those without a first token are prefilled again, on the replacement.
    texts = prompts(32, 30, seed=2)
    expected = undisturbed(cluster.url, texts, 8)
    load, pid, t0 = Load(cluster.url, 8), cluster.pid("pdserve-prefill-0"), time.monotonic()
    got = asyncio.run(_under_load(load, texts, lambda: killed(pid), lambda: time.monotonic() - t0 > 0.3))
    assert got == expected
    assert load.resent == 0
    replaced(cluster, "pdserve-prefill-0")
    idle(cluster)

    # A router of the two: its clients' connections break and they send again; the other serves,
    # and the controller starts a new one on the same port.
    texts = prompts(32, 6, seed=3)
    expected = undisturbed(cluster.url, texts, 48)
    load, pid = Load(cluster.url, 48), cluster.pid("pdserve-router-1")
    got = asyncio.run(_under_load(load, texts, lambda: killed(pid), lambda: load.progress > 100))
    assert got == expected
    replaced(cluster, "pdserve-router-1")
    idle(cluster)
    metrics = cluster.metrics()
    assert 'pdserve_replica_restarts_total{replica="pdserve-decode-0",role="decode"} 1.0' in metrics, metrics
    assert 'pdserve_replica_restarts_total{replica="pdserve-prefill-0",role="prefill"} 1.0' in metrics
    assert 'pdserve_replica_restarts_total{replica="pdserve-router-1",role="router"} 1.0' in metrics, metrics
    out = cluster.output()
    for name in ("pdserve-decode-0", "pdserve-prefill-0", "pdserve-router-1"):
        assert f"{name} is down (its process died); starting a replacement" in out, out


def _sum(metrics: str, series: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in metrics.splitlines() if ln.startswith(series))
