"""One try at serving a request on some replicas (an attempt), and why one cannot go on (Lost).

A request's first attempt has its own id; each move starts another ("<id>~<n>"), so nothing left
of an earlier one (a late delta, a settling reservation) can mix with it. The lifecycle
(router/lifecycle.py) drives attempts; the replica set counts what they hold where
(router/replica_set.py); admission (router/admission.py) counts them for its forecast.
"""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.messages import Refusal, Request
from pdserve.router.types import DirectWriter, ServingError


@dataclass
class Attempt:
    """One try at serving a request on some replicas."""

    request_id: str  # the id the workers know it by: the request's, then "<id>~<n>" for the n-th move
    move: int = 0  # 0: the request's first attempt
    streaming: bool = False  # its first delta came (its prefill replica's part is done)
    lost: "Lost | None" = None  # why the attempt before this one ended
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    placed: list[str] = field(default_factory=list)  # replicas whose count of our requests it raised
    holders: dict[str, str] = field(default_factory=dict)  # replica -> its worker holding it (aborted there if unfinished)
    # The front end's direct writer (generate's `direct`) and the request's tokens sent so far, once
    # it streams; `parked`: its stream awaits the queue, so nothing it took is still unwritten.
    direct: "DirectWriter | None" = None
    sent: list[int] | None = None
    parked: bool = False
    # What admission counts (router/forecast.py): the request, its tokens streamed so far (the list
    # every attempt of it shares), the decode or colocated replica whose sequence slot it holds (""
    # while it reserves one), and the prefill or colocated replica computing its prompt, until its
    # first token.
    request: Request | None = None
    # When its request reached the lifecycle (perf_counter; 0: timed already, or a move's attempt):
    # the router's `admit` phase runs from then until the attempt is first handed to a worker.
    began: float = 0.0
    tokens: list[int] = field(default_factory=list)
    slot: str | None = None
    prompt_at: str | None = None
    # The prompt tokens it leaves that replica to compute (prefix-aware: less what its cache holds,
    # as the router saw it; other policies: all of them), counted in the replica set's prompt_tokens
    # until its first token.
    to_compute: int | None = None
    prompt_work: int = 0
    # Prefix-aware placement: the prompt's block hashes (with the tokens a move prefills again), a
    # HashChain (computed as read).
    hashes: Sequence[bytes] = ()


class Lost(ServingError):
    """An attempt cannot go on: a replica it needs was lost, or (`transfer`: why) its KV transfer
    failed between two live replicas. The request moves (or, past the migration limit or the wait,
    ends with this error)."""

    def __init__(self, message: str, role: str, transfer: str | None = None):
        super().__init__(message)
        self.role = role
        self.transfer = transfer


def raise_refused(refused: Refusal | None) -> None:
    """A worker refused the request itself (e.g. too long for its KV cache): the client's 400."""
    if refused is not None:
        raise refused.error()
