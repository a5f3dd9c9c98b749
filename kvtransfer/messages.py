"""Typed messages of the KV-transfer protocol (msgpack on the wire)."""

from dataclasses import asdict, dataclass
from enum import StrEnum

import msgpack

# A token's logprob as a finish notice carries it: (logprob, [(token id, logprob), ...] of its most
# likely alternatives, most likely first).
FirstLogprob = tuple[float, list[tuple[int, float]]]


@dataclass
class ReserveHandle:
    """Where a request's KV goes: the decode engine, its block ids, and the lease's end."""

    request_id: str
    engine_id: str  # the decode worker
    block_ids: list[int]  # the same ids in every layer
    deadline: float  # unix time; after it the blocks are reclaimed on both sides

    def pack(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def unpack(cls, data: bytes) -> "ReserveHandle":
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

    def __post_init__(self):
        self.kind = NoticeKind(self.kind)

    @classmethod
    def finish(cls, request_id: str, first_token: int, first_logprob: FirstLogprob | None) -> "Notice":
        """The finish notice, its logprob (if any) in wire form."""
        wire = None if first_logprob is None else [first_logprob[0], [[i, v] for i, v in first_logprob[1]]]
        return cls(NoticeKind.FINISH, request_id, first_token, first_logprob=wire)

    @classmethod
    def abort(cls, request_id: str, sender: str) -> "Notice":
        return cls(NoticeKind.ABORT, request_id, sender=sender)

    def logprob(self) -> FirstLogprob | None:
        """first_logprob as tuples, the form Finished carries."""
        lp = self.first_logprob
        return None if lp is None else (lp[0], [(i, v) for i, v in lp[1]])

    def pack(self) -> bytes:
        d = asdict(self)
        if d["first_logprob"] is None:
            del d["first_logprob"]
        return msgpack.packb(d)

    @classmethod
    def unpack(cls, data: bytes) -> "Notice":
        return cls(**msgpack.unpackb(data))
