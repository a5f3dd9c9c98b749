"""What the engine hands back per step, and the per-request text state behind it."""

from dataclasses import dataclass, field

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopChecker
from pdserve.protocol import TokenLogprob
from pdserve.engine.sequence import FinishReason


@dataclass
class RequestOutput:
    """New tokens of one request from one step (a delta, not the whole text)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Prefill role: the blocks that hold the prompt's KV (the same ids in every layer). They stay
    # allocated until Engine.release(request_id).
    kv_block_ids: list[int] | None = None
    error: str | None = None  # why it failed (finish_reason ERROR)


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_cached_tokens: int = 0


class TextStream:
    """Turns a request's tokens into text deltas, stopping at (and cutting before) a stop string."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], output_ids: list[int] = ()):
        """`output_ids`: tokens a resumed request generated already, whose text its client has. They
        are pushed here and their text dropped, so that what is held back (the bytes of an unfinished
        character, text that may begin a stop string) is what the undisturbed run held at that
        point: the next token's text continues the client's, and a stop string across the seam is
        found. (A stop string among them would have ended the request there; should one be found, the
        next token ends it.)"""
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stop = StopChecker(stops)
        # The text the latest token added (flushed text included), before stop strings cut it: the
        # token's own text, in logprobs.
        self.token_text = ""
        for t in output_ids:
            self.push(t)

    def push(self, token_id: int, check_stops: bool = True) -> tuple[str, bool]:
        """Text safe to show after this token, and whether a stop string was hit (not looked for with
        `check_stops` false: a request short of its min_tokens)."""
        self.token_text = self.detok.push([token_id])
        return self.stop.feed(self.token_text, check_stops)

    @property
    def stop_hit(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self.stop.hit

    def push_stop_token(self) -> str:
        """A stop token (eos, a stop id) ends generation: its own text is not shown, what is still
        held back is (as the stop token's text)."""
        self.token_text = ""
        return self.flush()[0]

    def flush(self) -> tuple[str, bool]:
        """Everything still held back, at the end of generation, and whether a stop string was hit
        in it: the detokenizer holds back the bytes of an unfinished character, which a stop
        string may end with."""
        rest = self.detok.flush()
        self.token_text += rest
        text, hit = self.stop.feed(rest)
        return (text, True) if hit else (text + self.stop.flush(), False)
