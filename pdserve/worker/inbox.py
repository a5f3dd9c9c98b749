"""What actor calls hand a worker's engine loop (EngineLoop.submit): one typed item per piece of
work, taken between two steps on the loop's thread."""

from concurrent.futures import Future
from dataclasses import dataclass, field

from pdserve.protocol import SamplingParams


@dataclass
class Generate:
    """A whole request for a colocated engine; its output streams to `router`."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    router: str


@dataclass
class Prefill:
    """A prompt for a prefill engine, its KV bound for the decode blocks the handle names."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: object  # kvtransfer.ReserveHandle


@dataclass
class Reserve:
    """Blocks for a prompt's KV on a decode engine; the answer (a packed ReserveHandle, or None when
    full) is set on `answer` at the step boundary that takes it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prefill_id: str
    router: str
    answer: Future = field(default_factory=Future)


@dataclass
class Abort:
    request_id: str
