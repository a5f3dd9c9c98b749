"""Typed messages between the router and the workers (Ray actor calls; no tensors)."""

from dataclasses import dataclass, field


@dataclass
class ReserveResult:
    """A decode replica's answer to a reservation: the handle, or why not."""

    handle: bytes | None  # kvtransfer.ReserveHandle, packed
    error: str | None = None  # the request itself is unacceptable (e.g. too long): a 400
    param: str | None = None


@dataclass
class RequestDelta:
    """New output of one request from one decode step."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # why it failed, when finish_reason == "error"
    logprobs: list = field(default_factory=list)


@dataclass
class ReplicaStats:
    name: str
    role: str
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    aborted: int  # requests aborted on this replica since it started
    # Prefill: (KV bytes, seconds) of the latest deliveries to decode replicas, and how many
    # there have been in all (a reader remembers the count it has seen; nothing is drained).
    transfers: list[tuple[int, float]] = field(default_factory=list)
    transfers_total: int = 0
