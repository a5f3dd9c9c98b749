"""Tool calls read out of a model's text (router/tool_parsers.py: hermes, deepseek_v3, mistral; the parser
picked from the chat template) and worded as OpenAI's tool_calls, whole and as stream deltas
(router/tool_calls.py). Serving them through the openai client is tests/test_sampling_serving.py's."""

import json

import pytest

from pdserve.messages import RequestDelta
from pdserve.protocol import InvalidRequestError
from pdserve.router.openai_protocol import ChatCompletionRequest
from pdserve.router.tool_calls import ToolCallShape, ToolChoice
from pdserve.router.tool_parsers import DeepSeekV3, Hermes, Mistral, parser_for

ARGS = {"city": "Oslo", "unit": "celsius"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}

TEXTS = {
    "hermes": 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n</tool_call>',
    "deepseek_v3": "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   '{"city": "Oslo", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function'
                   '<｜tool▁sep｜>get_weather\n```json\n{"city": "Lima"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "mistral": 'Let me look.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, '
               '{"name": "get_weather", "arguments": {"city": "Lima"}}]',
    "mistral-v11": 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "celsius"}'
                   '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}',
}
PARSER = {"hermes": Hermes, "deepseek_v3": DeepSeekV3, "mistral": Mistral, "mistral-v11": Mistral}


@pytest.mark.parametrize("fmt", list(TEXTS))
def test_each_format_parses_into_calls(fmt):
    content, calls = PARSER[fmt]().parse(TEXTS[fmt])
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS), ("get_weather", {"city": "Lima"})]


@pytest.mark.parametrize("fmt", list(TEXTS))
def test_text_without_a_whole_call_is_content(fmt):
    parser = PARSER[fmt]()
    assert parser.parse("no call here") == ("no call here", [])
    cut = TEXTS[fmt][:len(TEXTS[fmt]) // 2 + 8]  # a call cut short (max_tokens)
    assert parser.parse(cut) == (cut, [])


def test_the_parser_follows_the_chat_template_unless_configured():
    assert parser_for("auto", "{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}").name == "hermes"
    assert parser_for("auto", "{{'<｜tool▁calls▁begin｜>'}}").name == "deepseek_v3"
    assert parser_for("auto", "[AVAILABLE_TOOLS] ... [TOOL_CALLS]").name == "mistral"
    assert parser_for("auto", None).name == "hermes"  # ChatML without tools: the presets'
    assert parser_for("mistral", "<tool_call>").name == "mistral"


def _body(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], **kw)


def _stream(shape: ToolCallShape, pieces: list[str], reason: str = "stop") -> tuple[str, dict, str]:
    """Feed a stream's text in pieces; the content, the calls by index (name, arguments) and the finish_reason."""
    content, calls, finish = "", {}, None
    for i, piece in enumerate(pieces):
        chunk = shape.chunk(RequestDelta("r", piece, [], finish_reason=reason if i == len(pieces) - 1 else None))
        if chunk is None:
            continue
        [choice] = chunk["choices"]
        content += choice["delta"].get("content", "")
        for t in choice["delta"].get("tool_calls", []):
            name, args = calls.get(t["index"], ("", ""))
            fn = t["function"]
            calls[t["index"]] = (name + fn.get("name", ""), args + fn.get("arguments", ""))
            if "name" in fn:
                assert t["id"].startswith("call_") and t["type"] == "function"
        finish = choice["finish_reason"] or finish
    return content, calls, finish


def test_auto_streams_content_then_the_calls():
    shape = ToolCallShape("r", "m", False, False, ToolChoice(_body()), Hermes())
    text = TEXTS["hermes"]
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]  # the marker split across pieces
    content, calls, finish = _stream(shape, pieces)
    assert content == "Let me look." and finish == "tool_calls"
    assert {i: (n, json.loads(a)) for i, (n, a) in calls.items()} == {0: ("get_weather", ARGS),
                                                                     1: ("get_weather", {"city": "Lima"})}
    plain = ToolCallShape("r", "m", False, False, ToolChoice(_body()), Hermes())
    assert _stream(plain, ["a <tool", "_ca", "ll"], "length") == ("a <tool_call", {}, "length")  # never a call


def test_a_named_choice_streams_its_arguments():
    choice = ToolChoice(_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert choice.mode == "named" and choice.grammar()
    text = json.dumps(ARGS)
    content, calls, finish = _stream(ToolCallShape("r", "m", False, False, choice, Hermes()), [text[:7], text[7:]])
    assert content == "" and calls == {0: ("get_weather", text)} and finish == "tool_calls"
    whole = ToolCallShape("r", "m", False, False, choice, Hermes()).choice([RequestDelta("r", text, [], finish_reason="stop")])
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    [call] = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": text} and call["type"] == "function"


def test_required_reads_vllms_list_of_calls():
    choice = ToolChoice(_body(tool_choice="required"))
    text = json.dumps([{"name": "get_weather", "parameters": ARGS}])
    content, calls, finish = _stream(ToolCallShape("r", "m", False, False, choice, Hermes()), [text[:9], text[9:]])
    assert content == "" and {i: (n, json.loads(a)) for i, (n, a) in calls.items()} == {0: ("get_weather", ARGS)}


def test_an_unknown_tool_name_is_refused_naming_tool_choice():
    with pytest.raises(InvalidRequestError) as e:
        ToolChoice(_body(tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert e.value.param == "tool_choice" and "get_time" in str(e.value)


def test_a_conversation_with_calls_reaches_the_template():
    """The calls an assistant made and the tool's answer go back into the prompt (Qwen-style template)."""
    template = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} {{ c.function.arguments | tojson }}"
                "</tool_call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}|{% endfor %}")
    from pdserve.tokenizer import render_chat_template
    body = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}])
    text = render_chat_template(template, [m.for_template() for m in body.messages], False, {})
    assert text == ('user:weather?|assistant:<tool_call>get_weather {"city": "Oslo", "unit": "celsius"}</tool_call>|'
                    "tool:12 C[call_1]|")


def _deltas(shape: ToolCallShape, text: str, size: int = 4) -> tuple[list[dict], str]:
    """Feed a finished text in pieces; every chunk's choice delta, and the finish_reason."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    deltas, finish = [], None
    for i, piece in enumerate(pieces):
        chunk = shape.chunk(RequestDelta("r", piece, [], finish_reason="stop" if i == len(pieces) - 1 else None))
        if chunk is not None:
            deltas.append(chunk["choices"][0]["delta"])
            finish = chunk["choices"][0]["finish_reason"] or finish
    return deltas, finish


@pytest.mark.parametrize("fmt", list(TEXTS))
def test_auto_streams_each_calls_arguments_as_they_come(fmt):
    """OpenAI's (and vLLM's) tool-call deltas: the call opens with its id and name, then its arguments
    come in fragments as the model writes them, not whole at the end; joined they are the call the
    whole response holds."""
    parser = PARSER[fmt]()
    shape = ToolCallShape("r", "m", False, False, ToolChoice(_body()), parser)
    deltas, finish = _deltas(shape, TEXTS[fmt])
    whole = ToolCallShape("r", "m", False, False, ToolChoice(_body()), parser).choice(
        [RequestDelta("r", TEXTS[fmt], [], finish_reason="stop")])
    assert finish == whole["finish_reason"] == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == whole["message"]["content"] == "Let me look."
    fragments: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for k, d in enumerate(deltas):
        for t in d.get("tool_calls", []):
            if "name" in t["function"]:
                assert t["index"] not in names and t["id"].startswith("call_") and t["type"] == "function"
                names[t["index"]] = t["function"]["name"]
                assert k < len(deltas) - 1  # opened before the end
            fragments.setdefault(t["index"], []).append(t["function"]["arguments"])
    assert [names[i] for i in sorted(names)] == [c["function"]["name"] for c in whole["message"]["tool_calls"]]
    assert [json.loads("".join(fragments[i])) for i in sorted(fragments)] == \
           [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]]
    assert all(len([f for f in fragments[i] if f]) > 3 for i in fragments)  # in pieces, as written


def test_required_streams_its_arguments_as_they_come():
    text = json.dumps([{"name": "get_weather", "parameters": ARGS}, {"name": "get_weather", "parameters": {"city": "Lima"}}])
    deltas, finish = _deltas(ToolCallShape("r", "m", False, False, ToolChoice(_body(tool_choice="required")), Hermes()), text)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        assert "content" not in d
        for t in d.get("tool_calls", []):
            calls.setdefault(t["index"], []).append(t["function"]["arguments"])
    assert finish == "tool_calls"
    assert {i: json.loads("".join(f)) for i, f in calls.items()} == {0: ARGS, 1: {"city": "Lima"}}
    assert len(calls[0]) > 3


def test_a_call_cut_short_is_not_a_call():
    """max_tokens ended it inside the call's name: nothing was opened, the text is content."""
    cut = 'Hi<tool_call>\n{"name": "get_wea'
    deltas, _ = _deltas(ToolCallShape("r", "m", False, False, ToolChoice(_body()), Hermes()), cut)
    assert "".join(d.get("content", "") for d in deltas) == cut and not any("tool_calls" in d for d in deltas)


def test_a_long_call_streams_in_time_linear_in_its_length():
    """Each delta reads the calls again, but every JSON value is scanned once (tool_stream.Scans): a
    call of 120,000 characters in 3-character deltas takes about as long per delta as a short one."""
    import time

    def per_delta(n: int) -> float:
        args = json.dumps({"items": [{"k": i, "v": 'x\\"y' * 3} for i in range(n)]})
        text = 'ok<tool_call>\n{"name": "get_weather", "arguments": ' + args + '}\n</tool_call>'
        shape = ToolCallShape("r", "m", False, False, ToolChoice(_body()), Hermes())
        started = time.perf_counter()
        deltas, finish = _deltas(shape, text, size=3)
        took = (time.perf_counter() - started) / len(deltas)
        got = "".join(t["function"].get("arguments", "") for d in deltas for t in d.get("tool_calls", []))
        assert json.loads(got) == json.loads(args) and finish == "tool_calls"
        return took

    short, long = min(per_delta(30) for _ in range(3)), per_delta(3000)
    assert long < 20 * short, (short, long)  # a rescan of the whole text per delta: ~90x
