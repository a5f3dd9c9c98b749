"""Structured outputs in the engine (pdserve/engine/grammar.py, the sampler's masks) on tiny-moe's random
weights: the grammar forces the output, its end ends the request, a request resumed from its tokens so far
(a decode replica after the prefill's first token, a moved request) continues as the undisturbed one, and a
batch mixing constrained and free rows leaves the free ones alone."""

import json
import re

import jsonschema
import pytest
import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.sampler import Sampler
from pdserve.engine.grammar import Grammars
from pdserve.engine.sequence import FinishReason, Sequence
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
