"""Typed messages of the KV-transfer protocol, as they go on the wire (msgpack): the reservation handle, the notices."""

import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum

import msgpack

# A token's logprob as a finish notice carries it: (logprob, [(token id, logprob), ...] of its most
# likely alternatives, most likely first).
FirstLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class ReserveHandle:
    """Where a request's KV goes: the decode engine, its block ids, and how long the lease lasts.

    The decode engine may hold the KV of the request's first blocks already (its prefix cache: an
    earlier turn of the conversation): `cached_blocks` says how many, and `block_ids` lists only
    the blocks after them, the ones to write: the request's block i (counting from its first) goes
    to block_ids[i - cached_blocks]. Cached blocks are shared with other requests on the decode
    side, so the prefill end is not given their ids at all: none of its writes can land there.

    The lease crosses as a length, never as a time: the two ends run on different hosts, and a
    wall-clock deadline made on one and read on the other is off by their clocks' skew. Each end
    counts the length on its own monotonic clock from `start`, when it made (decode end) or received
    (prefill end) the handle; `start` never leaves the process."""

    request_id: str
    engine_id: str  # the decode worker
    block_ids: list[int]  # the blocks to write, the same ids in every layer
    lease_s: float  # after it the blocks are reclaimed on both sides
    cached_blocks: int = 0  # the request's leading blocks the decode engine holds already
    # The decode end's staging slot for the request (kvtransfer/staging.py), -1 for none: the
    # prefill end then writes into `block_ids` directly.
    staging: int = -1
    start: float = field(default_factory=time.monotonic, compare=False)

    @property
    def deadline(self) -> float:
        """The lease's end on this process's monotonic clock."""
        return self.start + self.lease_s

    def destination(self, first: int, count: int) -> list[int]:
        """The decode blocks of the request's blocks [first, first + count), all of them past the
        cached ones."""
        at = first - self.cached_blocks
        dst = self.block_ids[at:at + count]
        if at < 0 or len(dst) != count:
            raise ValueError(f"{self.request_id}: blocks [{first}, {first + count}) are not the decode side's to "
                             f"write (it holds {self.cached_blocks} cached, then reserved {len(self.block_ids)})")
        return dst

    def pack(self) -> bytes:
        d = {"request_id": self.request_id, "engine_id": self.engine_id, "block_ids": self.block_ids,
             "lease_s": self.lease_s, "cached_blocks": self.cached_blocks}
        if self.staging >= 0:  # no slot: not on the wire at all
            d["staging"] = self.staging
        return msgpack.packb(d)

    @classmethod
    def unpack(cls, data: bytes) -> "ReserveHandle":
        """The handle as received: its lease counts from now (PrefillWorker.prefill unpacks it on
        the call's arrival)."""
        return cls(**msgpack.unpackb(data))


class NoticeKind(StrEnum):
    """A notice's kind; a plain string on the wire."""

    # All KV written: here is the first token (and its logprob).
    FINISH = "finish"
    # Forget the request. From the prefill end it also says that none of its writes for the request
    # can land any more, which is why the prefill end answers the decode end's abort with one: only
    # then may those blocks be reused.
    ABORT = "abort"


@dataclass
class Notice:
    """A control message between the two ends, sent after the data it refers to."""

    kind: NoticeKind
    request_id: str
    first_token: int = -1
    sender: str = ""  # the engine id of the end that sent it (an abort is answered there)
    # The first token's logprob where the request asked for logprobs: [logprob, [[token id,
    # logprob], ...]] (its most likely alternatives, most likely first); None otherwise, and then
    # not on the wire at all.
    first_logprob: list | None = None
    # An abort from the decode end: how long from its arrival the prefill end must refuse the
    # request's posts, i.e. until no handle of its lease can be posted to any more. 0 (not on the
    # wire) on every other notice.
    refuse_s: float = 0.0

    def __post_init__(self):
        self.kind = NoticeKind(self.kind)

    @classmethod
    def finish(cls, request_id: str, first_token: int, first_logprob: FirstLogprob | None) -> "Notice":
        """The finish notice, its logprob (if any) in wire form."""
        wire = None if first_logprob is None else [first_logprob[0], [[i, v] for i, v in first_logprob[1]]]
        return cls(NoticeKind.FINISH, request_id, first_token, first_logprob=wire)

    @classmethod
    def abort(cls, request_id: str, sender: str, refuse_s: float = 0.0) -> "Notice":
        return cls(NoticeKind.ABORT, request_id, sender=sender, refuse_s=refuse_s)

    def logprob(self) -> FirstLogprob | None:
        """first_logprob as tuples, the form Finished carries."""
        lp = self.first_logprob
        return None if lp is None else (lp[0], [(i, v) for i, v in lp[1]])

    def pack(self) -> bytes:
        d = asdict(self)
        if d["first_logprob"] is None:
            del d["first_logprob"]
        if not d["refuse_s"]:
            del d["refuse_s"]
        return msgpack.packb(d)

    @classmethod
    def unpack(cls, data: bytes) -> "Notice":
        return cls(**msgpack.unpackb(data))
