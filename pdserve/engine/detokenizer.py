"""Streaming token ids -> text, and stop strings that may span tokens."""

from pdserve.tokenizer import ByteTokenizer, Tokenizer

# Prompt tokens kept as decode context: enough for tokenizers whose decoders look at neighbours
# (e.g. SentencePiece dropping a leading space), few enough that each decode stays cheap.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a sequence's output ids into text a few tokens at a time, never emitting half a character.

    Each step decodes only the window `ids[prefix_offset:]` and subtracts the text of
    `ids[prefix_offset:read_offset]` (already emitted), so a token costs O(window), not O(output).
    """

    def __init__(
        self,
        tokenizer: Tokenizer | ByteTokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list((prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = len(self._ids)  # ids before this are already visible as text
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_ids: list[int]) -> str:
        """Append sampled ids; return the text they make visible (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text, new_text = self._decode_window()
        # A trailing U+FFFD is usually a multi-byte character cut between tokens: wait for the rest.
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text[len(prefix_text) :])

    def flush(self) -> str:
        """The text still held back when generation ends (e.g. a truly incomplete character)."""
        prefix_text, new_text = self._decode_window()
        return self._emit(new_text[len(prefix_text) :]) if len(new_text) > len(prefix_text) else ""

    def _decode_window(self) -> tuple[str, str]:
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self.skip_special_tokens)
        new_text = decode(self._ids[self._prefix_offset :], self.skip_special_tokens)
        return prefix_text, new_text

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._chunks.append(delta)
        return delta


def find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index in `text` where the earliest stop string begins, looking only at matches that reach `start` or later."""
    max_len = max((len(s) for s in stops), default=0)
    search_from = max(0, start - max_len + 1)
    hits = [i for s in stops if s and (i := text.find(s, search_from)) != -1]
    return min(hits, default=None)


class StopChecker:
    """Filters streamed text so a stop string, even one split across tokens, is never emitted in part."""

    def __init__(self, stops: list[str]):
        self.stops: list[str] = [s for s in stops if s]  # an empty stop would match everywhere
        # Text that could still be the start of a stop string is held until the next delta decides it.
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit); after a hit the stop and what follows are dropped."""
        if self.stopped:
            return "", True
        start = len(self._pending)
        self._pending += delta
        idx = find_stop(self._pending, self.stops, start)
        if idx is not None:
            self.stopped = True
            out, self._pending = self._pending[:idx], ""
            return out, True
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back tail, once generation has ended without a stop string."""
        out, self._pending = self._pending, ""
        return out
