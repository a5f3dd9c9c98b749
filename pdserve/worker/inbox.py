"""What actor calls hand a worker's engine loop (EngineLoop.submit): one typed item per piece of
work, taken between two steps on the loop's thread."""

from concurrent.futures import Future
from dataclasses import dataclass, field

from pdserve.messages import Request


class _OfRequest:
    request: Request

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass
class Generate(_OfRequest):
    """A whole request for an engine to prefill and decode (a colocated one, or a decode one prefilling
    it locally); its output streams to `router`."""

    request: Request
    router: str


@dataclass
class Prefill(_OfRequest):
    """A prompt for a prefill engine (and a moved request's output_ids: their KV is computed and
    sent too), its KV bound for the decode blocks the handle names."""

    request: Request
    handle: object  # kvtransfer.ReserveHandle


@dataclass
class Reserve(_OfRequest):
    """Blocks for a prompt's KV (and a moved request's output_ids') on a decode engine; the answer (a
    packed ReserveHandle, or None when full) is set on `answer` at the step boundary that takes it."""

    request: Request
    prefill_id: str
    router: str
    answer: Future = field(default_factory=Future)


@dataclass
class Abort:
    request_id: str
