"""Structured outputs in the engine (pdserve/engine/grammar.py, the sampler's masks) on tiny-moe's random
weights: the grammar forces the output, its end ends the request, a request resumed from its tokens so far
(a decode replica after the prefill's first token, a moved request) continues as the undisturbed one, and a
batch mixing constrained and free rows leaves the free ones alone."""

import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampler import Sampler
from pdserve.engine.grammar import Grammars
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.messages import Request
from pdserve.protocol import SamplingParams
from pdserve.structured_outputs import grammar_of, json_schema_grammar
from pdserve.tokenizer import ByteTokenizer

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "tag": {"type": "string", "pattern": "^[a-z]{1,5}$"}}}


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "overlap"])
def engine(request) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=128,
                               overlap_scheduling=request.param))


def test_the_grammar_forces_the_output_and_its_end_ends_it(engine):
    json_g = json_schema_grammar("json", SCHEMA)
    params = [SamplingParams(max_tokens=60, temperature=t, seed=s, grammar=json_g) for t, s in ((0, None), (1.0, 4))]
    params += [SamplingParams(max_tokens=40, temperature=1.0, seed=9, grammar=grammar_of("r", "regex", "x[0-9]{2,4}y")),
               SamplingParams(max_tokens=8, temperature=0)]  # a free row in the same batch
    free = engine.generate(["hi"], params[-1])[0]
    outs = engine.generate(["hi", "hello", "hey", "hi"], params)
    for o in outs[:2]:
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert o.finish_reason == FinishReason.STOP
    assert re.fullmatch("x[0-9]{2,4}y", outs[2].text) and outs[2].finish_reason == FinishReason.STOP
    assert outs[3].token_ids == free.token_ids  # the free row is untouched by its neighbours' masks
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.grammars._matchers  # every matcher forgotten with its request


def test_a_resumed_request_continues_its_grammar(engine):
    """The matcher is rebuilt from the tokens so far: what a decode replica does after the prefill
    replica's first token, and what a moved request does on its new replica."""
    params = SamplingParams(max_tokens=60, temperature=0, grammar=json_schema_grammar("json", SCHEMA))
    whole = engine.generate(["resume me"], params)[0]
    prompt, generated = engine.tokenize("resume me"), whole.token_ids
    assert len(generated) > 5
    for k in (1, 5):
        engine.add_request("moved", prompt, params, output_ids=generated[:k])
        rest = []
        while engine.has_unfinished():
            for out in engine.step():
                rest += out.token_ids
        assert generated[:k] + rest == generated


def test_masks_are_one_op_over_the_constrained_rows():
    vocab = 300
    grammars = Grammars(ByteTokenizer(), vocab)
    sampler = Sampler(torch.device("cpu"), {257})
    sampler.grammars = grammars
    digits = grammar_of("r", "regex", "[0-9]+")
    seqs = [Sequence("c", [65, 66], 2, SamplingParams(temperature=0, grammar=digits)),
            Sequence("f", [65, 66], 2, SamplingParams(temperature=0))]
    logits = torch.zeros(2, vocab)
    logits[:, 97] = 10.0  # "a": what an unconstrained row takes
    first = logits.clone()
    grammars.mask(first, [0], seqs[:1])
    assert (first[0] > float("-inf")).nonzero().flatten().tolist() == list(range(48, 58))  # digits only
    tokens, _ = sampler.sample(logits.clone(), seqs)
    assert chr(tokens[0]).isdigit() and tokens[1] == 97
    masked = logits.clone()
    grammars.mask(masked, [0], seqs[:1])
    allowed = (masked[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed == list(range(48, 58)) + [257, 259]  # after its digit: more digits, or the end (EOS)
    assert torch.equal(masked[1], logits[1])


# -- the grammar compiles off the step path (engine/grammar_gate.py) -----------------------------------

def wide_schema(groups: int, fields: int) -> dict:
    """Objects of optional string fields, each its own pattern: the compile grows with fields squared
    (30 x 250: ~0.5 s here, against a few ms a step of tiny-moe); a group stays under the parser's row limit."""
    return {"type": "object", "additionalProperties": False, "required": [f"g{j}" for j in range(groups)],
            "properties": {f"g{j}": {"type": "object", "additionalProperties": False, "properties": {
                f"f{j}_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{3 + i % 9}}}-[0-9]{{{1 + i % 4}}}$"}
                for i in range(fields)}} for j in range(groups)}}


@pytest.fixture(scope="module")
def slow_grammar() -> str:
    return json_schema_grammar("json", wide_schema(30, 250))


@pytest.fixture
def held(slow_grammar, monkeypatch) -> threading.Event:
    """The slow grammar's compile waits for this event (set by _run once "free" has two tokens): on
    2 busy cores a compile of ~0.2 s could end before the other request's first step; held, the test
    says what it means whatever the machine's speed."""
    release = threading.Event()
    build = Grammars._build

    def held_build(self, grammar: str):
        if grammar == slow_grammar:
            release.wait(60)
        return build(self, grammar)
    monkeypatch.setattr(Grammars, "_build", held_build)
    return release


def _run(engine: Engine, until_done: set[str], release: threading.Event) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Step until every listed request finished: each request's tokens, and how many of them came
    while the grammar of "slow" was still compiling (released once "free" has two tokens)."""
    tokens: dict[str, list[int]] = {}
    while_compiling: dict[str, int] = {}
    finished: set[str] = set()
    while until_done - finished:
        if len(tokens.get("free", [])) >= 2:
            release.set()
        compiling = engine.grammars.compiling("slow") and not engine.grammars.compiled("slow")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if compiling and engine.grammars.compiling("slow") and not engine.grammars.compiled("slow"):
                while_compiling[out.request_id] = while_compiling.get(out.request_id, 0) + len(out.token_ids)
            if out.finished:
                finished.add(out.request_id)
    return tokens, while_compiling


def test_a_compiling_grammar_holds_up_only_its_own_request(engine, slow_grammar, held):
    free_params = SamplingParams(max_tokens=12, temperature=0)
    slow_params = SamplingParams(max_tokens=6, temperature=0, grammar=slow_grammar)
    free_alone = engine.generate(["hi there"], free_params)[0].token_ids
    engine.add_request("slow", "hello", slow_params)
    assert engine.grammars.compiling("slow") and engine.seqs["slow"] not in engine.scheduler.waiting
    engine.add_request("free", "hi there", free_params)
    tokens, while_compiling = _run(engine, {"free", "slow"}, held)
    # The free request stepped while the other's grammar compiled (before and after each step: no
    # step held the compile); only then was the other scheduled. A compile on the step path fails this.
    assert while_compiling.get("free", 0) >= 1 and "slow" not in while_compiling, while_compiling
    assert tokens["free"] == free_alone
    slow_alone = engine.generate(["hello"], slow_params)[0].token_ids  # compiled, then run (the same greedy output)
    assert tokens["slow"] == slow_alone and len(slow_alone) == 6
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    assert not engine.grammars._matchers and not engine.grammars._compiling and not engine.has_unfinished()


def test_a_grammar_that_does_not_compile_fails_only_its_request(engine):
    bad = json.dumps({"grammars": [{"lark_grammar": "start: missing_rule"}]})  # (the router refuses it: 400)
    engine.add_request("bad", "hi", SamplingParams(max_tokens=8, temperature=0, grammar=bad))
    engine.add_request("ok", "hi", SamplingParams(max_tokens=4, temperature=0))
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    [failed] = outs["bad"]
    assert failed.finish_reason == FinishReason.ERROR and failed.token_ids == []
    assert "did not compile" in failed.error and "missing_rule" in failed.error
    assert sum(len(o.token_ids) for o in outs["ok"]) == 4 and outs["ok"][-1].finish_reason == FinishReason.LENGTH
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.seqs


def test_a_decode_reservation_starts_once_its_grammar_compiled(slow_grammar, held):
    """The decode role: the KV came (start_decode) before the compile ended; the first token waits
    with the request, the other decoders step on, and its matcher consumes that token once built."""
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64, role="decode"))
    prompt = engine.tokenize("hello")
    assert engine.reserve(Request("free", prompt, SamplingParams(max_tokens=10, temperature=0))) is not None
    assert engine.reserve(Request("slow", prompt, SamplingParams(max_tokens=4, temperature=0,
                                                                  grammar=slow_grammar))) is not None
    engine.start_decode("free", ord("x"))
    engine.start_decode("slow", ord("{"))  # the first token the prefill replica sampled under the grammar
    assert engine.seqs["slow"] not in engine.scheduler.running
    tokens, while_compiling = _run(engine, {"free", "slow"}, held)
    assert while_compiling.get("free", 0) >= 1 and "slow" not in while_compiling, while_compiling
    assert len(tokens["free"]) == 10 and tokens["slow"][0] == ord("{") and len(tokens["slow"]) == 4
    assert engine.tokenizer.decode(tokens["slow"]).startswith('{"g0')  # its matcher took the first token
    assert engine.pool.num_free_blocks == engine.pool.num_blocks and not engine.has_unfinished()


def _bpe_model_dir(path, eos_token_id: int) -> str:
    """A model directory holding a small byte-level BPE tokenizer.json (trained here) whose config
    names an end token past the tokenizer's ids, as some models' configs do."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(['{"id": 12, "ok": true}'] * 50 + ["hello world"] * 50, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>"]))
    tok.save(str(path / "tokenizer.json"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return str(path)


def test_an_end_token_past_the_tokenizer_does_not_stop_grammars(tmp_path):
    """llguidance takes only end tokens its vocabulary spells: one past it is left out (it used to make
    every compile fail, each after rebuilding the tokenizer)."""
    from pdserve.tokenizer import Tokenizer

    tok = Tokenizer(_bpe_model_dir(tmp_path, eos_token_id=100_000))
    assert tok.eos_token_ids == [100_000]
    grammars = Grammars(tok, vocab_size=512)
    seq = Sequence("r", [1, 2], 2, SamplingParams(temperature=0, grammar=grammar_of("r", "regex", "[0-9]+")))
    grammars.compile(seq)
    assert grammars.install(seq) is None
    logits = torch.zeros(1, 512)
    grammars.mask(logits, [0], [seq])
    allowed = (logits[0] > float("-inf")).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([t]).isdigit() for t in allowed)


def test_a_tokenizer_llguidance_refuses_is_refused_once():
    """Every grammar fails at once with the same error, and the tokenizer is not rebuilt per grammar."""
    from pdserve.structured_outputs import GrammarTokenizer

    class Unusable:  # a tokenizer.json llguidance cannot read
        eos_token_ids, vocab_size, reads = [0], 10, 0

        @property
        def backend(self):
            Unusable.reads += 1
            return type("Backend", (), {"to_str": lambda self: '{"model": {"type": "nothing"}}'})()

    gt = GrammarTokenizer(Unusable())
    for _ in range(3):
        with pytest.raises(ValueError, match="not usable for grammars"):
            gt.get()
    assert Unusable.reads == 1
    grammars = Grammars(Unusable(), vocab_size=10)
    seqs = [Sequence(f"r{i}", [1], 1, SamplingParams(grammar=grammar_of("r", "regex", "a+"))) for i in range(4)]
    for s in seqs:
        grammars.compile(s)
    errors = {grammars.install(s) for s in seqs}
    assert len(errors) == 1 and "not usable for grammars" in errors.pop()
    assert Unusable.reads == 2  # once more: the engine's own GrammarTokenizer


def test_a_step_sampled_after_the_next_fill_keeps_its_own_masks(monkeypatch):
    """Overlapped, a step whose rows the next step does not read is sampled only when the engine reads
    it: after the next step's fill. Its masks must be its own (the host buffer is the next fill's)."""
    apply = Grammars.apply_mask

    def after_every_fill(self, *args):  # the threads' worst order: every queued fill done first
        self._filler.submit(lambda: None).result()
        return apply(self, *args)
    monkeypatch.setattr(Grammars, "apply_mask", after_every_fill)
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64, overlap_scheduling=True))
    digits = SamplingParams(max_tokens=3, temperature=0, grammar=grammar_of("r", "regex", "[0-9]{3,9}"))
    letters = SamplingParams(max_tokens=3, temperature=0, grammar=grammar_of("r", "regex", "[a-z]{3,9}"))
    engine.add_request("digits", "hi", digits)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        seq = engine.seqs.get("digits")
        if "letters" not in engine.seqs and "letters" not in tokens and seq is not None \
                and seq.num_output_tokens >= 3:  # its last token's step is queued, not sampled yet
            engine.add_request("letters", "hi", letters)
            while not engine.grammars.compiled("letters"):  # so that the very next step takes it in
                time.sleep(0.005)
    text = {rid: engine.tokenizer.decode(ids) for rid, ids in tokens.items()}
    assert re.fullmatch("[0-9]{3}", text["digits"]) and re.fullmatch("[a-z]{3}", text["letters"]), text
