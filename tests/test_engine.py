"""Engine core on the tiny-moe preset: scheduling variants must not change greedy output, and
every workload returns the block pool to its idle count."""

import time

import pytest
import torch

from pdserve.messages import Request
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import InvalidRequestError, SamplingParams
from pdserve.engine.sequence import FinishReason

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


MODE = {"overlap_scheduling": False}


@pytest.fixture(autouse=True, params=[False, True], ids=["sync", "overlap"])
def overlap(request):
    """Every test twice: steps handed out as they finish, and overlapped (step N+1 queued before
    step N's tokens are handed out), which must not change anything a user sees."""
    MODE["overlap_scheduling"] = request.param
    yield request.param
    MODE["overlap_scheduling"] = False


def make_engine(**kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("overlap_scheduling", MODE["overlap_scheduling"])
    return Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), **kw))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 15, 16, 17, 40, 100, 7, 64][:n]
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lengths]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Each prompt generated alone, unchunked: the oracle for every batched variant."""
    engine = make_engine(overlap_scheduling=False)
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts(8)]


def run(engine: Engine, ps, params=GREEDY) -> list[list[int]]:
    idle = engine.pool.num_free_blocks
    outs = [c.token_ids for c in engine.generate(ps, params)]
    assert engine.pool.num_free_blocks == idle
    return outs


def test_batched_equals_alone(reference):
    assert run(make_engine(), prompts(8)) == reference


def test_chunked_prefill_equals_unchunked(reference):
    engine = make_engine(max_num_batched_tokens=32, chunk_size=13)
    assert run(engine, prompts(8)) == reference


def test_prefix_cache_hits_equal_misses(reference):
    engine = make_engine()
    ps = prompts(8)
    run(engine, ps)  # fills the prefix cache
    second = engine.generate(ps, GREEDY)
    assert [c.token_ids for c in second] == reference
    assert second[5].num_cached_tokens == 96  # 100-token prompt: 6 full blocks reused
    assert engine.pool.num_free_blocks == 256


def test_a_prompts_block_chain_is_hashed_after_its_step_is_launched(reference):
    """The prefix-cache lookup hashes a fresh prompt's chain only as far as it reads (its first
    block); the rest is hashed once the step is on the device, and the blocks it registers carry
    the chain's keys: a repeat of the prompt hits every full block."""
    from pdserve.engine.block_pool import HashChain, block_hashes

    engine = make_engine()
    p = prompts(8)[5]  # 100 tokens: 6 full blocks
    engine.add_request("a", p, GREEDY)
    seq = engine.seqs["a"]
    schedule_first, seen = engine.scheduler.schedule, {}

    def schedule():
        out = schedule_first()
        chain = seq.lookup_hashes
        seen["lazy"] = isinstance(chain, HashChain) and len(chain._done) == 1  # the lookup's one read
        return out

    engine.scheduler.schedule = schedule
    launch = engine._launch

    def launched(scheduled):
        seen["hashed_before_launch"] = seq.lookup_hashes.is_complete
        return launch(scheduled)

    engine._launch = launched
    engine.step()
    assert seen == {"lazy": True, "hashed_before_launch": False}
    assert seq.lookup_hashes.is_complete  # (hash_launched, beside the device's work)
    assert list(seq.lookup_hashes) == block_hashes(p[:99], engine.config.block_size)
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.schedule, engine._launch = schedule_first, launch
    repeat = engine.generate([p], GREEDY)[0]
    assert repeat.num_cached_tokens == 96 and repeat.token_ids == reference[5]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_preemption_equals_no_preemption(reference):
    # 8 prompts need ~30 blocks to finish; 14 blocks force preemption by recompute.
    engine = make_engine(num_kv_blocks=14, enable_prefix_cache=False)
    assert run(engine, prompts(8)) == reference
    assert engine.scheduler.num_preemptions > 0


def test_disaggregated_seam_equals_colocated(reference):
    """Prefill on one engine, copy the KV blocks into another, continue decoding there."""
    prefill = make_engine(role="prefill")
    decode = make_engine(role="decode")
    decode.pool.allocate(37)  # different free layout: destination ids differ from the source's
    for i, p in enumerate(prompts(8)):
        rid = f"r{i}"
        prefill.add_request(rid, p, GREEDY)
        outs = []
        while prefill.has_unfinished():
            outs += prefill.step()
        (first,) = outs
        assert first.finished and first.kv_block_ids
        reserved = decode.reserve(Request(rid, p, GREEDY))
        assert reserved.cached_blocks == 0  # (prompts that share no block)
        dst = reserved.block_ids
        assert len(dst) == len(first.kv_block_ids)
        decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, first.kv_block_ids]
        prefill.release(rid)
        decode.start_decode(rid, first.token_ids[0])
        tokens = []  # the decode side streams every token, the first one included
        while decode.has_unfinished():
            tokens += [t for o in decode.step() for t in o.token_ids]
        assert tokens == reference[i]
    assert prefill.pool.num_free_blocks == 256
    assert decode.pool.num_free_blocks == 256 - 37


def close_logprobs(got, want) -> None:
    """Logprob entries of one request, disaggregated and colocated: the same tokens and texts, values
    close (batches differ, so rounding may too; near-tied alternatives may swap places)."""
    assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
    assert [lp.text for lp in got] == [lp.text for lp in want]
    for g, w in zip(got, want):
        assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)
        assert g.top[0][0] == w.top[0][0] == g.token_id  # greedy: the most likely token
        names = {t: text for (t, _), text in zip(w.top, w.top_texts)}
        assert all(names.get(t, text) == text for (t, _), text in zip(g.top, g.top_texts))


def test_decode_engines_first_output_has_the_first_tokens_logprob():
    """The first token is sampled by the prefill engine; its logprob goes with it in the finish
    notice (through the real connectors, in one process) and the decode engine's first output
    carries it: a request gets one entry per token, as from colocated generation."""
    from kv_pair import loopback_pair

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    ps = prompts(4)
    want = make_engine().generate(ps, params)
    prefill, decode = make_engine(role="prefill"), make_engine(role="decode")
    streamer, intake = loopback_pair(prefill, decode)
    outputs: dict[str, list] = {f"r{i}": [] for i in range(len(ps))}
    try:
        for i, p in enumerate(ps):
            streamer.add(Request(f"r{i}", p, params), intake.reserve(Request(f"r{i}", p, params)))
        deadline = time.monotonic() + 60
        while not all(o and o[-1].finished for o in outputs.values()):
            assert time.monotonic() < deadline, "the decode engine did not finish"
            streamer.step()
            assert intake.poll() == []
            for out in decode.step():
                outputs[out.request_id].append(out)
    finally:
        streamer.connector.close()
        intake.connector.close()
    for i, w in enumerate(want):
        first = outputs[f"r{i}"][0]
        assert first.token_ids == w.token_ids[:1] and [lp.token_id for lp in first.logprobs] == w.token_ids[:1]
        got = [lp for o in outputs[f"r{i}"] for lp in o.logprobs]
        close_logprobs(got, w.logprobs)
        assert "".join(lp.text for lp in got) == w.text == "".join(o.text for o in outputs[f"r{i}"])
    assert prefill.pool.num_free_blocks == decode.pool.num_free_blocks == 256


def test_logprob_entries_name_each_token_by_its_own_text():
    """Each entry's text is what its token added to the output: they join to the text; the token
    among its alternatives has the same name, the others are decoded alone."""
    engine = make_engine()
    for n in (1, 2, 5, 24):
        c = engine.generate(prompts(3), SamplingParams(max_tokens=n, temperature=0, logprobs=2))
        for x in c:
            assert len(x.logprobs) == len(x.token_ids)
            assert "".join(lp.text for lp in x.logprobs) == x.text
            for lp in x.logprobs:
                assert len(lp.top_texts) == len(lp.top) == 2
                for (t, _), text in zip(lp.top, lp.top_texts):
                    assert text == (lp.text if t == lp.token_id else engine.tokenizer.decode([t], False))


def test_decode_reservation_refused_when_full_and_released_on_abort():
    decode = make_engine(role="decode", num_kv_blocks=8)
    assert decode.reserve(Request("a", list(range(100)), GREEDY)) is not None  # 7 blocks
    assert decode.reserve(Request("b", list(range(40)), GREEDY)) is None
    assert decode.abort("a")
    assert decode.pool.num_free_blocks == 8
    assert decode.reserve(Request("b", list(range(40)), GREEDY)) is not None
    decode.release("b")
    assert decode.pool.num_free_blocks == 8


def test_abort_mid_generation_frees_blocks():
    engine = make_engine()
    for i, p in enumerate(prompts(4)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.pool.num_free_blocks < 256
    for i in range(4):
        assert engine.abort(f"r{i}")
    assert not engine.has_unfinished()
    assert engine.pool.num_free_blocks == 256


def test_stop_conditions():
    engine = make_engine()
    ps = prompts(3)
    free = engine.generate(ps[:1], GREEDY)[0]
    stop_id = free.token_ids[5]
    c = engine.generate(ps[:1], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]))[0]
    assert c.finish_reason == FinishReason.STOP
    assert c.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    c = engine.generate(ps[:1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert c.finish_reason == FinishReason.LENGTH and c.token_ids == free.token_ids[:3]
    text = engine.generate(ps[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    stop = text[4:6]
    if stop:
        c = engine.generate(ps[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
        assert c.finish_reason == FinishReason.STOP
        assert c.text == text[: text.index(stop)]


def test_seeded_sampling_is_reproducible_and_varies_with_seed():
    engine = make_engine()
    p = prompts(2)
    s = dict(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, ignore_eos=True)
    a = engine.generate(p, SamplingParams(seed=1, **s))
    b = engine.generate(p, SamplingParams(seed=1, **s))
    c = engine.generate(p, SamplingParams(seed=2, **s))
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    # Resumed after 5 of its tokens, in another engine (a hand-off or a migration: its output_ids
    # come along), a seeded request goes on with the tokens its undisturbed run drew.
    other = make_engine()
    other.add_request("resumed", p[0], SamplingParams(seed=1, **s), output_ids=a[0].token_ids[:5])
    rest = []
    while other.has_unfinished():
        for o in other.step():
            rest += o.token_ids
    assert len(a[0].token_ids) == 16 and a[0].token_ids[:5] + rest == a[0].token_ids


def test_logprobs_are_returned_per_token():
    engine = make_engine()
    c = engine.generate(prompts(1), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3))[0]
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.top[0][0] == tok  # greedy picks the most likely token
        assert len(lp.top) == 3


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
])
def test_bad_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_prompt_longer_than_context_is_refused():
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe", max_model_len=64), num_kv_blocks=64))
    with pytest.raises(InvalidRequestError, match="prompt.*context is 64"):
        engine.add_request("x", list(range(64)), GREEDY)
    with pytest.raises(InvalidRequestError, match="prompt"):
        engine.add_request("y", [], GREEDY)
    # Generation stops at the context length.
    c = engine.generate([list(range(60))], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert c.finish_reason == FinishReason.LENGTH and len(c.token_ids) == 4
    assert engine.pool.num_free_blocks == 64


def test_overlapped_steps_hand_out_tokens_one_call_later(overlap, reference):
    """Overlapped, a step() queues its own forward first and then hands out the step before it:
    the prompt's first token comes with the second call; the tokens are the same."""
    engine = make_engine()
    engine.add_request("r", prompts(8)[4], GREEDY)
    first = engine.step()
    assert len(first) == (0 if overlap else 1)
    tokens = [t for o in first for t in o.token_ids]
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.token_ids]
    assert tokens == reference[4]
    assert engine.pool.num_free_blocks == 256


def test_a_stop_string_at_the_very_end_stops_even_in_held_back_text():
    """The detokenizer holds back the bytes of an unfinished character until the request ends; a
    stop string that ends with them is found in that last flush, and the request ends by stop."""
    engine = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64))
    params = dict(max_tokens=24, temperature=0, ignore_eos=True)
    ref = engine.generate(["Once upon a time"], SamplingParams(**params))[0]
    stop = ref.text[-3:]
    out = engine.generate(["Once upon a time"], SamplingParams(**params, stop=[stop]))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.text == ref.text[:ref.text.index(stop)]


def staggered(engine: Engine, ps: list[list[int]], every: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Prompts arriving one every `every` steps while the earlier ones decode -> each one's tokens,
    and each step's (decoding rows, prompt rows)."""
    steps: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        decoding = sum(1 for s in out if s.seq.num_computed_tokens == s.seq.num_tokens - 1)
        steps.append((decoding, len(out) - decoding))
        return out
    engine.scheduler.schedule = counted
    got: dict[str, list[int]] = {}
    arriving = list(enumerate(ps))
    k = 0
    while arriving or engine.has_unfinished():
        if arriving and k % every == 0:
            i, p = arriving.pop(0)
            engine.add_request(f"r{i}", p, GREEDY)
            got[f"r{i}"] = []
        for out in engine.step():
            got[out.request_id] += out.token_ids
        k += 1
    return [got[f"r{i}"] for i in range(len(ps))], steps


def test_a_long_prompt_is_computed_fresh_past_a_short_cached_prefix():
    """Where a prefill graph takes a long prompt whole (a GPU's), a cached prefix under 1/8 of it
    is not used: the `varlen` path's paged attention costs more than the prefix saves. A larger one
    is used, and without prefill graphs (the CPU's) any. The same tokens either way; the references
    the lookup took go back."""
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, 256, (2112,), generator=g).tolist()
    other = torch.randint(0, 256, (2112,), generator=g).tolist()
    short = first[:256] + other[256:]  # 16 blocks of 132 cached: under 1/8
    longer = first[:1024] + other[1024:]  # 64 blocks cached
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    kw = dict(num_kv_blocks=600, chunk_size=4096)
    want = [make_engine(enable_prefix_cache=False, **kw).generate([p], params)[0].token_ids for p in (short, longer)]
    graphs = make_engine(**kw)
    graphs.scheduler.graph_limits(prompt_tokens=4096, prompt_seqs=4, decode_batch=64)
    graphs.generate([first], params)
    outs = [graphs.generate([p], params)[0] for p in (short, longer)]
    assert [o.token_ids for o in outs] == want
    assert [o.num_cached_tokens for o in outs] == [0, 1024]
    assert graphs.pool.num_free_blocks == graphs.pool.num_blocks
    cpu = make_engine(**kw)
    cpu.generate([first], params)
    assert cpu.generate([short], params)[0].num_cached_tokens == 256


def test_prompts_step_apart_from_decoders_where_no_graph_takes_them_together(reference):
    # As an engine whose prefill graphs hold one prompt (MLA's) sets it: a mixed step would run
    # eagerly, so a fresh prompt goes in a step of its own, the decoders' step follows, and nothing
    # changes in the tokens.
    ps = prompts(8)[1:]  # (a one-token prompt looks like a decoding row)
    apart = make_engine()
    apart.scheduler.graph_limits(prompt_tokens=512, prompt_seqs=1, decode_batch=64)  # (counts as 8)
    got, steps = staggered(apart, ps, every=3)
    assert got == reference[1:]
    assert not [s for s in steps if s[0] and s[1]], "a step mixed a prompt with decoding rows"
    alone = [i for i, s in enumerate(steps) if s[1] and not s[0]]
    assert len(alone) >= len(ps) - 1 and all(steps[i + 1][1] == 0 for i in alone if i + 1 < len(steps))
    # Without the graphs (the CPU's default) the same arrivals mix, with the same tokens; and where a
    # `varlen` graph takes the prompt with every decoder (room for 8 sequences), they mix too.
    for seqs in (0, 8):
        mixing = make_engine()
        if seqs:
            mixing.scheduler.graph_limits(prompt_tokens=512, prompt_seqs=seqs, decode_batch=64)
        got, steps = staggered(mixing, ps, every=3)
        assert got == reference[1:] and [s for s in steps if s[0] and s[1]]
    # A prompt whose prefix is cached (a repeat of one served already), beside two decoders: apart
    # where graphs of two prompts take it alone (they read the cached keys through the block table;
    # the second prompt, fresh, mixed with the one decoder then); mixed where graphs hold one fresh
    # prompt each (MLA's), or where one `varlen` graph of four takes the three together.
    for seqs, mixed in ((2, [(1, 1)]), (1, [(2, 1)]), (4, [(1, 1), (2, 1)])):
        again = make_engine()
        again.scheduler.graph_limits(prompt_tokens=512, prompt_seqs=seqs, decode_batch=64)
        got, steps = staggered(again, [ps[4], ps[0], ps[4]], every=10)  # (100 tokens: 6 blocks cached)
        assert got == [reference[5], reference[1], reference[5]]
        assert [s for s in steps if s[0] and s[1]] == mixed  # ((2, 1): the repeat, beside both decoders)
        assert again.pool.num_free_blocks == again.pool.num_blocks
        assert again.profile.prefix_hits == 6 * again.config.block_size
    # More decoders than the decode graph holds: mixed as before.
    few = make_engine()
    few.scheduler.graph_limits(prompt_tokens=512, prompt_seqs=1, decode_batch=1)
    got, steps = staggered(few, ps, every=3)
    assert got == reference[1:] and [s for s in steps if s[0] > 1 and s[1]]
