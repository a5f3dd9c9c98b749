"""Typed messages of the KV-transfer protocol (msgpack on the wire)."""

from dataclasses import asdict, dataclass

import msgpack


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


@dataclass
class Notice:
    """A control message between the two ends, sent after the data it refers to."""

    # "finish": all KV written, here is the first token (and its logprob). "abort": forget the
    # request; from the prefill end it also says that none of its writes for the request can land any
    # more, which is why the prefill end answers the decode end's abort with one: only then may those
    # blocks be reused.
    kind: str
    request_id: str
    first_token: int = -1
    sender: str = ""  # the engine id of the end that sent it (an abort is answered there)
    # The first token's logprob where the request asked for logprobs: [logprob, [[token id,
    # logprob], ...]] (its most likely alternatives, most likely first); None otherwise, and then
    # not on the wire at all.
    first_logprob: list | None = None

    def pack(self) -> bytes:
        d = asdict(self)
        if d["first_logprob"] is None:
            del d["first_logprob"]
        return msgpack.packb(d)

    @classmethod
    def unpack(cls, data: bytes) -> "Notice":
        return cls(**msgpack.unpackb(data))
