"""vLLM's sampling parameters through `pdserve up` with the official `openai` client (and gRPC), against a
disaggregated cluster (1 prefill + 1 decode) and a colocated one, both overlapping their steps: penalties,
logit_bias, min_tokens, min_p, top_k, ignore_eos, stop_token_ids, stop_reason, echo, n, best_of and lists of
prompts; structured outputs (response_format, structured_outputs) and tool calls (tools, tool_choice).
Greedy outputs are checked token for token against `pdserve generate`'s engine in this process given
the same parameters (so disaggregated and colocated outputs equal each other); the first token of a
disaggregated request is sampled on the prefill replica (router.prefill_site: remote) and the rest on the
decode replica, which must count it in its penalties and advance its grammar over it."""

import json
import re

import grpc
import httpx
import jsonschema
import openai
import pytest

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2 as pb
from pdserve.router.grpc_gen.pdserve.v1 import completion_pb2_grpc
from serving_cluster import Cluster

MODEL = "tiny-moe"
PROMPTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog. "]
EOS = 257  # tiny-moe's byte tokenizer: 257 and 259 end a sequence


@pytest.fixture(scope="module")
def reference() -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path=MODEL), num_kv_blocks=512))


def generate(engine: Engine, prompt: str, max_tokens: int, **params):
    """The reference engine's greedy completion with these parameters."""
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0, **params))[0]


@pytest.fixture(scope="module", params=[
    {"decode": {"overlap_scheduling": True}, "router": {"prefill_site": "remote"}},
    {"colocated": {"replicas": 1, "num_kv_blocks": 512, "overlap_scheduling": True}},
], ids=["disaggregated", "colocated"])
def cluster(request, tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("up"), **request.param)
    try:
        c.wait_ready()
        c.client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield c
    finally:
        assert c.stop() == 0, c.output()


def complete(c: Cluster, stream: bool, **kw) -> list[dict]:
    """The choices of a completion, as {index: {text, finish_reason, stop_reason}}, streamed or not."""
    extra = {k: kw.pop(k) for k in list(kw) if k not in ("prompt", "max_tokens", "temperature", "n", "stop",
                                                         "seed", "logit_bias", "presence_penalty", "echo",
                                                         "frequency_penalty", "best_of", "top_p")}
    kw.setdefault("temperature", 0)
    if not stream:
        r = c.client.completions.create(model=MODEL, extra_body=extra, **kw)
        return {ch.index: {"text": ch.text, "finish_reason": ch.finish_reason,
                           "stop_reason": getattr(ch, "stop_reason", None)} for ch in r.choices}
    out: dict[int, dict] = {}
    for chunk in c.client.completions.create(model=MODEL, extra_body=extra, stream=True, **kw):
        for ch in chunk.choices:
            o = out.setdefault(ch.index, {"text": "", "finish_reason": None, "stop_reason": None})
            o["text"] += ch.text
            if ch.finish_reason:
                o["finish_reason"], o["stop_reason"] = ch.finish_reason, getattr(ch, "stop_reason", None)
    return out


PENALIZED = [
    {"repetition_penalty": 1.8},
    {"frequency_penalty": 1.5},
    {"presence_penalty": 2.0},
    {"repetition_penalty": 0.7, "frequency_penalty": -0.5, "presence_penalty": 0.8},
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_penalties_give_the_reference_greedy_tokens(cluster, reference, stream):
    changed = 0
    for params in PENALIZED:
        for prompt in PROMPTS:
            want = generate(reference, prompt, 32, **params)
            got = complete(cluster, stream, prompt=prompt, max_tokens=32, **params)
            assert got[0]["text"] == want.text, (params, prompt)
            changed += want.text != generate(reference, prompt, 32).text
    assert changed >= len(PENALIZED)  # the penalties do change the greedy output


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_logit_bias_min_tokens_and_stop_reason(cluster, reference, stream):
    # EOS forced by its bias, held off for min_tokens: exactly that many tokens, then the EOS.
    r = cluster.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                          logit_bias={str(EOS): 100}, extra_body={"min_tokens": 5})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "stop"
    assert r.choices[0].stop_reason is None  # the model's EOS, as vLLM says it
    assert r.choices[0].text == generate(reference, PROMPTS[0], 20, logit_bias={EOS: 100}, min_tokens=5).text
    # A bias forces an ordinary token.
    a = reference.tokenizer.encode("A", add_special_tokens=False)[0]
    got = complete(cluster, stream, prompt=PROMPTS[1], max_tokens=8, logit_bias={str(a): 100})
    assert got[0]["text"] == "A" * 8 and got[0]["finish_reason"] == "length" and got[0]["stop_reason"] is None
    # A stop token id ends it and is its stop_reason; min_tokens holds it off.
    ids = generate(reference, PROMPTS[0], 12).token_ids
    stop_id = ids[2]
    got = complete(cluster, stream, prompt=PROMPTS[0], max_tokens=12, stop_token_ids=[stop_id])
    assert got[0] == {"text": generate(reference, PROMPTS[0], 12, stop_token_ids=[stop_id]).text,
                      "finish_reason": "stop", "stop_reason": stop_id}
    held = complete(cluster, stream, prompt=PROMPTS[0], max_tokens=12, stop_token_ids=[stop_id], min_tokens=6)
    assert held[0]["text"] == generate(reference, PROMPTS[0], 12, stop_token_ids=[stop_id], min_tokens=6).text
    assert len(held[0]["text"]) > len(got[0]["text"])
    # A stop string is its stop_reason.
    text = generate(reference, PROMPTS[0], 16).text
    stop = "ÛÛ"  # some way in: "...ÛyÛÛy..."
    assert text.index(stop) > 5
    got = complete(cluster, stream, prompt=PROMPTS[0], max_tokens=16, stop=[stop, "never-there"])
    assert got[0] == {"text": text[:text.index(stop)], "finish_reason": "stop", "stop_reason": stop}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_top_k_min_p_ignore_eos(cluster, reference, stream):
    greedy = generate(reference, PROMPTS[0], 10).text
    # top_k 1 and min_p 1 leave only the most likely token: sampling at temperature 1 is greedy.
    assert complete(cluster, stream, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, top_k=1)[0]["text"] == greedy
    assert complete(cluster, stream, prompt=PROMPTS[0], max_tokens=10, temperature=1.0, min_p=1.0)[0]["text"] == greedy
    # ignore_eos: an EOS forced every step does not end it.
    r = cluster.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=7, temperature=0,
                                          logit_bias={str(EOS): 100}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_and_a_list_of_prompts(cluster, reference, stream):
    got = complete(cluster, stream, prompt=PROMPTS[0], max_tokens=12, n=3, temperature=1.0, seed=11)
    assert sorted(got) == [0, 1, 2]
    assert len({g["text"] for g in got.values()}) > 1  # each choice draws with its own seed (seed + index)
    assert got == complete(cluster, stream, prompt=PROMPTS[0], max_tokens=12, n=3, temperature=1.0, seed=11)
    got = complete(cluster, stream, prompt=PROMPTS, max_tokens=8, n=2)
    assert sorted(got) == [0, 1, 2, 3]
    for i, prompt in enumerate(PROMPTS):
        want = generate(reference, prompt, 8).text
        assert got[2 * i]["text"] == got[2 * i + 1]["text"] == want
    echoed = complete(cluster, stream, prompt=PROMPTS, max_tokens=8, echo=True)
    assert [echoed[i]["text"] for i in range(2)] == [p + generate(reference, p, 8).text for p in PROMPTS]


def test_usage_sums_choices_and_best_of(cluster, reference):
    prompt_tokens = len(reference.tokenize(PROMPTS[0]))
    r = cluster.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, n=3, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, 18)
    # best_of 4, n 2: the two of the highest cumulative logprob among the 4 that n = 4 gives (the same
    # seeds: choice j draws with seed + j), best first; logprobs shown only where asked for.
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=1.5, seed=3)
    four = cluster.client.completions.create(n=4, logprobs=0, **kw).choices
    ranked = sorted(four, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert len({c.text for c in four}) > 2
    r = cluster.client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].logprobs is None
    assert [c.text for c in r.choices] == [c.text for c in ranked[:2]]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in four)  # every one generated counts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_n(cluster, reference, stream):
    messages = [{"role": "user", "content": "Hi there"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, n=2, temperature=0, presence_penalty=1.0)
    if not stream:
        r = cluster.client.chat.completions.create(**kw)
        texts = {c.index: c.message.content for c in r.choices}
    else:
        texts = {}
        for chunk in cluster.client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    prompt = reference.tokenizer.apply_chat_template(messages)
    ids = reference.tokenizer.encode(prompt, add_special_tokens=False)
    want = reference.generate([ids], SamplingParams(max_tokens=8, temperature=0, presence_penalty=1.0))[0].text
    assert texts == {0: want, 1: want}


def test_disconnect_aborts_every_choice(cluster):
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Never ending story", "max_tokens": 3000, "n": 3,
                            "temperature": 0, "stream": True, "ignore_eos": True,
                            "repetition_penalty": 1.2}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i > 8:
                break
    stats = cluster.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats


@pytest.mark.parametrize("body,param", [
    ({"n": 17}, "n"),
    ({"logit_bias": {"100000": 1}}, "logit_bias"),
    ({"logit_bias": {"3": 200}}, "logit_bias"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"n": 2, "stop_token_ids": [100000]}, "stop_token_ids"),
])
def test_bad_sampling_parameters_are_400_naming_the_field(cluster, body, param):
    r = httpx.post(f"{cluster.url}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = cluster.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)  # still serving
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_grpc_takes_the_same_parameters(cluster, reference):
    penalties = {"repetition_penalty": 1.8, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    want = generate(reference, PROMPTS[0], 24, **penalties)
    stop_id = generate(reference, PROMPTS[0], 12).token_ids[2]
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = completion_pb2_grpc.CompletionStub(channel)
        req = pb.CompletionRequest(prompt=PROMPTS[0], max_tokens=24, temperature=0.0, **penalties)
        r = stub.Complete(req, timeout=60)
        assert r.text == want.text and list(r.token_ids) == want.token_ids
        assert "".join(ch.text for ch in stub.CompleteStream(req, timeout=60)) == want.text
        # stop_token_ids and its stop_reason; min_tokens; logit_bias.
        r = stub.Complete(pb.CompletionRequest(prompt=PROMPTS[0], max_tokens=12, temperature=0.0,
                                               stop_token_ids=[stop_id]), timeout=60)
        assert r.finish_reason == "stop" and r.stop_token_id == stop_id and r.WhichOneof("stop_reason") == "stop_token_id"
        r = stub.Complete(pb.CompletionRequest(prompt=PROMPTS[0], max_tokens=20, temperature=0.0, min_tokens=4,
                                               logit_bias={EOS: 100.0}), timeout=60)
        assert r.usage.completion_tokens == 5 and r.finish_reason == "stop" and r.WhichOneof("stop_reason") is None
        # n = 3: three choices, each with its index; streamed, each chunk says whose it is.
        req = pb.CompletionRequest(prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=5, n=3)
        r = stub.Complete(req, timeout=60)
        assert [c.index for c in r.choices] == [0, 1, 2] and r.text == r.choices[0].text
        assert r.usage.completion_tokens == sum(len(c.token_ids) for c in r.choices)
        streamed: dict[int, str] = {}
        for chunk in stub.CompleteStream(req, timeout=60):
            streamed[chunk.index] = streamed.get(chunk.index, "") + chunk.text
        assert streamed == {c.index: c.text for c in r.choices}
        for bad, field in [({"n": 17}, "n"), ({"logit_bias": {100000: 1.0}}, "logit_bias"),
                           ({"presence_penalty": 3.0}, "presence_penalty")]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(pb.CompletionRequest(prompt="hi", max_tokens=4, **bad), timeout=30)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)


# -- structured outputs and tool calls: the grammar forces the random-weight model's output ---------

# Every string is bounded and spelled in ASCII, so the output ends and its text is the JSON the model wrote.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog", "none"]}, "tall": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "unit"],
                                                           "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
                                                                          "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
NOTE = {"type": "function", "function": {"name": "take_note", "parameters": {"type": "object"}}}


def chat(c: Cluster, stream: bool, **kw) -> dict:
    """A chat completion's one choice as {content, finish_reason, tool_calls: [(name, arguments)]}."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 120} | kw
    if not stream:
        ch = c.client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return {"content": ch.message.content, "finish_reason": ch.finish_reason, "tool_calls": calls}
    content, reason, calls = "", None, {}
    for chunk in c.client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:  # OpenAI's tool-call deltas: the first names the call
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
            reason = ch.finish_reason or reason
    return {"content": content or None, "finish_reason": reason, "tool_calls": [calls[i] for i in sorted(calls)]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_json_schema_output_validates(cluster, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    for temperature in (0, 1.0):
        r = chat(cluster, stream, response_format=rf, temperature=temperature, seed=7)
        assert r["finish_reason"] == "stop", r  # the grammar's end ends the request
        jsonschema.validate(json.loads(r["content"]), PERSON)
    # The same through vLLM's structured_outputs on /v1/completions; and json_object.
    out = complete(cluster, stream, prompt=PROMPTS[0], max_tokens=120, structured_outputs={"json": PERSON})[0]
    assert out["finish_reason"] == "stop", out
    jsonschema.validate(json.loads(out["text"]), PERSON)
    out = complete(cluster, stream, prompt=PROMPTS[1], max_tokens=400, response_format={"type": "json_object"})[0]
    assert out["finish_reason"] == "length" or isinstance(json.loads(out["text"]), dict), out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_regex_choice_and_grammar_are_obeyed(cluster, stream):
    for seed in (1, 2):
        out = complete(cluster, stream, prompt=PROMPTS[0], max_tokens=30, temperature=1.0, seed=seed,
                       structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"})[0]
        assert re.fullmatch("[a-c]{3}-[0-9]{2}", out["text"]) and out["finish_reason"] == "stop", out
        out = complete(cluster, stream, prompt=PROMPTS[1], max_tokens=30, temperature=1.0, seed=seed,
                       structured_outputs={"choice": ["alpha", "beta", "gamma ray"]})[0]
        assert out["text"] in ("alpha", "beta", "gamma ray") and out["finish_reason"] == "stop", out
    out = complete(cluster, stream, prompt=PROMPTS[0], max_tokens=30,
                   structured_outputs={"grammar": 'start: "ab" DIGIT DIGIT\n%import common.DIGIT'})[0]
    assert re.fullmatch("ab[0-9]{2}", out["text"]), out


def test_the_first_token_obeys_the_grammar(cluster):
    """max_tokens 1: the only token is the one a disaggregated request samples on its prefill replica."""
    for seed in range(6):
        out = complete(cluster, False, prompt=PROMPTS[seed % 2], max_tokens=1, temperature=1.0, seed=seed,
                       structured_outputs={"regex": "[0-9]+"})[0]
        assert re.fullmatch("[0-9]", out["text"]), out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_named_tool_choice_returns_a_parsed_call(cluster, stream):
    r = chat(cluster, stream, tools=[NOTE, WEATHER], temperature=1.0, seed=3,
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r["finish_reason"] == "tool_calls" and not r["content"], r
    [(name, arguments)] = r["tool_calls"]
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
    # tool_choice none: the same tools, plain text back.
    r = chat(cluster, stream, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0)
    assert r["tool_calls"] == [] and r["finish_reason"] == "length"


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    # (Valid for any tokenizer but this model's: it has no such special token.)
    ({"structured_outputs": {"grammar": 'start: "a" <|no_such_token|>'}}, "structured_outputs.grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
])
def test_bad_structured_outputs_are_400_naming_the_field(cluster, body, param):
    r = httpx.post(f"{cluster.url}/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4} | body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = complete(cluster, False, prompt="hi", max_tokens=8, structured_outputs={"choice": ["yes", "no"]})[0]
    assert ok["text"] in ("yes", "no")  # still serving, grammars too
    stats = cluster.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats


def test_grpc_structured_outputs(cluster):
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = completion_pb2_grpc.CompletionStub(channel)
        so = pb.StructuredOutputs(json=json.dumps(PERSON))
        r = stub.Complete(pb.CompletionRequest(prompt=PROMPTS[0], max_tokens=120, temperature=1.0, seed=2,
                                               structured_outputs=so), timeout=60)
        assert r.finish_reason == "stop"
        jsonschema.validate(json.loads(r.text), PERSON)
        req = pb.CompletionRequest(prompt=PROMPTS[1], max_tokens=20, temperature=1.0, seed=1,
                                   structured_outputs=pb.StructuredOutputs(choice=pb.Choices(values=["up", "down"])))
        assert "".join(ch.text for ch in stub.CompleteStream(req, timeout=60)) in ("up", "down")
        for so, field in [(pb.StructuredOutputs(regex="(open"), "structured_outputs.regex"),
                          (pb.StructuredOutputs(), "structured_outputs")]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Complete(pb.CompletionRequest(prompt="hi", max_tokens=4, structured_outputs=so), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith(field)


# The model's own call in the hermes format (the presets' ChatML): the grammar writes it, so that the
# random-weight model makes one; auto reads it as a model's call.
HERMES_CALL = ('start: ' + json.dumps('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "')
               + ' CITY ' + json.dumps('", "unit": "celsius"}}\n</tool_call>') + '\nCITY: /[A-Z][a-z]{1,8}/')


def _streamed_calls(c: Cluster, **kw) -> tuple[dict, int]:
    """A streamed chat completion through the openai client, its deltas accumulated as a client does
    ({content, finish_reason, tool_calls}), and how many chunks carried argument fragments."""
    content, reason, calls, fragments = "", None, {}, 0
    for chunk in c.client.chat.completions.create(model=MODEL, stream=True, max_tokens=200,
                                                  messages=[{"role": "user", "content": "Weather?"}], **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                if t.function.name:
                    assert t.index not in calls and t.id and t.type == "function"
                name, args = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), args + (t.function.arguments or ""))
                fragments += bool(t.function.arguments)
            reason = ch.finish_reason or reason
    return {"content": content or None, "finish_reason": reason, "tool_calls": [calls[i] for i in sorted(calls)]}, fragments


@pytest.mark.parametrize("choice,extra", [
    ("auto", {"extra_body": {"structured_outputs": {"grammar": HERMES_CALL}}, "temperature": 0,
              "tools": [WEATHER, NOTE]}),
    ("required", {"temperature": 1.0, "seed": 3, "tools": [WEATHER]}),  # (NOTE's free object may run long)
], ids=["auto", "required"])
def test_auto_and_required_calls_stream_as_generated(cluster, choice, extra):
    """tool_choice auto and required stream each call as OpenAI does: its name first, then its
    arguments in fragments as the model writes them; joined, the same call as the whole response."""
    whole = cluster.client.chat.completions.create(model=MODEL, max_tokens=200, tool_choice=choice,
                                                   messages=[{"role": "user", "content": "Weather?"}],
                                                   **extra).choices[0]
    streamed, fragments = _streamed_calls(cluster, tool_choice=choice, **extra)
    assert whole.finish_reason == streamed["finish_reason"] == "tool_calls", (whole, streamed)
    assert (whole.message.content or None) == streamed["content"] == ("Let me look." if choice == "auto" else None)
    parsed = [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert parsed == [(n, json.loads(a)) for n, a in streamed["tool_calls"]] and parsed
    assert fragments > 3  # the arguments came as generated, not in one piece at the end
    for name, arguments in parsed:
        tool = {"get_weather": WEATHER, "take_note": NOTE}[name]
        jsonschema.validate(arguments, tool["function"]["parameters"])
