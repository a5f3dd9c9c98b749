"""The TPOT guard (engine/tpot_guard.py): with a fitted step cost, a step that carries decoding
sequences never takes more prompt tokens than the guard's budget, and the decoders' mean step stays
within the TPOT target; the guard paces (it banks the decoders' slack and spends it on a prompt's
whole chunk, not a few tokens every step); where the decoders alone fill the target,
prompts still move on (a least chunk every STARVE_STEPS steps); a step with no decoders is not
bounded; and the guarded engine's greedy output is the unguarded one's. The mixed-step cost is
fitted from what mixed steps took beyond their decoders' step (pdserve/step_cost.py fit_mixed)."""

import pytest

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.step_profile import StepProfile
from pdserve.messages import Request
from pdserve.protocol import SamplingParams
from pdserve.step_cost import BANK_TARGETS, HEADROOM, STARVE_STEPS, MixedCost, StepCost, fit_mixed, fit_phases

DECODE = StepCost(fixed=0.010, per_unit=0.001, steps=100, largest=64)  # 10 ms + 1 ms a sequence
MIXED = MixedCost(DECODE, overhead=0.004, per_token=0.0001)  # + 4 ms once mixed, + 0.1 ms a prompt token


def test_the_pace_is_what_the_decoders_slack_buys():
    # 8 decoders: 18 ms a step, 18 ms of slack under 0.9 x 40 ms. A chunk is worth its 4 ms overhead
    # from 40 tokens; a full bank (8 x 36 ms) and a step's slack buy 3,020 tokens.
    assert MIXED.slack(8, 0.040) == pytest.approx(HEADROOM * 0.040 - 0.018)
    assert MIXED.least_chunk(16) == 40 and MIXED.least_chunk(64) == 64
    assert MIXED.bank_cap(0.040) == pytest.approx(BANK_TARGETS * HEADROOM * 0.040)
    assert MIXED.buys(MIXED.bank_cap(0.040) + 0.018) == 3020 and MIXED.buys(0.003) == 0
    # 500 tokens in one chunk: 54 ms of mixing, banked over 3 steps. 4k in chunks of 2048: 417.6 ms,
    # over 24 steps.
    assert MIXED.paced_s(8, 500, 0.040, 16, 512) == pytest.approx(3 * 0.018 + 0.054)
    assert MIXED.paced_s(8, 4096, 0.040, 16, 2048) == pytest.approx(24 * 0.018 + 0.4176)
    # 40 ms of decoders fill the target: a least chunk (40 tokens) after STARVE_STEPS steps.
    assert MIXED.paced_s(30, 40, 0.040, 16, 512) == pytest.approx(STARVE_STEPS * 0.040 + 0.004 + 0.004)
    assert MIXED.time(8, 0) == DECODE.time(8) and MIXED.time(8, 100) == pytest.approx(DECODE.time(8) + 0.004 + 0.01)


def test_the_mixed_cost_is_fitted_beyond_the_decoders_step():
    profile = StepProfile()
    for decoders in (4, 8, 16):
        profile.record(0, decoders, DECODE.time(decoders))
        for tokens in (64, 512):
            profile.record(tokens, decoders, MIXED.time(decoders, tokens))
    snap = profile.snapshot()
    decode, _ = fit_phases(snap)
    mixed = fit_mixed(snap, decode)
    assert abs(mixed.overhead - 0.004) < 1e-9 and abs(mixed.per_token - 0.0001) < 1e-12
    assert fit_mixed({"decode": snap["decode"]}, decode) is None  # no mixed step measured: no fit


def run(target_ms: float | None) -> tuple[dict, list[tuple[int, int, int | None]]]:
    """Eight short requests decoding, then three long prompts arrive: each step's (decoders, prompt
    tokens, the guard's budget), and every request's tokens."""
    e = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=256, chunk_size=512,
                            tpot_guard_ms=target_ms))
    guard = e.scheduler.guard
    if guard is not None:
        guard.refit_steps = 1 << 30  # keep the test's costs (no refit from this CPU's steps)
        guard.fitted(MIXED)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(8):
        e.add(Request(f"short{i}", e.tokenize(f"request number {i} says"), params))
    steps, done = [], {}
    schedule = e.scheduler.schedule

    def watched():
        decoders = sum(1 for q in e.scheduler.running if q.num_tokens - q.num_computed_tokens == 1)
        budget = guard.budget(decoders, e.scheduler._next_chunk()) if guard is not None else None
        out = schedule()
        prompt = sum(s.num_new_tokens for s in out if s.seq.num_tokens - s.seq.num_computed_tokens > 1)
        steps.append((decoders, prompt, budget))
        return out

    e.scheduler.schedule = watched
    n = 0
    while e.has_unfinished():
        if n == 3:
            for i in range(3):
                e.add(Request(f"long{i}", [(7 * i + k) % 200 + 3 for k in range(600)], params))
        for o in e.step():
            done.setdefault(o.request_id, []).extend(o.token_ids)
        n += 1
    assert e.pool.num_free_blocks == 256
    return done, steps


def test_a_decode_step_never_takes_more_prompt_tokens_than_the_budget():
    out, steps = run(target_ms=40)
    guarded = [(d, p, b) for d, p, b in steps if d > 0 and b is not None]
    mixed = [(d, p, b) for d, p, b in guarded if p > 0]
    assert mixed and len(mixed) < len(guarded), steps  # the prompts went beside decoders, not in every step
    # Each in chunk_size (512) chunks the bank paid for whole, not cut smaller: 3 prompts of 600
    # tokens in at most 2 mixed steps each.
    assert len(mixed) <= 6 and all(p >= 600 - 512 for _, p, _ in mixed), mixed
    for decoders, prompt, budget in guarded:
        assert prompt <= budget, (decoders, prompt, budget)
    # The decoders' mean step, as the model costs each, stays within 0.9 x the target (and the bank).
    spent = sum(MIXED.time(d, p) for d, p, _ in guarded)
    assert spent <= len(guarded) * HEADROOM * 0.040 + HEADROOM * 0.040
    unguarded, _ = run(target_ms=None)
    assert out == unguarded  # the same tokens, in other chunks


def test_where_the_decoders_fill_the_target_prompts_still_move_on():
    out, steps = run(target_ms=20)  # 8 decoders: 18 ms = 0.9 x 20 ms, no slack
    guarded = [(d, p, b) for d, p, b in steps if d > 0 and b is not None]
    assert all(p <= MIXED.least_chunk(16) for _, p, _ in guarded)
    trickle = [i for i, (d, p, b) in enumerate(steps) if d > 0 and b is not None and p > 0]
    assert trickle and all(b - a >= STARVE_STEPS for a, b in zip(trickle, trickle[1:])), trickle
    assert out == run(target_ms=None)[0]
