"""What the front ends (HTTP, gRPC) and the request lifecycle exchange."""

import asyncio
import functools
import math
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from pdserve.messages import Request, RequestDelta
from pdserve.structured_outputs import GrammarTokenizer


class NoCapacityError(RuntimeError):
    """Every decode replica is full: the client should retry later (HTTP 503 with Retry-After, gRPC
    UNAVAILABLE with retry pushback)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OverloadedError(RuntimeError):
    """The service cannot take the request now: its predicted time to first token is over the SLO,
    or the router's queue is full (or it waited there past router.queue_wait_s, or a request of a
    higher priority took its place). HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED with a
    `retry-after` trailer. `reason` labels the refusal in /metrics."""

    def __init__(self, message: str, reason: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> int:
        """Whole seconds, at least 1: HTTP's Retry-After, and gRPC's `retry-after` trailer alike."""
        return max(1, math.ceil(self.retry_after_s))


class ServingError(RuntimeError):
    """The request failed inside the service (a replica died, a transfer failed)."""


class ReplicaUnavailableError(ServingError):
    """No live replica of a role can take the request (HTTP 503, gRPC UNAVAILABLE); the message names the role."""


class DirectWriter(Protocol):
    """A front end's writer of one request's stream, which a core may hand an ordinary delta (text
    and tokens, unfinished) at once, in the call that brought it, instead of through the iterator."""

    def write(self, delta) -> bool:
        """Write the delta (it has text, token_ids, finish_reason None and logprobs) to the client now;
        False when it cannot (nothing written): the core then sends it through the iterator."""
        ...


class ServingCore(Protocol):
    """What a front end needs from the router. tokenize and apply_chat_template block for as long
    as their text takes: front ends call them through `off_loop`."""

    model_name: str  # the one model this service serves (its id in /v1/models)
    max_model_len: int
    chat_template: str | None  # the model's (the tool-call format is read from it), None if it has none
    grammar_tokenizer: GrammarTokenizer  # the model's tokenizer as llguidance's: grammars are checked against it

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; False for text a chat template rendered (it carries its own BOS)."""
        ...

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            template_kwargs: dict | None = None, add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat, rendered by the model's template as HF's `apply_chat_template` does:
        `tools` (OpenAI tool definitions) as its `tools` variable, each key of `template_kwargs` as a variable
        of its own. Raises ValueError when there is no template, a key would replace a variable the renderer
        sets itself (messages, add_generation_prompt, bos_token, ...), or the template rejects its input."""
        ...

    def detokenize(self, ids: list[int]) -> str:
        """The text of token ids, special tokens included (vLLM's /detokenize)."""
        ...

    def generate(self, request: Request, direct: DirectWriter | None = None) -> AsyncIterator[RequestDelta]:
        """Stream the request's output; closing the iterator early (aclose) aborts the request
        everywhere. Raises NoCapacityError before the first delta when nothing can take it,
        InvalidRequestError for a request the engine refuses (e.g. a prompt over the context).
        With `direct`, the core may hand deltas after the first straight to it while the iterator's
        consumer waits with nothing in hand (in order: never one past a delta still in the iterator);
        the first and the last delta always come through the iterator. A core may ignore it."""
        ...

    def ready(self) -> bool:
        """True when every role the cluster has (prefill and decode, or colocated) has a live replica."""
        ...

    def degraded(self) -> dict[str, str]:
        """Replicas that are down or draining now, and why ("down: ...", "draining"); {} when all serve."""
        ...


T = TypeVar("T")

# Tokenizing a long prompt or rendering a chat template holds a thread for milliseconds (seconds
# for a long prompt): never the event loop's, which writes every other request's stream. Two
# threads: the loop still gets its share of the GIL while both run pure-Python templates, and a
# burst of chats waits here rather than in the loop.
_TOKENIZE_THREADS = ThreadPoolExecutor(2, thread_name_prefix="pdserve-tokenize")
DEFAULT_MAX_TOKENIZE_QUEUE = 256  # router.max_tokenize_queue


class _TokenizeQueue:
    """How many calls wait for or run on the tokenizing threads, at most `limit`: the pool's own
    queue has no bound, and every request shares it (a flood of long prompts would hold every other
    request's tokenizing behind it, and their memory)."""

    def __init__(self, limit: int):
        self.limit, self.queued = limit, 0


_queue = _TokenizeQueue(DEFAULT_MAX_TOKENIZE_QUEUE)


def limit_tokenize_queue(limit: int) -> None:
    """router.max_tokenize_queue, set by the router as it starts (the pool is the process's)."""
    _queue.limit = limit


async def off_loop(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a tokenizing thread, awaited. Raises OverloadedError (429) while
    router.max_tokenize_queue calls wait or run there already."""
    if _queue.queued >= _queue.limit:
        raise OverloadedError(f"the router's tokenizer queue is full ({_queue.limit} prompts waiting, "
                              f"router.max_tokenize_queue); try again shortly", "tokenize_queue")
    _queue.queued += 1
    try:
        return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_THREADS,
                                                                functools.partial(fn, *args, **kwargs))
    finally:
        _queue.queued -= 1
