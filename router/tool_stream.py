"""Tool calls read out of a text still being generated, as far as it goes: for each call its name once
written whole, and the text of its arguments so far — what a stream sends as OpenAI's tool-call deltas
(the name first, then the arguments in fragments, as vLLM does), while router/tool_parsers.py reads
the finished text. One reader per format (`PARTIAL`, by the parser's name) and one for
tool_choice "required" (vLLM's JSON list of {"name", "parameters"}).

The arguments of a call are the raw text of its JSON object as the model writes it, up to the end of
that object: a prefix of it never changes as more text comes, so each fragment is sent once. Arguments
written as a JSON string holding the object (some models) are sent whole, once the string ends."""

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_WS = " \t\r\n"
_SCALAR = re.compile(r"[-+0-9.eEa-z]+")


@dataclass
class PartialCall:
    name: str | None  # None until written whole
    arguments: str  # the arguments' text so far ("" before they begin)
    done: bool  # the arguments ended: `arguments` is all of them


def _skip(text: str, i: int, chars: str = _WS) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Just past the JSON string opening at text[i]; None while it goes on."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Just past the JSON value beginning at text[i]; None while it goes on (or text ends first)."""
    if i >= len(text):
        return None
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth = 0
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    m = _SCALAR.match(text, i)
    return m.end() if m and m.end() < len(text) else None  # (a number may go on at the text's end)


def _members(text: str, i: int) -> Iterator[tuple[str, int, int | None]]:
    """The members of the JSON object whose "{" is text[i], as far as the text goes: (key, where its
    value begins, where it ends or None)."""
    i += 1
    while True:
        i = _skip(text, i, _WS + ",")
        if i >= len(text) or text[i] != '"':
            return
        k_end = _string_end(text, i)
        if k_end is None:
            return
        key = json.loads(text[i:k_end])
        i = _skip(text, k_end)
        if i >= len(text) or text[i] != ":":
            return
        i = _skip(text, i + 1)
        if i >= len(text):
            return
        end = value_end(text, i)
        yield key, i, end
        if end is None:
            return
        i = end


def object_call(text: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> PartialCall:
    """The call written as a JSON object {"name": ..., "arguments": {...}} whose "{" is text[i]."""
    call = PartialCall(None, "", False)
    for key, start, end in _members(text, i):
        if key == "name" and end is not None and text[start] == '"':
            call.name = json.loads(text[start:end])
        elif key in args_keys:
            if text[start] == '"':  # JSON text in a string: whole, once it ends
                call.arguments, call.done = (_unquoted(text[start:end]), True) if end is not None else ("", False)
            elif text[start] == "{":
                call.arguments, call.done = text[start:end], end is not None
    return call


def _unquoted(s: str) -> str:
    try:
        inner = json.loads(s)
        return json.dumps(json.loads(inner), ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        return ""


def listed_calls(text: str, i: int = 0) -> list[PartialCall]:
    """Calls written as a JSON list of objects (or one object) from text[i] on."""
    i = _skip(text, i)
    if i >= len(text):
        return []
    if text[i] == "{":
        return [object_call(text, i)]
    if text[i] != "[":
        return []
    calls, i = [], i + 1
    while True:
        i = _skip(text, i, _WS + ",")
        if i >= len(text) or text[i] != "{":
            return calls
        calls.append(object_call(text, i))
        end = value_end(text, i)
        if end is None:
            return calls
        i = end


def _after(text: str, marker: str) -> list[str]:
    """The pieces of text after each `marker`."""
    return text.split(marker)[1:]


def hermes(text: str) -> list[PartialCall]:
    calls = []
    for body in _after(text, "<tool_call>"):
        i = _skip(body, 0)
        if i < len(body) and body[i] == "{":
            calls.append(object_call(body, i))
    return calls


def _value_from(text: str, i: int) -> tuple[str, bool]:
    """An arguments object from text[i] on (after white space): its text so far, whether it ended."""
    i = _skip(text, i)
    if i >= len(text) or text[i] != "{":
        return "", False
    end = value_end(text, i)
    return text[i:end], end is not None


def deepseek_v3(text: str) -> list[PartialCall]:
    calls = []
    for body in _after(text, "<｜tool▁call▁begin｜>"):
        sep = body.find("<｜tool▁sep｜>")
        line = body.find("\n", sep) if sep >= 0 else -1
        if line < 0:
            break
        call = PartialCall(body[sep + len("<｜tool▁sep｜>"):line].strip(), "", False)
        fence = body.find("```", line)
        opened = body.find("\n", fence + 3) if fence >= 0 else -1
        if opened >= 0:
            call.arguments, call.done = _value_from(body, opened + 1)
        calls.append(call)
    return calls


def mistral(text: str) -> list[PartialCall]:
    first = _after(text, "[TOOL_CALLS]")
    if not first:
        return []
    i = _skip(first[0], 0)
    if i < len(first[0]) and first[0][i] in "[{":
        return listed_calls(first[0], i)
    calls = []
    for body in first:  # the newer NAME[ARGS]{...} form
        at = body.find("[ARGS]")
        if at < 0:
            break
        call = PartialCall(body[:at].strip(), "", False)
        call.arguments, call.done = _value_from(body, at + len("[ARGS]"))
        calls.append(call)
    return calls


PARTIAL: dict[str, Callable[[str], list[PartialCall]]] = {
    "hermes": hermes, "deepseek_v3": deepseek_v3, "mistral": mistral, "required": listed_calls}
