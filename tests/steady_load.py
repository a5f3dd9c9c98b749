"""A steady load for chaos tests: Poisson arrivals of short greedy streams through the OpenAI client,
on a thread of its own (its own event loop), every request recorded: when it was sent, its time to
first token, whether it completed, and why not.

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

import httpx
import openai

MODEL = "tiny-moe"
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex".split()


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
        """Of the requests that completed (nearest rank); 0 where none did."""
        ttfts = sorted(r.ttft for r in self.requests if r.ttft is not None)
        return ttfts[max(0, math.ceil(0.99 * len(ttfts)) - 1)] if ttfts else 0.0


class SteadyLoad:
    def __init__(self, url: str, rate: float, max_tokens: int = 16, seed: int = 0):
        self.url, self.rate, self.max_tokens = url, rate, max_tokens
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
                task = asyncio.create_task(self._one(client, r, self._prompt()))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
                await asyncio.sleep(self.rng.expovariate(self.rate))
            if self._pending:
                await asyncio.wait(self._pending, timeout=120)

    def _prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 12)))

    async def _one(self, client, r: Sent, prompt: str) -> None:
        try:
            for attempt in range(2):
                try:
                    stream = await client.completions.create(
                        model=MODEL, prompt=prompt, max_tokens=self.max_tokens, temperature=0, stream=True,
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
