"""Greedy generation through the whole engine equals transformers' `generate`, every family."""

import copy

import pytest
import torch

from hf_checkpoints import FAMILIES, build_checkpoint, write_tokenizer
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams

NEW_TOKENS = 32
PROMPT_LENS = [3, 16, 29, 50]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gen")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generation_equals_transformers(family, root):
    ck = build_checkpoint(family, root)
    write_tokenizer(ck.path, ck.hf_model.config.vocab_size)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in PROMPT_LENS]

    # Both sides stop at the checkpoint's eos (Mixtral's config has one; the others none).
    gen_cfg = copy.deepcopy(ck.hf_model.generation_config)
    gen_cfg.pad_token_id = 0
    gen_cfg.max_new_tokens, gen_cfg.do_sample = NEW_TOKENS, False
    expected = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            # An explicit mask: HF would otherwise mask prompt tokens equal to the pad id.
            out = ck.hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
            expected.append(out[0, len(p):].tolist())

    # Small token budget: the batch mixes prefill chunks with decodes in the same steps.
    engine = Engine(EngineConfig(model=ModelConfig(path=str(ck.path), dtype="float32"),
                                 num_kv_blocks=64, max_num_batched_tokens=40, chunk_size=24))
    idle = engine.pool.num_free_blocks
    got = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    assert [c.token_ids for c in got] == expected
    assert engine.pool.num_free_blocks == idle
