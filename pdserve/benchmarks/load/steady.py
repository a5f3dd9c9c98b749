"""A steady load beside a change (the chaos and flip tests, `pdserve.benchmarks.role_flip`): Poisson
arrivals of greedy streams through the OpenAI client, on a thread of its own (its own event loop),
every request recorded: when it was sent, its time to first token, whether it completed, and why not.
Each answer runs to max_tokens (ignore_eos), so every request costs the cluster alike.

A stream whose connection breaks (its router was killed under it) is sent again once, whole, as a
client does on a connection error, and counted in `resent`; its TTFT runs from the first send to
the first token of the answer it got. Any other error, or a second break, is a failed request.
"""

import asyncio
import math
import random
import threading
import time
from dataclasses import dataclass, field

from collections.abc import Callable

import httpx
import openai

MODEL = "tiny-moe"  # the embedded default's model
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


def short_prompts(rng: random.Random) -> str:
    """4 to 12 words: light on a 2-core host's CPU replicas (the tests' default)."""
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))


def numbers(words: int) -> Callable[[random.Random], str]:
    """Prompts of `words` random numbers, about as many tokens each (a benchmark's input length)."""
    return lambda rng: " ".join(str(rng.randrange(1000)) for _ in range(words))


@dataclass
class Sent:
    at: float  # time.monotonic() of its first send
    ttft: float | None = None
    done: bool = False
    error: str | None = None


@dataclass
class Window:
    requests: list[Sent] = field(default_factory=list)

    @property
    def sent(self) -> int:
        return len(self.requests)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.requests if r.error is not None)

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.requests if r.error is not None]

    def ttft_max(self) -> float:
        return max((r.ttft for r in self.requests if r.ttft is not None), default=0.0)

    def ttft_p99(self) -> float:
        return self.ttft_quantile(0.99)

    def ttft_quantile(self, q: float) -> float:
        """Of the requests that completed (nearest rank); 0 where none did."""
        ttfts = sorted(r.ttft for r in self.requests if r.ttft is not None)
        return ttfts[max(0, math.ceil(q * len(ttfts)) - 1)] if ttfts else 0.0


class SteadyLoad:
    def __init__(self, url: str, rate: float, max_tokens: int = 16, seed: int = 0, model: str = MODEL,
                 prompt: Callable[[random.Random], str] = short_prompts):
        self.url, self.rate, self.max_tokens, self.model, self.prompt = url, rate, max_tokens, model, prompt
        self.rng = random.Random(seed)
        self.requests: list[Sent] = []
        self.resent = 0
        self._sending = threading.Event()
        self._stop = False
        self._pending: set[asyncio.Task] = set()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="steady-load", daemon=True)

    def start(self) -> None:
        self._sending.set()
        self._thread.start()

    def stop(self) -> None:
        self._stop = True
        self._sending.set()
        self._thread.join(timeout=180)

    def window(self, t0: float, t1: float) -> Window:
        """The requests first sent in [t0, t1]."""
        return Window([r for r in list(self.requests) if t0 <= r.at <= t1])

    def in_flight(self) -> int:
        return sum(1 for r in list(self.requests) if not r.done)

    def drain(self, timeout_s: float) -> None:
        """Stop sending and wait until every request sent has ended (`resume` sends again)."""
        self._sending.clear()
        deadline = time.monotonic() + timeout_s
        while self.in_flight():
            assert time.monotonic() < deadline, f"{self.in_flight()} requests still in flight after {timeout_s} s"
            time.sleep(0.1)

    def resume(self) -> None:
        self._sending.set()

    async def _run(self) -> None:
        async with openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="-", max_retries=0, timeout=120) as client:
            while not self._stop:
                if not self._sending.is_set():
                    await asyncio.sleep(0.05)
                    continue
                r = Sent(time.monotonic())
                self.requests.append(r)
                task = asyncio.create_task(self._one(client, r, self.prompt(self.rng)))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
                await asyncio.sleep(self.rng.expovariate(self.rate))
            if self._pending:
                await asyncio.wait(self._pending, timeout=120)

    async def _one(self, client, r: Sent, prompt: str) -> None:
        try:
            for attempt in range(2):
                try:
                    stream = await client.completions.create(
                        model=self.model, prompt=prompt, max_tokens=self.max_tokens, temperature=0, stream=True,
                        extra_body={"ignore_eos": True})
                    finish = None
                    async for chunk in stream:
                        if r.ttft is None and chunk.choices and chunk.choices[0].text:
                            r.ttft = time.monotonic() - r.at
                        if chunk.choices and chunk.choices[0].finish_reason:
                            finish = chunk.choices[0].finish_reason
                    if finish != "length":  # ignore_eos: every answer runs to max_tokens
                        raise AssertionError(f"the stream ended with finish_reason {finish!r}")
                    return
                except (openai.APIConnectionError, httpx.TransportError):
                    if attempt == 1:
                        raise
                    self.resent += 1
                    r.ttft = None  # (the answer that counts is the one sent again)
        except Exception as e:
            r.error = f"{type(e).__name__}: {e}"
        finally:
            r.done = True
