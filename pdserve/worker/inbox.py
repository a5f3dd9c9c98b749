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
    output_ids: list[int] = field(default_factory=list)  # generated already (NewRequest.output_ids)
    priority: int = 0  # NewRequest.priority


@dataclass
class Prefill:
    """A prompt for a prefill engine, its KV bound for the decode blocks the handle names."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: object  # kvtransfer.ReserveHandle
    output_ids: list[int] = field(default_factory=list)  # their KV is computed and sent too
    priority: int = 0  # NewRequest.priority


@dataclass
class Reserve:
    """Blocks for a prompt's KV on a decode engine; the answer (a packed ReserveHandle, or None when
    full) is set on `answer` at the step boundary that takes it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prefill_id: str
    router: str
    output_ids: list[int] = field(default_factory=list)  # their KV comes with the prompt's
    priority: int = 0  # NewRequest.priority
    answer: Future = field(default_factory=Future)


@dataclass
class Abort:
    request_id: str
