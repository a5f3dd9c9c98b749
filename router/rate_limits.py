"""Per-key rate limits: token buckets for requests and tokens per minute, as OpenAI and LLM gateways
enforce them, on the monotonic clock (a wall clock stepped by NTP would hand out or withhold a
minute's worth at once).

A request is charged as it arrives: one request, and its prompt tokens plus its max_tokens (what it
may cost at most: its real cost is not known until it ends). The part of max_tokens it did not
generate is given back when it ends. A bucket starts full, holds at most a minute's limit and
refills at limit / 60 per second; with several routers on one port each enforces its share
(limit / routers), since the kernel spreads the connections evenly over them."""

import math
import time
from collections.abc import Callable

from pdserve.protocol import InvalidRequestError

Clock = Callable[[], float]  # seconds, monotonic


class TokenBucket:
    """`per_minute` tokens at most, refilled at per_minute / 60 a second."""

    __slots__ = ("capacity", "level", "stamp", "clock")

    def __init__(self, per_minute: float, clock: Clock):
        assert per_minute > 0
        self.capacity, self.clock = per_minute, clock
        self.level, self.stamp = per_minute, clock()

    # Times as tokens * 60 / per_minute (not tokens / (per_minute / 60)): whole figures stay whole,
    # so a bucket a whole number of seconds from enough says so exactly.
    def refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.capacity / 60)
        self.stamp = now

    def wait_s(self, amount: float) -> float:
        """Seconds until the bucket holds `amount` (0: it does now; inf: it never can). Refill first."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level) * 60 / self.capacity)

    def take(self, amount: float) -> None:
        self.level -= amount

    def give(self, amount: float) -> None:
        """Tokens charged and not used come back (never past the capacity)."""
        self.refill()
        self.level = min(self.capacity, self.level + amount)

    def full_in_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return max(0.0, (self.capacity - self.level) * 60 / self.capacity)


class RateLimited(Exception):
    """A key is over one of its limits now: 429 with Retry-After (gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, limit: str, retry_after_s: float, headers: dict[str, str]):
        super().__init__(message)
        self.limit = limit  # "requests" or "tokens": OpenAI's error type for it
        self.retry_after_s = retry_after_s
        self.headers = headers  # Retry-After and the x-ratelimit-* headers


class KeyLimits:
    """One key's buckets in this router: its share of requests_per_minute and tokens_per_minute
    (None: that one is not limited). Used from the router's one event loop only: no lock."""

    def __init__(self, name: str, requests_per_minute: int | None, tokens_per_minute: int | None,
                 routers: int = 1, clock: Clock = time.monotonic):
        self.name, self.routers = name, routers
        self.requests = TokenBucket(requests_per_minute / routers, clock) if requests_per_minute else None
        self.tokens = TokenBucket(tokens_per_minute / routers, clock) if tokens_per_minute else None

    def charge(self, prompt_tokens: int, max_tokens: int, prompt_param: str, max_tokens_param: str,
              ) -> dict[str, str]:
        """Charge one request and prompt_tokens + max_tokens; returns the x-ratelimit-* headers after
        it. Raises RateLimited (nothing charged) when a bucket lacks them now, InvalidRequestError
        naming the field to lower when they can never fit: retrying that could not help, so it is
        no 429 (which clients retry), but a 400 that says what fits."""
        cost = prompt_tokens + max_tokens
        if self.tokens is not None and cost > self.tokens.capacity:
            self._never_fits(prompt_tokens, max_tokens, prompt_param, max_tokens_param)
        self._refuse_unless(1, cost)
        if self.requests is not None:
            self.requests.take(1)
        if self.tokens is not None:
            self.tokens.take(cost)
        return self.headers()

    def charge_request(self) -> dict[str, str]:
        """Charge one request as it arrives, before its prompt is tokenized; its tokens come later
        (charge_tokens). Raises RateLimited (nothing charged) when the requests bucket lacks one, or
        the tokens bucket is empty: a key with nothing left has no prompt of its tokenized."""
        self._refuse_unless(1, 1)
        if self.requests is not None:
            self.requests.take(1)
        return self.headers()

    def _refuse_unless(self, requests: int, tokens: int) -> None:
        """Raise RateLimited, naming every limit short now, unless both buckets hold these amounts."""
        waits = {}
        for limit, bucket, amount in (("requests", self.requests, requests), ("tokens", self.tokens, tokens)):
            if bucket is not None:
                bucket.refill()
                if (wait := bucket.wait_s(amount)) > 0:
                    waits[limit] = (wait, amount)
        if waits:
            raise self._refusal(waits)

    def charge_tokens(self, prompt_tokens: int, max_tokens: int, prompt_param: str, max_tokens_param: str,
                      ) -> dict[str, str]:
        """Charge prompt_tokens + max_tokens of a request charge_request took; as `charge` for the tokens."""
        cost = prompt_tokens + max_tokens
        if self.tokens is None:
            return self.headers()
        if cost > self.tokens.capacity:
            self._never_fits(prompt_tokens, max_tokens, prompt_param, max_tokens_param)
        self.tokens.refill()
        if (wait := self.tokens.wait_s(cost)) > 0:
            raise self._refusal({"tokens": (wait, cost)})
        self.tokens.take(cost)
        return self.headers()

    def refund(self, tokens: int) -> None:
        """`tokens` of what a request was charged were not used: back into the bucket."""
        if self.tokens is not None and tokens > 0:
            self.tokens.give(tokens)

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers: this router's share of each limit, what is left of it, and
        the time until it is full again."""
        out = {}
        for limit, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{limit}"] = str(int(bucket.capacity))
                out[f"x-ratelimit-remaining-{limit}"] = str(max(0, int(bucket.level)))
                out[f"x-ratelimit-reset-{limit}"] = duration(bucket.full_in_s())
        return out

    def _share(self, limit: str) -> str:
        bucket = self.requests if limit == "requests" else self.tokens
        share = f"{limit}_per_minute {bucket.capacity * self.routers:g}"
        if self.routers > 1:
            share += f" (this router's share of {self.routers}: {bucket.capacity:g})"
        return share

    def _refusal(self, waits: dict[str, tuple[float, float]]) -> RateLimited:
        limit = max(waits, key=lambda k: waits[k][0])  # the one that frees last names the error
        wait = max(w for w, _ in waits.values())
        # Retry-After is in whole seconds, rounded up (a nanosecond's float error aside); never 0, which invites a spin.
        retry = max(1, math.ceil(wait - 1e-9))
        reasons = []
        for name, (_, amount) in waits.items():
            bucket = self.requests if name == "requests" else self.tokens
            reasons.append(f"{self._share(name)}: requested {amount:g}, remaining {max(0, int(bucket.level))}")
        message = (f"rate limit reached for API key {self.name!r} on {' and '.join(waits)} per minute — "
                   f"{'; '.join(reasons)}. Try again in {retry} s")
        return RateLimited(message, limit, wait, {"Retry-After": str(retry)} | self.headers())

    def _never_fits(self, prompt_tokens: int, max_tokens: int, prompt_param: str, max_tokens_param: str) -> None:
        room = int(self.tokens.capacity) - prompt_tokens
        cost = f"prompt {prompt_tokens} + {max_tokens_param} {max_tokens} = {prompt_tokens + max_tokens} tokens"
        if room < 1:
            raise InvalidRequestError(prompt_param, f"{cost} can never fit the {self._share('tokens')} of API "
                                                    f"key {self.name!r}: the prompt alone is too long")
        raise InvalidRequestError(max_tokens_param, f"{cost} can never fit the {self._share('tokens')} of API "
                                                    f"key {self.name!r}; set {max_tokens_param} to at most {room}")


def duration(seconds: float) -> str:
    """A time the way OpenAI's x-ratelimit-reset-* headers write it: 120ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{math.ceil(rest * 1000) / 1000:g}s"
    return f"{int(minutes)}m{text}" if minutes else text
