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


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_cache_reuse_and_preemption_keep_the_output(family, root):
    """MLA's latent blocks serve the prefix cache and preemption by recompute as K/V blocks do:
    prompts sharing a 48-token prefix, run again (their full blocks reused) and on a cache so small
    that sequences are preempted, generate what a roomy engine does."""
    ck = build_checkpoint(family, root / "reuse")
    write_tokenizer(ck.path, ck.hf_model.config.vocab_size)
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(0, 128, (48,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 20, 33)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    def engine(**kw) -> Engine:
        return Engine(EngineConfig(model=ModelConfig(path=str(ck.path), dtype="float32"), **kw))

    want = [c.token_ids for c in engine(num_kv_blocks=64, enable_prefix_cache=False).generate(prompts, params)]
    cached = engine(num_kv_blocks=64)
    assert [c.token_ids for c in cached.generate(prompts[:1], params)] == want[:1]
    again = cached.generate(prompts, params)
    assert [c.token_ids for c in again] == want
    assert [c.num_cached_tokens for c in again] == [48, 48, 48]  # 3 full blocks of the prefix
    small = engine(num_kv_blocks=12, enable_prefix_cache=False)  # 3 sequences need 16 blocks at the end
    assert [c.token_ids for c in small.generate(prompts, params)] == want
    assert small.scheduler.num_preemptions > 0
