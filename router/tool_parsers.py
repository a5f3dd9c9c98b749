"""Tool calls out of a model's text, in the formats of the families pdserve serves (vLLM's
`--tool-call-parser` names): `hermes` (Qwen2.5/Qwen3 and other ChatML templates:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), `deepseek_v3`
(`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments as a json code
block) and `mistral` (`[TOOL_CALLS][{"name": ..., "arguments": {...}}]`, or the newer
`[TOOL_CALLS]NAME[ARGS]{...}`). `router.tool_call_parser: auto` picks one by what the model's chat
template writes."""

import json
import re
from dataclasses import dataclass


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


class ToolParser:
    """A format's parser: `start` begins a call in the text; parse() splits a finished text into its
    content (before the first call) and its calls; a text whose calls do not parse is all content."""

    name = ""
    start = ""

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = self._calls(text[at:])
        return (text[:at], calls) if calls else (text, [])

    def _calls(self, text: str) -> list[ParsedCall]:
        raise NotImplementedError


def _call(obj) -> ParsedCall | None:
    """{"name": ..., "arguments": {...}} (or "parameters", as some models write it) as a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class Hermes(ToolParser):
    name, start = "hermes", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def _calls(self, text: str) -> list[ParsedCall]:
        calls = [_call(_json(m)) for m in self._CALL.findall(text)]
        return calls if calls and all(calls) else []


class DeepSeekV3(ToolParser):
    name, start = "deepseek_v3", "<｜tool▁calls▁begin｜>"
    _CALL = re.compile(r"<｜tool▁call▁begin｜>(?:function)?<｜tool▁sep｜>(.*?)\n```(?:json)?\n(.*?)\n```"
                       r"\s*<｜tool▁call▁end｜>", re.DOTALL)

    def _calls(self, text: str) -> list[ParsedCall]:
        calls = [_call({"name": name.strip(), "arguments": _json(args)}) for name, args in self._CALL.findall(text)]
        return calls if calls and all(c and c.arguments != "null" for c in calls) else []


class Mistral(ToolParser):
    name, start = "mistral", "[TOOL_CALLS]"
    _NAMED = re.compile(r"\[TOOL_CALLS\]\s*([^\[\s{]+)\s*\[ARGS\]\s*(\{.*?\})(?=\s*\[TOOL_CALLS\]|\s*$)", re.DOTALL)

    def _calls(self, text: str) -> list[ParsedCall]:
        named = self._NAMED.findall(text)
        if named:
            calls = [_call({"name": n, "arguments": _json(a)}) for n, a in named]
        else:
            listed = _json(text[len(self.start):].strip())
            listed = [listed] if isinstance(listed, dict) else listed
            calls = [_call(c) for c in listed] if isinstance(listed, list) else []
        return calls if calls and all(c and c.arguments != "null" for c in calls) else []


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (Hermes, DeepSeekV3, Mistral)}


def parser_for(configured: str, chat_template: str | None) -> ToolParser:
    """The parser `router.tool_call_parser` names; `auto`: the format the chat template writes (hermes
    when it shows none: ChatML's, the preset's)."""
    if configured != "auto":
        return PARSERS[configured]()
    template = chat_template or ""
    for parser in (DeepSeekV3, Mistral, Hermes):
        if parser.start in template or (parser is DeepSeekV3 and "tool▁calls▁begin" in template):
            return parser()
    return Hermes()
