"""What a request asks for and gets back, shared by the engine, the workers and the router (which
never imports torch: nothing here does): sampling options, validated where a user can reach them,
and the logprob of a sampled token."""

import math
from dataclasses import dataclass, field


# Stop strings are matched against the tail of the text after every token: each costs time per
# token, and their length bounds how much text is held back from the stream. One rule for HTTP and gRPC.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024


class InvalidRequestError(ValueError):
    """A request field a user set is out of range. ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return with each sampled token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs", f"must be between 0 and 20, got {self.logprobs!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop", "must be non-empty strings")
        if any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise InvalidRequestError("stop", f"each stop string may have at most {MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely alternatives, most likely first
    # Filled by the engine as it detokenizes (Engine._emit). `text`: what this token added to the
    # request's text, before stop strings cut it — "" for a stop token, or for one whose bytes the
    # detokenizer holds back (an incomplete character: a later token's text has them) — so that a
    # request's texts join to its text. `top_texts`: each alternative decoded alone (as vLLM names
    # tokens), except this token itself, which reads as `text`.
    text: str = ""
    top_texts: list[str] = field(default_factory=list)
