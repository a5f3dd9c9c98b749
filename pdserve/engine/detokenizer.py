"""Streaming token ids -> text, and stop strings that may span tokens.

An HF tokenizer decodes through `tokenizers`' own DecodeStream, primed with the prompt's last
tokens; the byte-level tokenizer through ByteDecodeStream. Both hold back an incomplete UTF-8
character until its last byte comes."""

from tokenizers.decoders import DecodeStream

from pdserve.tokenizer import ByteDecodeStream, ByteTokenizer, Tokenizer

# Prompt tokens kept as decode context: enough for tokenizers whose decoders look at neighbours
# (e.g. SentencePiece dropping a leading space), few enough that each decode stays cheap.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a sequence's output ids into text token by token, never emitting half a character.

    An HF tokenizer streams through `tokenizers`' own `DecodeStream`, primed with the prompt's last
    tokens; the byte-level preset tokenizer through `ByteDecodeStream`. Both hold back an
    incomplete character until the token that completes it, or `flush()` at the end.
    """

    def __init__(
        self,
        tokenizer: Tokenizer | ByteTokenizer,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ):
        if isinstance(tokenizer, ByteTokenizer):  # bytes need no context
            self._stream: ByteDecodeStream | _HFDecodeStream = ByteDecodeStream(tokenizer, skip_special_tokens)
        else:
            context = list((prompt_ids or [])[-PROMPT_CONTEXT_TOKENS:])
            self._stream = _HFDecodeStream(tokenizer, context, skip_special_tokens)
        self._chunks: list[str] = []

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks[:] = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def push(self, token_ids: list[int]) -> str:
        """Append sampled ids; return the text they make visible (possibly empty)."""
        return self._emit("".join([self._stream.step(t) or "" for t in token_ids]))

    def flush(self) -> str:
        """The text still held back when generation ends (e.g. a truly incomplete character)."""
        return self._emit(self._stream.flush())

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta


class _HFDecodeStream:
    """`DecodeStream` plus the `flush()` it lacks: it holds back text ending in U+FFFD (a character
    cut between tokens) for good when the ids end there, so the held ids are decoded here then."""

    def __init__(self, tokenizer: Tokenizer, context: list[int], skip_special_tokens: bool):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._context = context  # the latest ids whose text was emitted, as decode context for flush
        self._held: list[int] = []  # ids since then

    def step(self, token_id: int) -> str | None:
        self._held.append(token_id)
        try:
            text = self._stream.step(self._tok.backend, token_id)
        except Exception:  # DecodeStream refuses a decoder that rewrites text it gave already: the
            text = self._window() or None  # plain window difference then, and a fresh stream after it
            ids = (self._context + self._held)[-PROMPT_CONTEXT_TOKENS:]
            self._stream = DecodeStream(ids=ids, skip_special_tokens=self._skip)
        if text is not None:
            self._context, self._held = (self._context + self._held)[-PROMPT_CONTEXT_TOKENS:], []
        return text

    def flush(self) -> str:
        text = self._window() if self._held else ""
        self._context, self._held = (self._context + self._held)[-PROMPT_CONTEXT_TOKENS:], []
        return text

    def _window(self) -> str:
        """The text the held ids add after the context's."""
        prefix = self._tok.decode(self._context, self._skip)
        text = self._tok.decode(self._context + self._held, self._skip)
        return text[len(prefix) :] if len(text) > len(prefix) else ""


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
        self.hit: str | None = None  # the stop string found

    def feed(self, delta: str, check: bool = True) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was hit); after a hit the stop and what follows
        are dropped. With `check` false the delta is not searched (a request short of min_tokens)."""
        if self.stopped:
            return "", True
        start = len(self._pending)
        self._pending += delta
        idx = find_stop(self._pending, self.stops, start) if check else None
        if idx is not None:
            self.stopped = True
            self.hit = next(s for s in self.stops if self._pending.startswith(s, idx))
            out, self._pending = self._pending[:idx], ""
            return out, True
        cut = max(0, len(self._pending) - self._hold)
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        """The held-back tail, once generation has ended without a stop string."""
        out, self._pending = self._pending, ""
        return out
