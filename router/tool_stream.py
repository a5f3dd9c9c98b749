"""Tool calls read out of a text still being generated, as far as it goes: for each call its name once
written whole, and the text of its arguments so far — what a stream sends as OpenAI's tool-call deltas
(the name first, then the arguments in fragments, as vLLM does), while router/tool_parsers.py reads
the finished text. One reader per format (`PARTIAL`, by the parser's name) and one for
tool_choice "required" (vLLM's JSON list of {"name", "parameters"}).

The arguments of a call are the raw text of its JSON object as the model writes it, up to the end of
that object: a prefix of it never changes as more text comes, so each fragment is sent once. Arguments
written as a JSON string holding the object (some models) are sent whole, once the string ends.

A stream reads its text again at each delta, from the first call on; the JSON values met are
scanned once (`Scans`: where each one's scan stopped, resumed when more text came), so a long call
costs its length, not its length times its deltas."""

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

_WS = " \t\r\n"
_SCALAR = re.compile(r"[-+0-9.eEa-z]+")


@dataclass
class PartialCall:
    """A call as far as the text goes; its arguments so far are text[start:stop] (no copy made at
    each delta), or `whole` where they were written as a JSON string."""

    name: str | None  # None until written whole
    start: int = 0
    stop: int = 0  # (start == stop: none yet)
    done: bool = False  # the arguments ended: they are all there
    whole: str | None = None

    def arguments(self, text: str) -> str:
        return self.whole if self.whole is not None else text[self.start:self.stop]

    def __len__(self) -> int:
        """The arguments' length so far."""
        return len(self.whole) if self.whole is not None else self.stop - self.start


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


class Scans(dict):
    """One stream's JSON values, by where each begins in its text (which only grows): the end of a
    value scanned whole, or where the scan of an unfinished one stopped (position, depth, in a string);
    and by (marker, from) how far a search for the next call found none."""


def value_end(text: str, i: int, scans: Scans | None = None) -> int | None:
    """Just past the JSON value beginning at text[i]; None while it goes on (or text ends first)."""
    if i >= len(text):
        return None
    if text[i] not in '{["':
        m = _SCALAR.match(text, i)
        return m.end() if m and m.end() < len(text) else None  # (a number may go on at the text's end)
    known = scans.get(i) if scans is not None else None
    if isinstance(known, int):
        return known
    j, depth, quoted = known or (i, 0, False)
    end = None
    while j < len(text):
        c = text[j]
        if quoted:
            if c == "\\":
                j += 2  # (past the text's end when it ends on the backslash: resumed there)
                continue
            if c == '"':
                quoted = False
                if depth == 0:  # a string value
                    end = j + 1
                    break
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                end = j + 1
                break
        j += 1
    if scans is not None:
        scans[i] = end if end is not None else (j, depth, quoted)
    return end


def _members(text: str, i: int, scans: Scans | None) -> Iterator[tuple[str, int, int | None]]:
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
        end = value_end(text, i, scans)
        yield key, i, end
        if end is None:
            return
        i = end


def object_call(text: str, i: int, scans: Scans | None = None) -> PartialCall:
    """The call written as a JSON object {"name": ..., "arguments": {...}} (or "parameters") whose "{"
    is text[i]."""
    call = PartialCall(None)
    for key, start, end in _members(text, i, scans):
        if key == "name" and end is not None and text[start] == '"':
            call.name = json.loads(text[start:end])
        elif key in ("arguments", "parameters"):
            if text[start] == '"':  # JSON text in a string: whole, once it ends
                if end is not None:
                    call.whole, call.done = _unquoted(text[start:end]), True
            elif text[start] == "{":
                _span(call, text, start, end)
    return call


def _span(call: PartialCall, text: str, start: int, end: int | None) -> None:
    call.start, call.stop, call.done = start, end if end is not None else len(text), end is not None


def _unquoted(s: str) -> str:
    try:
        inner = json.loads(s)
        return json.dumps(json.loads(inner), ensure_ascii=False)
    except (json.JSONDecodeError, TypeError):
        return ""


def listed_calls(text: str, i: int = 0, scans: Scans | None = None) -> list[PartialCall]:
    """Calls written as a JSON list of objects (or one object) from text[i] on."""
    i = _skip(text, i)
    if i >= len(text):
        return []
    if text[i] == "{":
        return [object_call(text, i, scans)]
    if text[i] != "[":
        return []
    calls, i = [], i + 1
    while True:
        i = _skip(text, i, _WS + ",")
        if i >= len(text) or text[i] != "{":
            return calls
        calls.append(object_call(text, i, scans))
        end = value_end(text, i, scans)
        if end is None:
            return calls
        i = end


def _find(text: str, marker: str, frm: int, scans: Scans | None) -> int:
    """text.find(marker, frm), not searching again what an earlier delta's search covered."""
    key = (marker, frm)
    seen = scans.get(key, frm) if scans is not None else frm
    at = text.find(marker, seen)
    if at < 0 and scans is not None:
        scans[key] = max(frm, len(text) - len(marker) + 1)  # (a marker may be cut at the text's end)
    return at


def _arguments(call: PartialCall, text: str, i: int, scans: Scans | None) -> None:
    """The call's arguments: an object from text[i] on (after white space), as far as it goes."""
    i = _skip(text, i)
    if i < len(text) and text[i] == "{":
        _span(call, text, i, value_end(text, i, scans))


def hermes(text: str, frm: int = 0, scans: Scans | None = None) -> list[PartialCall]:
    calls, at = [], _find(text, "<tool_call>", frm, scans)
    while at >= 0:
        i = _skip(text, at + len("<tool_call>"))
        if i >= len(text) or text[i] != "{":
            break
        calls.append(object_call(text, i, scans))
        end = value_end(text, i, scans)
        if end is None:
            break
        at = _find(text, "<tool_call>", end, scans)
    return calls


def deepseek_v3(text: str, frm: int = 0, scans: Scans | None = None) -> list[PartialCall]:
    calls, at = [], _find(text, "<｜tool▁call▁begin｜>", frm, scans)
    while at >= 0:
        sep = text.find("<｜tool▁sep｜>", at)
        line = text.find("\n", sep) if sep >= 0 else -1
        if line < 0:
            break
        call = PartialCall(text[sep + len("<｜tool▁sep｜>"):line].strip())
        calls.append(call)
        fence = text.find("```", line)
        opened = text.find("\n", fence + 3) if fence >= 0 else -1
        if opened < 0:
            break
        _arguments(call, text, opened + 1, scans)
        if not call.done:
            break
        at = _find(text, "<｜tool▁call▁begin｜>", call.stop, scans)
    return calls


def mistral(text: str, frm: int = 0, scans: Scans | None = None) -> list[PartialCall]:
    at = _find(text, "[TOOL_CALLS]", frm, scans)
    if at < 0:
        return []
    i = _skip(text, at + len("[TOOL_CALLS]"))
    if i < len(text) and text[i] in "[{":
        return listed_calls(text, i, scans)
    calls = []
    while at >= 0:  # the newer NAME[ARGS]{...} form
        args = text.find("[ARGS]", at)
        if args < 0:
            break
        call = PartialCall(text[at + len("[TOOL_CALLS]"):args].strip())
        calls.append(call)
        _arguments(call, text, args + len("[ARGS]"), scans)
        if not call.done:
            break
        at = _find(text, "[TOOL_CALLS]", call.stop, scans)
    return calls


# Each reader: (the stream's text, where its first call begins, its Scans) -> the calls so far.
PARTIAL: dict[str, Callable[[str, int, Scans | None], list[PartialCall]]] = {
    "hermes": hermes, "deepseek_v3": deepseek_v3, "mistral": mistral, "required": listed_calls}
