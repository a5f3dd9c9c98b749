"""Speculative decoding with n-gram drafts, in the engine: lossless (greedy tokens identical with it on
and off, on the GQA and MLA families; every sampling parameter keeps its meaning when a step
accepts several tokens; the rejection sampler's draws follow the target's distribution), and KV
exact (a rejected draft's blocks go back at once; every workload, aborts included, returns the
pool to its idle count)."""

import pytest
import torch

from hf_checkpoints import checkpoint_path
from pdserve.config import ClusterConfig, ConfigError, EngineConfig, ModelConfig, load_cluster_config
from pdserve.engine import ngram
from pdserve.engine.engine import Engine
from pdserve.engine.sampler import Sampler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import Drafts
from pdserve.protocol import SamplingParams
from pdserve.router.openai_protocol import CompletionRequest

SPEC = {"method": "ngram", "num_tokens": 4, "prompt_lookup_max": 3}
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def engine(path: str = "tiny-moe", speculative: dict | None = None, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    return Engine(EngineConfig(model=ModelConfig(path=path), speculative=speculative or {}, **kw))


def byte_prompts() -> list[list[int]]:
    """Repetitive prompts (the drafts' case: text that repeats itself) beside random ones."""
    g = torch.Generator().manual_seed(0)
    rand = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 17, 40)]
    return [list(b"Hello, world! " * 6), list(b"def f(x):\n    return x + 1\n" * 3)] + rand


def run(e: Engine, prompts, params) -> list:
    """Generate step by step, checking after each step that every running sequence holds exactly the
    blocks its computed tokens need (a rejected draft's block went back), and at the end that the
    pool is idle again."""
    idle = e.pool.num_free_blocks
    ids = [f"r{i}" for i in range(len(prompts))]
    out = {rid: [] for rid in ids}
    for rid, p in zip(ids, prompts):
        e.add_request(rid, p, params)
    while e.has_unfinished():
        for o in e.step():
            out[o.request_id].append(o)
        for seq in e.scheduler.running:
            assert len(seq.block_ids) == -(-seq.num_computed_tokens // e.config.block_size), seq.request_id
    assert e.pool.num_free_blocks == idle
    return [out[rid] for rid in ids]


def tokens(outputs) -> list[list[int]]:
    return [[t for o in outs for t in o.token_ids] for outs in outputs]


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ids = [1, 2, 3, 9, 1, 2, 4, 5, 7, 2, 3, 8, 1, 2]
    assert ngram.propose(ids, 3, 1, 2) == [4, 5, 7]  # [1, 2]'s latest earlier occurrence
    assert ngram.propose(ids, 3, 1, 1) == [3, 8, 1]  # n = 1: [2]'s latest, at index 9
    assert ngram.propose(ids, 9, 2, 3) == [4, 5, 7, 2, 3, 8, 1, 2]  # as far as the sequence goes
    assert ngram.propose([1, 2, 3], 3, 1, 3) == []  # 3 never came before
    assert ngram.propose([5, 5], 2, 1, 3) == [5]


def test_ngram_drafter_equals_a_plain_search_as_a_sequence_grows():
    def plain(ids, k, lo, hi):  # every window, latest first, longest n first
        for n in range(min(hi, len(ids) - 1), lo - 1, -1):
            for i in range(len(ids) - n - 1, -1, -1):
                if ids[i:i + n] == ids[len(ids) - n:]:
                    return ids[i + n:i + n + k]
        return []

    g = torch.Generator().manual_seed(0)
    for lo, hi in ((1, 4), (2, 3), (1, 1)):
        drafter, ids = ngram.NgramDrafter(lo, hi), []
        for t in torch.randint(0, 4, (300,), generator=g).tolist():
            ids.append(t)  # (one buffer per request, grown by the new tokens only)
            assert drafter.propose("r", ids, 3) == plain(ids, 3, lo, hi), (ids, lo, hi)


@pytest.fixture(scope="module")
def tiny() -> tuple[Engine, Engine]:
    """tiny-moe (grouped-query attention) without and with speculation."""
    return engine(), engine(speculative=SPEC)


@pytest.fixture(scope="module")
def want(tiny) -> list[list[int]]:
    """byte_prompts' greedy tokens without speculation: the oracle."""
    return tokens(run(tiny[0], byte_prompts(), GREEDY))


def test_greedy_tokens_are_identical_and_drafts_are_accepted(tiny, want):
    off, on = tiny
    before = on.profile.snapshot()
    outs = run(on, byte_prompts(), GREEDY)
    assert tokens(outs) == want
    after = on.profile.snapshot()
    drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert 0 < accepted < drafted  # drafts held, and some were rejected (rolled back)
    assert max(len(o.token_ids) for outs_ in outs for o in outs_) > 1  # one output carried several tokens


@pytest.mark.parametrize("kw", [
    {"num_kv_blocks": 14, "enable_prefix_cache": False},  # preemption by recompute among drafts
    {"max_num_batched_tokens": 12, "chunk_size": 7},  # a budget that drafts have to fit in
    {"overlap_scheduling": True},  # asked for, but a speculating engine does not overlap
], ids=["preempting", "small-budget", "overlap-asked"])
def test_greedy_tokens_are_identical_under_other_schedules(want, kw):
    on = engine(speculative=SPEC, **kw)
    assert not on.overlap
    assert tokens(run(on, byte_prompts(), GREEDY)) == want
    if "num_kv_blocks" in kw:
        assert on.scheduler.num_preemptions > 0


def test_greedy_tokens_are_identical_on_mla(tmp_path_factory):
    path = str(checkpoint_path("deepseek_v2", tmp_path_factory.mktemp("ckpt"), sharp=True))
    off, on = engine(path), engine(path, speculative=SPEC)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 5 + [3], [1, 2]]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    assert tokens(run(on, prompts, params)) == tokens(run(off, prompts, params))
    assert on.profile.spec_accepted_tokens > 0


STORY = "Once upon a time"  # tiny-moe's greedy answer to it repeats itself, varied: drafts hold and fail


def _stop_cases(off: Engine) -> list[SamplingParams]:
    """Parameters whose effect depends on each token's place: stops taken from the reference's own
    output (so they fall inside an accepted run), min_tokens, max_tokens, penalties, bias, logprobs."""
    out = off.generate([STORY], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].token_ids
    stop_id = next(t for i, t in enumerate(out) if i > 8 and t not in out[:i])  # first seen late
    text = off.tokenizer.decode
    stop = next(text(out[j:j + 2]) for j in range(10, 24) if text(out[j:j + 2]) not in text(out[:j + 1]))
    base = dict(temperature=0, max_tokens=32)
    return [
        SamplingParams(**base, stop_token_ids=[stop_id]),
        SamplingParams(**base, stop=[stop]),
        SamplingParams(**base, stop_token_ids=[out[1]], min_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
        SamplingParams(**base, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.2),
        SamplingParams(**base, ignore_eos=True, presence_penalty=0.5, logit_bias={out[3]: 3.0}),
        SamplingParams(**base, ignore_eos=True, logprobs=2),
    ]


def test_sampling_parameters_keep_their_meaning_when_a_step_accepts_several_tokens(tiny):
    off, on = tiny
    prompt = STORY
    accepted = on.profile.spec_accepted_tokens
    cases = _stop_cases(off)  # all in one batch: each request's parameters are its own
    for params, want, got in zip(cases, off.generate([prompt] * len(cases), cases),
                                 on.generate([prompt] * len(cases), cases)):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), params
        assert len(got.token_ids) > 3  # (no stop at the first tokens)
        assert len(got.logprobs) == len(want.logprobs)
        for a, b in zip(got.logprobs, want.logprobs):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert on.profile.spec_accepted_tokens > accepted


def test_a_request_may_opt_out(tiny):
    _, on = tiny
    body = CompletionRequest(model="tiny-moe", prompt=STORY, speculative=False)
    params = body.sampling_params(16, None)
    assert not params.speculative and CompletionRequest(model="m", prompt="p").sampling_params(4, None).speculative
    drafted = on.profile.spec_draft_tokens
    on.generate([STORY], params)
    assert on.profile.spec_draft_tokens == drafted


def test_a_request_under_a_grammar_is_not_drafted_and_keeps_its_grammar(tiny):
    """Beside a drafted request in the same steps, a constrained one decodes a token a step, its
    output the non-speculating engine's."""
    from pdserve.structured_outputs import grammar_of

    off, on = tiny
    constrained = SamplingParams(max_tokens=24, temperature=0, grammar=grammar_of("r", "regex", "(ab|cd){3,9}"))
    want = off.generate([STORY, STORY], [GREEDY, constrained])
    drafted = on.profile.spec_draft_tokens
    got = on.generate([STORY, STORY], [GREEDY, constrained])
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert on.profile.spec_draft_tokens > drafted  # (the free one was drafted)
    import re
    assert re.fullmatch("(ab|cd){3,9}", got[1].text), got[1].text
    on.generate([STORY], constrained)
    drafted = on.profile.spec_draft_tokens
    on.generate([STORY], constrained)
    assert on.profile.spec_draft_tokens == drafted


def test_seeded_sampling_is_reproducible_with_speculation(tiny):
    _, on = tiny
    prompt = STORY
    params = [SamplingParams(max_tokens=24, temperature=0.7, seed=seed, ignore_eos=True) for seed in (3, 3, 4)]
    a, b, c = (x.token_ids for x in on.generate([prompt] * 3, params))
    assert a == b != c
    assert on.pool.num_free_blocks == 256


def test_abort_during_a_verify_step_frees_every_block(tiny):
    _, on = tiny
    idle = on.pool.num_free_blocks
    on.add_request("a", byte_prompts()[0], GREEDY)
    on.add_request("b", byte_prompts()[1], GREEDY)
    aborted = []

    def abort_in_verify(layer, scheduled):  # called inside the step's forward, after each layer
        if layer == 0 and any(s.draft for s in scheduled) and not aborted:
            aborted.append(on.abort("a"))

    on.layer_hook = abort_in_verify
    try:
        while on.has_unfinished():
            on.step()
    finally:
        on.layer_hook = None
    assert aborted == [True]
    assert on.pool.num_free_blocks == idle


def _p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test's p-value (upper tail of chi2 with len - 1 degrees of freedom)."""
    keep = expected > 0
    assert observed[~keep].sum() == 0, "a token the target never draws was drawn"
    o, e = observed[keep].double(), expected[keep].double()
    stat = ((o - e) ** 2 / e).sum()
    df = torch.tensor(float(keep.sum() - 1), dtype=torch.double)
    return float(torch.special.gammaincc(df / 2, stat / 2))


@pytest.mark.parametrize("params, draft", [
    (SamplingParams(temperature=1.0), 2),  # a likely draft
    (SamplingParams(temperature=0.7), 5),  # an unlikely one
    (SamplingParams(temperature=1.3, top_k=4), 7),  # one outside top_k: always rejected
], ids=["likely", "unlikely", "outside-top-k"])
def test_rejection_sampling_keeps_the_target_distribution(params, draft):
    """Seqs with one draft token each: row 0 (the draft accepted or replaced) must follow the
    target's distribution, and so must row 1 (the token after an accepted draft)."""
    torch.manual_seed(0)
    n, vocab = 6000, 8
    l0 = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.0, 0.3, 1.5, -0.5])
    l1 = torch.tensor([1.0, -0.3, 0.2, 0.9, 1.2, -1.0, 0.0, 0.4])
    seqs = [Sequence(f"s{i}", [1, 2, 3], 3, params) for i in range(n)]
    drafts = [[draft]] * n
    logits = torch.stack([l0, l1]).repeat(n, 1)
    sampled = Sampler(torch.device("cpu")).launch(logits, Drafts.views(seqs, drafts),
                                                  Drafts.of(drafts, torch.device("cpu")))
    toks, emitted = sampled.tokens.view(n, 2), sampled.emitted.view(n, 2)
    assert emitted[:, 0].all() and torch.equal(emitted[:, 1], toks[:, 0] == draft)

    def target(lg):
        lg = lg / params.temperature
        if params.top_k:
            lg = lg.masked_fill(lg < lg.topk(params.top_k).values[-1], float("-inf"))
        return torch.softmax(lg, -1)

    first = torch.bincount(toks[:, 0], minlength=vocab)
    assert _p_value(first, n * target(l0)) > 1e-3
    after = toks[emitted[:, 1], 1]
    if len(after):
        assert _p_value(torch.bincount(after, minlength=vocab), len(after) * target(l1)) > 1e-3


def test_speculative_is_a_decode_and_colocated_key_off_by_default():
    c = ClusterConfig.model_validate({"decode": {"speculative": {"method": "ngram", "num_tokens": 3}}})
    assert c.engine_config("decode").speculative.num_tokens == 3
    assert c.engine_config("prefill").speculative.method is None
    assert ClusterConfig().engine_config("decode").speculative.method is None
    prefill = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), role="prefill", num_kv_blocks=64,
                                  speculative=SPEC))
    assert not prefill.speculative  # it samples one token per request: nothing to draft


def test_a_bad_lookup_range_names_its_keys(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("colocated:\n  replicas: 1\n  speculative: {method: ngram, prompt_lookup_min: 3, "
                    "prompt_lookup_max: 2}\n")
    with pytest.raises(ConfigError, match=r"colocated\.speculative.*prompt_lookup_min \(3\) must not exceed "
                                          r"prompt_lookup_max \(2\)"):
        load_cluster_config(str(path))
    with pytest.raises(ConfigError, match=r"decode\.speculative\.method"):
        load_cluster_config(None, {"decode.speculative": {"method": "eagle"}})


def test_verify_steps_stay_out_of_the_decode_fit(tiny):
    """A verify step computes 1 + k tokens per decoder: counted under "verify", never "decode" (whose
    fit the planner and the TPOT guard read), every step still in busy_s and tokens_computed."""
    from pdserve.engine.step_profile import StepProfile
    from pdserve.step_cost import fit_phases

    p = StepProfile()
    p.record(0, 4, 0.5, draft_tokens=12)
    p.record(0, 4, 0.01)
    snap = p.snapshot()
    assert snap["verify"] == {4: [1, 4, 12, 0.5]} and snap["decode"] == {4: [1, 4, 0.01]}
    assert snap["tokens_computed"] == 4 + 12 + 4 and snap["busy_s"] == pytest.approx(0.51)
    assert fit_phases(snap)[0].time(4) == pytest.approx(0.01)  # the verify step's 0.5 s is not in it

    _, on = tiny
    before = on.profile.snapshot()
    run(on, byte_prompts()[:2], GREEDY)
    after = on.profile.snapshot()
    steps = lambda snap, phase: sum(row[0] for row in snap[phase].values())  # noqa: E731
    drafts = sum(row[2] for row in after["verify"].values()) - sum(row[2] for row in before["verify"].values())
    assert steps(after, "verify") > steps(before, "verify")
    assert drafts == after["spec_draft_tokens"] - before["spec_draft_tokens"]  # every drafted step there
