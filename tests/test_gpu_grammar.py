"""Grammar masks on the GPU path (skipped without CUDA): the fill runs on its thread while the forward
runs, the masks reach the device on their own stream, and the step's sampling is queued only when the
next step needs it (pdserve/engine/grammar.py, mask_words.py, sampler.SampledLater). Overlapped, with
CUDA graphs: the same tokens as the same GPU engine stepping one step at a time (each mask filled and
applied before anything else is queued), for batches where every row is constrained (the in-place mask)
and where constrained and free rows mix (the gathered one); every output obeys its grammar.

    python -m pytest -q tests/test_gpu_grammar.py
"""

import json
import re

import jsonschema
import pytest
import torch

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from pdserve.structured_outputs import grammar_of, json_schema_grammar

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
                         "tag": {"type": "string", "pattern": "^[a-z]{1,5}$"}}}


def engine(device: str, overlap: bool) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path="tiny-moe", dtype="float32"), device=device,
                               num_kv_blocks=256, overlap_scheduling=overlap))


@pytest.mark.parametrize("free", [0, 3], ids=["all-constrained", "mixed"])
def test_overlapped_gpu_masks_equal_the_cpu_engine(free):
    json_g, regex_g = json_schema_grammar("json", SCHEMA), grammar_of("r", "regex", "x[0-9]{2,9}y")
    params = [SamplingParams(max_tokens=48, temperature=0, grammar=json_g if i % 2 else regex_g) for i in range(24)]
    params += [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(free)]
    prompts = [f"prompt {i}" for i in range(len(params))]
    want = [o.token_ids for o in engine("cuda:0", overlap=False).generate(prompts, params)]
    gpu = engine("cuda:0", overlap=True)
    assert gpu.overlap and gpu.runner.graphs is not None
    idle = gpu.pool.num_free_blocks
    for _ in range(2):  # the second pass reuses both mask buffers
        outs = gpu.generate(prompts, params)
        assert [o.token_ids for o in outs] == want
    for o, p in zip(outs, params):
        if p.grammar is json_g:
            jsonschema.validate(json.loads(o.text), SCHEMA)
        elif p.grammar is regex_g:
            whole = o.finish_reason.value == "stop"  # (else cut by max_tokens: a prefix)
            assert re.fullmatch("x[0-9]{2,9}y" if whole else "x[0-9]{0,9}", o.text), o.text
    assert gpu.pool.num_free_blocks == idle
    assert not gpu.grammars._matchers
