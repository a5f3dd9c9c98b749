"""The sampler's logits processors (pdserve/engine/logits_processors.py) against HF transformers'
on the same logits: repetition penalty, min new tokens, sequence bias (logit_bias), min-p, top-k; the
OpenAI presence/frequency penalties (HF has none) against their documented formula. Batches mix rows
with and without each parameter, and the token counts are checked over several steps of sampling."""

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                                                    TopKLogitsWarper)

from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.protocol import InvalidRequestError, SamplingParams

VOCAB = 50
EOS = frozenset({3, 7})


def _seq(rid: str, prompt: list[int], output: list[int], **params) -> Sequence:
    return Sequence(rid, prompt + output, len(prompt), SamplingParams(temperature=0, max_tokens=64, **params))


def _hf_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """One row as HF (repetition, over prompt + output) and OpenAI (frequency, presence, over the output) have it."""
    p = seq.params
    row = logits[None].clone()
    if p.repetition_penalty != 1:
        row = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(torch.tensor([seq.token_ids]), row)
    counts = Counter(seq.output_ids)
    for t, c in counts.items():  # OpenAI's: mu[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty
        row[0, t] -= c * p.frequency_penalty + p.presence_penalty
    return row[0]


def test_penalties_match_hf_over_steps():
    torch.manual_seed(0)
    sampler = Sampler(torch.device("cpu"), EOS)
    seqs = [_seq("plain", [1, 2, 4], []),
            _seq("rep", [5, 6, 5, 9], [], repetition_penalty=1.7),
            _seq("freq", [5, 6], [11], frequency_penalty=0.9),  # a moved request: one token generated elsewhere
            _seq("all", [8, 8, 2], [], repetition_penalty=0.6, frequency_penalty=-1.1, presence_penalty=1.5),
            _seq("pres", [1], [], presence_penalty=-2.0)]
    for step in range(6):
        logits = torch.randn(len(seqs), VOCAB) * 3
        expected = torch.stack([_hf_penalties(logits[i], s) for i, s in enumerate(seqs)])
        processed, _ = sampler._process(logits.float(), seqs, [s.params for s in seqs])
        torch.testing.assert_close(processed, expected)
        tokens, _ = sampler.sample(logits, seqs)
        assert tokens == expected.argmax(-1).tolist()
        for s, t in zip(seqs, tokens):
            s.token_ids.append(t)
    assert sampler._counts is not None and set(sampler._counts.rows) == {"rep", "freq", "all", "pres"}
    for s in seqs:
        sampler.forget(s.request_id)
    assert not sampler._counts.rows


def test_penalty_changes_greedy_choice():
    """A token the row keeps choosing is pushed down by a strong repetition penalty: the test can fail."""
    sampler = Sampler(torch.device("cpu"), EOS)
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 5.0, 4.0
    seq = _seq("r", [10], [], repetition_penalty=2.0)
    assert sampler.sample(logits, [seq])[0] == [11]
    assert sampler.sample(logits, [_seq("plain", [10], [])])[0] == [10]


def test_min_tokens_and_logit_bias_match_hf():
    torch.manual_seed(1)
    sampler = Sampler(torch.device("cpu"), EOS)
    seqs = [_seq("min", [1, 2], [4], min_tokens=3, stop_token_ids=[12]),
            _seq("min-done", [1, 2], [4, 5, 6], min_tokens=3),  # has its 3: nothing held off
            _seq("min-noeos", [1, 2], [], min_tokens=2, ignore_eos=True, stop_token_ids=[13]),
            _seq("bias", [1], [], logit_bias={20: 100.0, 21: -50.5}),
            _seq("plain", [1], [])]
    logits = torch.randn(len(seqs), VOCAB)
    expected = logits.clone()
    expected[0] = MinNewTokensLengthLogitsProcessor(2, 3, [3, 7, 12])(torch.tensor([[1, 2, 4]]), logits[0:1].clone())[0]
    expected[2] = MinNewTokensLengthLogitsProcessor(2, 2, [13])(torch.tensor([[1, 2]]), logits[2:3].clone())[0]
    expected[3] = SequenceBiasLogitsProcessor([[[20], 100.0], [[21], -50.5]])(torch.tensor([[1]]), logits[3:4].clone())[0]
    processed, _ = sampler._process(logits, seqs, [s.params for s in seqs])
    torch.testing.assert_close(processed, expected)
    assert sampler.sample(logits, seqs)[0][3] == 20  # the bias forces it


@pytest.mark.parametrize("min_p,top_k", [(0.3, 0), (0.05, 4), (0.0, 3)])
def test_min_p_top_k_keep_what_hf_keeps(min_p, top_k):
    """Random sampling draws only among the tokens HF's warpers leave (after temperature)."""
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)
    temp = 2.0
    scaled = logits / temp
    kept = scaled.clone()
    if top_k:
        kept = TopKLogitsWarper(top_k)(None, kept)
    kept = MinPLogitsWarper(min_p)(None, kept) if min_p else kept
    allowed = set(torch.isfinite(kept[0]).nonzero()[:, 0].tolist())
    assert 1 < len(allowed) < VOCAB  # (the warpers cut some, not all but one)
    sampler = Sampler(torch.device("cpu"), EOS)
    seen = set()
    for i in range(300):
        s = Sequence(f"r{i}", [1], 1, SamplingParams(temperature=temp, min_p=min_p, top_k=top_k, seed=i))
        seen |= set(sampler.sample(logits, [s])[0])
    assert seen <= allowed and len(seen) > 1


@pytest.mark.parametrize("field,value", [("presence_penalty", 2.5), ("frequency_penalty", -2.01),
                                         ("repetition_penalty", 0.0), ("min_p", 1.5), ("min_tokens", -1),
                                         ("logit_bias", {5: 101.0}), ("logit_bias", {-1: 1.0})])
def test_out_of_range_names_the_field(field, value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_min_tokens_over_max_and_vocab_checks():
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert e.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias={"70": 1.0}).check_vocab(VOCAB)
    assert e.value.param == "logit_bias"
    SamplingParams(logit_bias={"49": 1.0}).check_vocab(VOCAB)


@pytest.fixture(scope="module")
def engines():
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine
    make = lambda **kw: Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=256, **kw))  # noqa: E731
    return make(), make(overlap_scheduling=True)


def test_penalties_survive_overlap_and_a_move(engines):
    """The counts are kept on the device: an overlapped engine (step N+1 sampled before the host has
    step N's token) gives the same greedy tokens; so does a request moved after 9 tokens (its counts
    rebuilt from output_ids on the engine it moved to)."""
    from pdserve.messages import Request
    plain, overlapped = engines
    params = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.5, frequency_penalty=0.7,
                            presence_penalty=0.3, min_tokens=3, logit_bias={65: 2.0})
    prompt = "Once upon a time"
    want = plain.generate([prompt], params)[0]
    assert want.token_ids != plain.generate([prompt], SamplingParams(max_tokens=24, temperature=0))[0].token_ids
    assert overlapped.generate([prompt], params)[0].token_ids == want.token_ids
    moved = Request("moved", plain.tokenize(prompt), params, output_ids=want.token_ids[:9])
    overlapped.add(moved)
    got = []
    while overlapped.has_unfinished():
        got += [t for out in overlapped.step() for t in out.token_ids]
    assert got == want.token_ids[9:]
    assert overlapped.pool.num_free_blocks == overlapped.pool.num_blocks and not overlapped.seqs
    assert not overlapped.runner.sampler._counts.rows  # every row given back
    assert not overlapped.runner.sampler._biases._of


@pytest.mark.parametrize("batch", [1, 8, 9, 37])
def test_the_kv_budget_reserves_what_a_full_batch_of_penalty_rows_takes(batch):
    """TokenCounts.most_bytes (what kv_budget.py leaves free for the rows) covers the rows that a
    batch of `batch` penalized sequences makes the table grow to."""
    from pdserve.engine.logits_processors import TokenCounts

    counts = TokenCounts(VOCAB, torch.device("cpu"))
    counts.rows_of([_seq(f"r{i}", [1, 2], [], frequency_penalty=0.5) for i in range(batch)])
    used = sum(t.numel() * t.element_size() for t in (counts.counts, counts.prompt, counts.penalties))
    assert used <= TokenCounts.most_bytes(batch, VOCAB) < 2 * used + 8 * (VOCAB * 5 + 12)
