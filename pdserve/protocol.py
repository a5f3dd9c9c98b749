"""What a request asks for and gets back, shared by the engine, the workers and the router (which
never imports torch: nothing here does): sampling options, validated where a user can reach them,
and the logprob of a sampled token."""

import math
from dataclasses import dataclass, field


# Stop strings are matched against the tail of the text after every token: each costs time per
# token, and their length bounds how much text is held back from the stream. One rule for HTTP and gRPC.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024  # entries (OpenAI allows 300; vLLM sets no bound)
MAX_CACHE_SALT_CHARS = 512  # a request's own cache_salt (vLLM's field)
MAX_SALT_CHARS = 1024  # the salt an engine takes: the router prefixes a key's scope to the request's own
MAX_REPETITION_PENALTY = 100.0  # a finite bound, so a penalty cannot turn logits into inf or 0


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
    # vLLM's (and OpenAI's) logits processors, applied in the sampler (engine/logits_processors.py)
    # to the whole batch; each at its no-op value costs nothing.
    min_tokens: int = 0  # EOS and stop_token_ids (and stop strings) are held off until this many tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted from a generated token's logit per time it was generated
    repetition_penalty: float = 1.0  # HF/CTRL: a seen token's (prompt or output) logit / p if > 0, * p if < 0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # vLLM's `cache_salt`: mixed into the hash of the prompt's first KV block, so that only requests
    # with the same salt share prefix-cache blocks (a tenant cannot probe another's prompts by their
    # cache hits). The router sets it from the request's API key (router/tenants.py); it travels
    # here, inside the parameters, to every engine that hashes the prompt.
    cache_salt: str | None = None
    # Structured outputs: an llguidance grammar the output must match (built and validated by the
    # front end, pdserve/structured_outputs.py); the sampler masks every other token (engine/grammar.py).
    grammar: str | None = None
    # False: this request's tokens are never drafted, where its replica speculates (a per-request
    # opt-out of decode.speculative / colocated.speculative; the output is the same either way).
    speculative: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.logit_bias:  # JSON keys are strings; the engine indexes by int
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
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
        self._validate_processors()
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt)
                                                <= MAX_SALT_CHARS):
            raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                                    "characters")
        # Read by the sampler for every row of every step: one attribute, so that a batch asking for
        # none of the logits processors pays one look per row (set again by each validate()).
        self.processed = bool(self.logit_bias or self.min_tokens or self.penalized)

    def _validate_processors(self) -> None:
        """The ranges vLLM takes for its logits processors' fields."""
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", f"must be at most max_tokens ({self.max_tokens}), "
                                                    f"got {self.min_tokens}")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise InvalidRequestError(name, f"must be in [-2, 2], got {v!r}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequestError("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY}], "
                                                            f"got {self.repetition_penalty!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if t < 0:
                raise InvalidRequestError("logit_bias", f"token id {t} is negative")
            if not (math.isfinite(b) and -100 <= b <= 100):
                raise InvalidRequestError("logit_bias", f"the bias of token {t} must be in [-100, 100], got {b!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be token ids (integers >= 0)")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids a request names must exist in the model's vocabulary (the engine knows it)."""
        if (bad := [t for t in self.logit_bias if t >= vocab_size]):
            raise InvalidRequestError("logit_bias", f"token id {bad[0]} is outside the vocabulary "
                                                    f"(ids are in [0, {vocab_size}))")
        if (bad := [t for t in self.stop_token_ids if t >= vocab_size]):
            raise InvalidRequestError("stop_token_ids", f"token id {bad[0]} is outside the vocabulary "
                                                        f"(ids are in [0, {vocab_size}))")

    @property
    def penalized(self) -> bool:
        """Whether the sampler needs this request's token counts (any penalty set)."""
        return (self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1)

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
