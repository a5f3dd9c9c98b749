"""A request's state inside the engine: its tokens, how many have KV, and the blocks holding it."""

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum, auto

from pdserve.protocol import SamplingParams

# A sampled token the host has not seen yet: the next step reads it on the device (overlap).
PENDING = -1


class SeqStatus(Enum):
    WAITING = auto()  # queued, holds no blocks
    RUNNING = auto()  # scheduled every step: prefilling chunks or decoding
    PREFILLED = auto()  # prefill role: KV computed, blocks held until the connector releases them
    FINISHED = auto()


class FinishReason(str, Enum):
    STOP = "stop"  # eos, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"
    ERROR = "error"  # it could not run here (its grammar did not compile): RequestOutput.error says why


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by every generated token
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float = 0.0
    # Who is served first: the lower priority, then the earlier arrival (vLLM's rule, so that its
    # clients' `priority` means the same here). `arrival_no` orders arrivals within one engine.
    priority: int = 0
    arrival_no: int = 0
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in this sequence's blocks
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hash chain of the full blocks so far
    # The chain over the prompt's full blocks as the prefix-cache lookup computed it (hits and
    # misses): registering the missed blocks once computed takes their keys from here instead of
    # hashing them again (a 4k prompt: ~250 sha256 calls on the step's host path). A HashChain
    # (block_pool.py) hashed as far as the lookup read until its step is launched.
    lookup_hashes: Seq[bytes] = field(default_factory=list)
    cache_root: bytes | None = None  # the parent of its first block's key: block_pool.salt_root(cache_salt)
    finish_reason: FinishReason | None = None
    logprobs: list[dict] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def order(self) -> tuple[int, int]:
        """The scheduler's key: lower is admitted first and preempted last."""
        return self.priority, self.arrival_no

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
