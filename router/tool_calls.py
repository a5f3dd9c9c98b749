"""Tool calling on /v1/chat/completions: what `tool_choice` asks of the output, and the response
worded with OpenAI's `tool_calls`, whole or as stream deltas.

- "none": the text is the message's content.
- "auto" (the default when tools are sent): the model's own calls, in its family's format, parsed
  out of the text (router/tool_parsers.py); the text before the first call stays content. Streamed,
  each call's name goes out once written, then its arguments as they are (router/tool_stream.py).
- a named function: the output is forced (a grammar, as vLLM does) to that function's arguments,
  a JSON object of its `parameters` schema: the call streams as its arguments are generated.
- "required": forced to a JSON list of calls, [{"name": ..., "parameters": {...}}, ...] (vLLM's form),
  streamed as auto's are.
A choice with calls ends with finish_reason "tool_calls"."""

import json
import uuid

from pdserve.protocol import InvalidRequestError
from pdserve.messages import RequestDelta
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.openai_responses import ChatShape, sse_event
from pdserve.router.tool_parsers import ParsedCall, ToolParser
from pdserve.router.tool_stream import PARTIAL, PartialCall, Scans
from pdserve.structured_outputs import GrammarTokenizer, json_schema_grammar

_ANY_OBJECT = {"type": "object"}


class ToolChoice:
    """A request's tool_choice, checked against its tools: `mode` none | auto | required | named."""

    def __init__(self, body: ChatCompletionRequest):
        self.tools = {t.function.name: t.function.parameters or _ANY_OBJECT for t in body.tools or []}
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if self.tools else "none")
        self.name: str | None = None
        if isinstance(choice, dict):
            self.mode, self.name = "named", choice["function"]["name"]
            if self.name not in self.tools:
                known = ", ".join(map(repr, self.tools)) or "none"
                raise InvalidRequestError("tool_choice", f"names the function {self.name!r}, which is not "
                                                         f"among the request's tools ({known})")
        else:
            self.mode = choice
        if self.mode in ("required", "named") and not self.tools:
            raise InvalidRequestError("tool_choice", f"{choice!r} needs tools")

    def grammar(self, tokenizer: GrammarTokenizer | None = None) -> str | None:
        """The grammar forcing the call(s), for "required" and a named function; None otherwise."""
        if self.mode == "named":
            return json_schema_grammar("tools", self.tools[self.name], tokenizer)
        if self.mode == "required":
            calls = [{"type": "object", "properties": {"name": {"const": n}, "parameters": schema},
                      "required": ["name", "parameters"], "additionalProperties": False}
                     for n, schema in self.tools.items()]
            return json_schema_grammar("tools", {"type": "array", "minItems": 1, "items": {"anyOf": calls}}, tokenizer)
        return None

    def calls(self, text: str, parser: ToolParser) -> tuple[str, list[ParsedCall]]:
        """A finished text as (content, calls); text that holds no call (cut short, or a model that
        wrote none) is all content."""
        if self.mode == "named":
            return ("", [ParsedCall(self.name, text)]) if _is_object(text) else (text, [])
        if self.mode == "required":
            listed = _loads(text)
            if isinstance(listed, list) and listed and all(isinstance(c, dict) and "name" in c for c in listed):
                return "", [ParsedCall(c["name"], json.dumps(c.get("parameters", {}), ensure_ascii=False))
                            for c in listed]
            return text, []
        if self.mode == "auto":
            return parser.parse(text)
        return text, []


def _loads(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _is_object(text: str) -> bool:
    return isinstance(_loads(text), dict)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _tool_call(index: int, call: ParsedCall) -> dict:
    return {"index": index, "id": _call_id(), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


class ToolCallShape(ChatShape):
    """A chat choice whose output may be tool calls (ToolChoice's mode not "none")."""

    def __init__(self, request_id: str, model: str, want_logprobs: bool, include_usage: bool,
                 choice: ToolChoice, parser: ToolParser, index: int = 0, **usage):
        super().__init__(request_id, model, want_logprobs, include_usage, index, **usage)
        self.tool_choice, self.parser = choice, parser
        self._text = ""  # the stream's text so far
        self._shown = 0  # how much of it went out as content
        self._named_id: str | None = None  # a named call's id, once its first delta went out
        self._sent: list[int] = []  # auto / required: each call opened so far, how much of its arguments went out
        self._called = False  # the finished text held calls
        self._scans = Scans()  # the calls' JSON scanned so far

    def _choice(self, deltas: list[RequestDelta]) -> dict:
        choice = super()._choice(deltas)
        content, calls = self.tool_choice.calls(choice["message"]["content"], self.parser)
        if calls:
            # (A message's calls carry no index; a stream's deltas do.)
            choice["message"] = {"role": "assistant", "content": content or None,
                                 "tool_calls": [{k: v for k, v in _tool_call(0, c).items() if k != "index"}
                                                for c in calls]}
            choice["finish_reason"] = "tool_calls"
        return choice

    def event(self, delta: RequestDelta) -> str | None:
        chunk = self.chunk(delta)  # (not the text-only template of plain content)
        return None if chunk is None else sse_event(chunk)

    def chunk(self, delta: RequestDelta) -> dict | None:
        self.completion_tokens += len(delta.token_ids)
        self._text += delta.text
        finished = delta.finish_reason is not None
        out: dict = {}
        if self.tool_choice.mode == "named":
            if delta.text or (finished and self._named_id is None and self._text):
                if self._named_id is None:
                    self._named_id = _call_id()
                    call = {"index": 0, "id": self._named_id, "type": "function",
                            "function": {"name": self.tool_choice.name, "arguments": delta.text}}
                else:
                    call = {"index": 0, "function": {"arguments": delta.text}}
                out["tool_calls"] = [call]
            reason = "tool_calls" if finished and self._named_id else delta.finish_reason
        else:
            content, calls = self._stream_text(finished)
            if content:
                out["content"] = content
            if calls:
                out["tool_calls"] = calls
            reason = "tool_calls" if finished and self._called else delta.finish_reason
        if not out and not finished:
            return None
        logprobs = self._logprobs(delta.logprobs) if self.want_logprobs else None
        return self._envelope(self.chunk_object, [{"index": self.index, "delta": out, "logprobs": logprobs,
                                                   "finish_reason": reason, "stop_reason": delta.stop_reason}],
                              **self._usage_now())

    def _stream_text(self, finished: bool) -> tuple[str, list[dict]]:
        """The content to send now, and the tool-call deltas: text from the parser's start marker (all
        of a "required" list) is read as calls as it comes (router/tool_stream.py): each call opens
        with its id and name once the name is whole, then its arguments go out in fragments as the
        model writes them. At the end, calls the reading missed go out whole, and text that held no
        call after all is content."""
        required = self.tool_choice.mode == "required"
        content = "" if required else self._content_piece()
        at = 0 if required else self._text.find(self.parser.start)
        reader = PARTIAL["required" if required else self.parser.name]
        deltas = self._call_deltas(reader(self._text, at, self._scans)) if at >= 0 else []
        if finished:
            final_content, calls = self.tool_choice.calls(self._text, self.parser)
            if calls:
                content += final_content[self._shown:]
                deltas += [self._open(i, c.name, c.arguments) for i, c in enumerate(calls) if i >= len(self._sent)]
            elif not self._sent:  # no call in it: all content
                content += self._text[self._shown:]
            self._shown, self._called = len(self._text), bool(calls)
        return content, deltas

    def _content_piece(self) -> str:
        """Content up to the parser's start marker, less a tail that may begin it."""
        marker = self.parser.start
        at = self._text.find(marker, self._shown)
        if at < 0:  # all of it but a tail that may begin the marker
            at = len(self._text)
            for k in range(min(len(marker) - 1, len(self._text)), 0, -1):
                if marker.startswith(self._text[-k:]):
                    at = len(self._text) - k
                    break
        piece, self._shown = self._text[self._shown:at], max(self._shown, at)
        return piece

    def _call_deltas(self, calls: list[PartialCall]) -> list[dict]:
        """The deltas of what the calls read so far add to what went out: a call's opening (in order,
        once its name is whole), then its new arguments text."""
        deltas = []
        for i, call in enumerate(calls):
            if i == len(self._sent):
                if call.name is None:
                    break
                deltas.append(self._open(i, call.name, call.arguments(self._text)))
            elif len(call) > self._sent[i]:
                new = call.arguments(self._text)[self._sent[i]:] if call.whole is not None else \
                    self._text[call.start + self._sent[i]:call.stop]
                deltas.append({"index": i, "function": {"arguments": new}})
                self._sent[i] = len(call)
        return deltas

    def _open(self, index: int, name: str, arguments: str) -> dict:
        self._sent.append(len(arguments))
        return _tool_call(index, ParsedCall(name, arguments))
