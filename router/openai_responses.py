"""The OpenAI API's response side: how each generation endpoint words its response, its stream chunks
(server-sent events) and its logprobs, from the core's deltas."""

import json
import time
from json.encoder import encode_basestring_ascii  # what json.dumps does to a str: the same bytes, without its wrapper
from typing import Any

from pdserve.protocol import TokenLogprob
from pdserve.router.openai_protocol import CHAT, COMPLETIONS
from pdserve.messages import RequestDelta

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same value


def _alternatives(t: TokenLogprob) -> list[tuple[str, float]]:
    """A token's most likely alternatives as (text, logprob). Tokens are named by their text, as vLLM
    does: the engine's detokenizer gives each its own (TokenLogprob.text, .top_texts)."""
    return [(text, value) for text, (_, value) in zip(t.top_texts, t.top)]


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


def token_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse_event(payload: dict | str) -> str:
    """One server-sent event: a chunk as JSON, or the literal `[DONE]` that ends a stream."""
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


DONE_EVENT = sse_event("[DONE]")
_TEXT_SLOT = "\x00pdserve-text\x00"  # stands for a chunk's text while its event's template is cut out


class ResponseShape:
    """How one endpoint words its response, its stream chunks and its logprobs."""

    endpoint = ""
    object = ""
    chunk_object = ""

    def __init__(self, request_id: str, model: str, want_logprobs: bool, include_usage: bool, index: int = 0,
                 *, prompt_tokens: int = 0, continuous_usage: bool = False):
        """index: the choice this shape words (a request of several choices has a shape per choice);
        continuous_usage: every chunk carries the choice's usage so far (prompt_tokens, and the
        tokens its chunks have carried), vLLM's stream_options.continuous_usage_stats."""
        self.id, self.model = request_id, model
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.index = index
        self.continuous_usage, self.prompt_tokens, self.completion_tokens = continuous_usage, prompt_tokens, 0
        self.created = int(time.time())
        self._text_event: tuple[str, str] | None = None  # a text-only chunk's event around its JSON text

    def event(self, delta: RequestDelta) -> str | None:
        """The stream event (`data: ...` and its blank line) for one delta, or None when it has nothing
        to show. Most deltas of a stream are text only: their event is a per-request template around
        the text's JSON, the bytes json.dumps would give for the whole chunk.

        A delta whose tokens have no text yet (part of a UTF-8 character, text held back while it may
        begin a stop string) still gets its event, with empty text, as vLLM sends it: a client times
        its first token, and its gaps, by the chunks it reads."""
        if delta.finish_reason is None and not self.want_logprobs and not self.continuous_usage:
            if not delta.text and not delta.token_ids:
                return None
            if self._text_event is None:
                self._text_event = self._cut_template()
            head, tail = self._text_event
            return head + encode_basestring_ascii(delta.text) + tail
        chunk = self.chunk(delta)
        return None if chunk is None else sse_event(chunk)

    def _cut_template(self) -> tuple[str, str]:
        head, tail = sse_event(self.chunk(RequestDelta("", _TEXT_SLOT, []))).split(json.dumps(_TEXT_SLOT))
        return head, tail

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def response(self, deltas: list[RequestDelta], usage: dict) -> dict:
        return self._envelope(self.object, [self.choice(deltas)], usage=usage)

    def choice(self, deltas: list[RequestDelta]) -> dict:
        """The choice of a finished request, from all its deltas (a response's `choices` entry)."""
        return self._choice(deltas) | {"stop_reason": deltas[-1].stop_reason}

    def opening_chunks(self) -> list[dict]:
        return []

    def chunk(self, delta: RequestDelta) -> dict | None:
        """The stream chunk for one delta, or None when it has nothing to show."""
        self.completion_tokens += len(delta.token_ids)
        if (not delta.text and not delta.token_ids and delta.finish_reason is None
                and not (self.want_logprobs and delta.logprobs)):
            return None
        return self._envelope(self.chunk_object, [self._choice_delta(delta) | {"stop_reason": delta.stop_reason}],
                              **self._usage_now())

    def _usage_now(self) -> dict:
        """A chunk's usage field: none without include_usage, null with it, the usage so far with
        continuous_usage."""
        if self.continuous_usage:
            return {"usage": token_usage(self.prompt_tokens, self.completion_tokens)}
        return {"usage": None} if self.include_usage else {}

    def usage_chunk(self, usage: dict) -> dict:
        return self._envelope(self.chunk_object, [], usage=usage)

    def _choice(self, deltas: list[RequestDelta]) -> dict:
        raise NotImplementedError

    def _choice_delta(self, delta: RequestDelta) -> dict:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    endpoint, object, chunk_object = COMPLETIONS, "text_completion", "text_completion"

    def __init__(self, request_id: str, model: str, want_logprobs: bool, include_usage: bool, index: int = 0,
                 **usage):
        super().__init__(request_id, model, want_logprobs, include_usage, index, **usage)
        # Streaming: where the next token's text starts. Offsets follow the tokens' own texts, not the
        # chunks' (text that may begin a stop string is held back from a chunk, never from its token).
        self._next_offset = 0

    def _choice(self, deltas: list[RequestDelta]) -> dict:
        logprobs, offset = None, 0
        if self.want_logprobs:
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            for d in deltas:
                part, offset = self._logprobs(d.logprobs, offset)
                for key, values in part.items():
                    logprobs[key] += values
        text = "".join(d.text for d in deltas)
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": deltas[-1].finish_reason}

    def _choice_delta(self, delta: RequestDelta) -> dict:
        logprobs = None
        if self.want_logprobs:
            logprobs, self._next_offset = self._logprobs(delta.logprobs, self._next_offset)
        return {"index": self.index, "text": delta.text, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    @staticmethod
    def _logprobs(lps: list[TokenLogprob], text_offset: int) -> tuple[dict, int]:
        """The tokens' entries, each token's text_offset where its own text starts in the completion's
        text (from `text_offset` on); and where the next token's text starts."""
        offsets = []
        for t in lps:
            offsets.append(text_offset)
            text_offset += len(t.text)
        return {"tokens": [t.text for t in lps],
                "token_logprobs": [_lp(t.logprob) for t in lps],
                "top_logprobs": [{text: _lp(v) for text, v in _alternatives(t)} for t in lps],
                "text_offset": offsets}, text_offset


class ChatShape(ResponseShape):
    endpoint, object, chunk_object = CHAT, "chat.completion", "chat.completion.chunk"

    def opening_chunks(self) -> list[dict]:
        # OpenAI sends the role alone first; clients key the assistant message on it.
        first = {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self._envelope(self.chunk_object, [first], **self._usage_now())]

    def _choice(self, deltas: list[RequestDelta]) -> dict:
        text = "".join(d.text for d in deltas)
        logprobs = self._logprobs([t for d in deltas for t in d.logprobs]) if self.want_logprobs else None
        return {"index": self.index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                "finish_reason": deltas[-1].finish_reason}

    def _choice_delta(self, delta: RequestDelta) -> dict:
        logprobs = self._logprobs(delta.logprobs) if self.want_logprobs else None
        # An empty content where the tokens have no text yet (vLLM's too); none on a last chunk without text.
        content = {"content": delta.text} if delta.text or delta.finish_reason is None else {}
        return {"index": self.index, "delta": content, "logprobs": logprobs, "finish_reason": delta.finish_reason}

    @staticmethod
    def _logprobs(lps: list[TokenLogprob]) -> dict:
        def entry(text: str, value: float) -> dict:  # the token's text and its UTF-8 bytes, as OpenAI
            return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}
        return {"content": [entry(t.text, t.logprob) | {"top_logprobs": [entry(*a) for a in _alternatives(t)]}
                            for t in lps]}
