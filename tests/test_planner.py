"""The planner (`pdserve tune`'s model): step-cost fits, each phase's capacity, the split it
recommends, the hysteresis of --watch, the scale steps, the profile file, and what the controller's
load window makes of heartbeats. A real engine's step profile is checked too."""

import dataclasses
import json
import math
import random
import statistics
import subprocess
import sys

import pytest

from pdserve.control.load import LoadWindow
from pdserve.control.planner import Hysteresis, Limits, Measured, PlannerError, Traffic, plan, render, scale_steps
from pdserve.engine.step_profile import StepProfile, bucket
from pdserve.messages import ReplicaStats
from pdserve.step_cost import fit

PREFILL_COST = (0.005, 0.0002)  # 5 ms + 0.2 ms per token
DECODE_COST = (0.008, 0.0005)  # 8 ms + 0.5 ms per sequence


def steps_of(cost: tuple[float, float], sizes: list[int], n: int = 10) -> dict[int, list]:
    """Buckets of steps whose times follow `cost` exactly."""
    out: dict[int, list] = {}
    for size in sizes:
        row = out.setdefault(bucket(size), [0, 0, 0.0])
        row[0] += n
        row[1] += n * size
        row[2] += n * (cost[0] + cost[1] * size)
    return out


def measured(traffic: Traffic, replicas=(1, 1), budget: int = 4, ep: int = 1, kv_s: float = 0.0,
             decode_cost: tuple[float, float] = DECODE_COST) -> Measured:
    return Measured(window_s=60, steps={"prefill": steps_of(PREFILL_COST, [128, 512, 2048]),
                                        "decode": steps_of(decode_cost, [1, 8, 32, 128])},
                    busy_s={}, traffic=traffic, kv_transfer_s=kv_s,
                    limits=Limits(8192, 2048, 256, 100_000, 16, ep), slo={"ttft_ms": 1000, "tpot_ms": 100},
                    replicas={"prefill": replicas[0], "decode": replicas[1]}, budget=budget)


# -- fits -----------------------------------------------------------------------------------------


def test_fit_recovers_a_linear_step_cost():
    c = fit(steps_of(PREFILL_COST, [100, 300, 900]), "prefill")
    assert c.fixed == pytest.approx(PREFILL_COST[0], rel=1e-6) and c.per_unit == pytest.approx(PREFILL_COST[1], rel=1e-6)
    assert c.steps == 30 and c.largest == 900


def test_fit_with_one_size_prefill_is_per_token_decode_is_fixed():
    one = {8: [4, 32, 0.4]}  # four steps of 8, 0.1 s each
    p, d = fit(one, "prefill"), fit(one, "decode")
    assert (p.fixed, p.per_unit) == (0.0, pytest.approx(0.1 / 8))
    assert (d.fixed, d.per_unit) == (pytest.approx(0.1), 0.0)
    assert fit({}, "decode") is None


def test_fit_never_goes_negative():
    falling = {1: [10, 10, 1.0], 64: [10, 640, 0.5]}  # bigger steps measured faster: noise
    c = fit(falling, "decode")
    assert c.per_unit == 0.0 and c.fixed > 0
    steep = {16: [10, 160, 0.01], 1024: [10, 10240, 1.0]}  # would cross below zero at small sizes
    c = fit(steep, "prefill")
    assert c.fixed >= 0 and c.per_unit > 0 and c.time(1) > 0


def test_a_prefill_step_costs_at_least_what_a_decode_step_does():
    # Steps of 16 and 32 tokens, the 32s measured twice as slow (a busy host): alone, the fit puts
    # all of it on the tokens and a full 8192-token step at 8192 x 1.9 ms.
    short = {16: [40, 640, 40 * 0.030], 32: [4, 128, 4 * 0.060]}
    alone = fit(short, "prefill")
    assert alone.fixed == 0.0 and alone.time(8192) > 10
    floored = fit(short, "prefill", fixed_floor=0.025)
    mean_size, mean_step = 768 / 44, (1.2 + 0.24) / 44
    assert floored.fixed == 0.025 and floored.per_unit == pytest.approx((mean_step - 0.025) / mean_size)
    assert floored.time(mean_size) == pytest.approx(mean_step) and floored.time(8192) < alone.time(8192) / 4
    # Never above the steps themselves: a floor past the mean step leaves no per-token cost.
    assert fit(short, "prefill", fixed_floor=1.0).fixed == pytest.approx(mean_step)
    # A fit already above the floor keeps its own numbers.
    assert fit(steps_of(PREFILL_COST, [100, 300, 900]), "prefill", fixed_floor=0.001).fixed == pytest.approx(PREFILL_COST[0])


def test_short_noisy_prompts_keep_the_decode_heavy_split():
    # tests/test_tune.py's decode-heavy phase as a CI host measured it: 16-token prompts in steps
    # about as long as a decode step's fixed cost, the few 32-token steps 3x slower. Without the
    # floor one prefill replica was estimated at 66 prompts/s and the planner moved to 2P+1D.
    traffic = Traffic(rate=6, input_len=16, output_len=64, requests=120, finished=120)
    decode_cost = (0.010, 0.0002)
    m = dataclasses.replace(measured(traffic, replicas=(1, 2), budget=3),
                            steps={"prefill": {16: [40, 640, 40 * 0.012], 32: [4, 128, 4 * 0.036]},
                                   "decode": steps_of(decode_cost, [1, 2, 4, 8])})
    p = plan(m)
    assert p.costs["prefill"].fixed == pytest.approx(decode_cost[0])
    assert p.best.counts == (1, 2) and not p.change, render(p, m)


# -- the split ------------------------------------------------------------------------------------


def test_long_prompts_get_more_prefill_than_long_outputs():
    chat = plan(measured(Traffic(rate=20, input_len=64, output_len=512), budget=6))
    summarize = plan(measured(Traffic(rate=20, input_len=4096, output_len=8), budget=6))
    assert summarize.best.prefill.replicas > chat.best.prefill.replicas
    assert chat.best.bottleneck == "decode" and summarize.best.bottleneck == "prefill"
    for p in (chat, summarize):  # every split uses the budget; the best sustains the most
        assert all(s.prefill.replicas + s.decode.replicas == 6 for s in p.splits)
        assert p.best.max_rate == max(s.max_rate for s in p.splits)


def test_a_phase_predicted_at_its_rate_and_past_capacity():
    p = plan(measured(Traffic(rate=1, input_len=1000, output_len=100)))
    s = p.best
    alone = PREFILL_COST[0] + PREFILL_COST[1] * 1000
    assert s.prefill.predicted_ms > alone * 1000  # waits on top of the prefill itself
    assert s.decode.predicted_ms == pytest.approx(1000 * (DECODE_COST[0] + DECODE_COST[1] * 1.0), rel=0.1)
    over = plan(measured(Traffic(rate=10_000, input_len=1000, output_len=100)))
    assert over.best.prefill.predicted_ms is None and "past capacity" in render(over, measured(over.traffic))
    assert over.best.max_rate < 10_000


def simulate_decode(cost: tuple[float, float], rate: float, output_len: int, n: int, seed: int = 0) -> float:
    """A continuous-batching decode engine, step by step: Poisson arrivals join the next step, every
    step (fixed + per_seq x batch seconds) gives each sequence in it a token, a sequence leaves after
    output_len - 1 tokens (the first came from prefill). Returns the mean gap between a sequence's
    tokens (s): the inter-token latency a router measures."""
    rnd = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in range(n):
        t += rnd.expovariate(rate)
        arrivals.append(t)
    now, i, active, gaps = 0.0, 0, {}, []  # active: id -> [tokens left, time of its last token]
    while i < n or active:
        if not active:
            now = max(now, arrivals[i])
        while i < n and arrivals[i] <= now:
            active[i] = [output_len - 1, None]
            i += 1
        now += cost[0] + cost[1] * len(active)
        for k, seq in list(active.items()):
            if seq[1] is not None:
                gaps.append(now - seq[1])
            seq[0], seq[1] = seq[0] - 1, now
            if not seq[0]:
                del active[k]
    return statistics.mean(gaps)


@pytest.mark.parametrize("rate", [0.8, 2.0, 4.0])
def test_the_decode_forecast_is_what_a_batching_engine_measures(rate):
    """The forecast TPOT of the split serving now against a simulated engine with the same step
    cost and traffic: within 5 %, from light load to 70 % of the rank's capacity. The cost is
    tiny-moe's CPU decode fit that showed the fault: the batch without the sequence itself forecast
    3.1 ms at 0.79 req/s where the run measured 5.3 ms (this simulation: 4.7 ms)."""
    cost = (0.00264, 0.0014)
    m = measured(Traffic(rate=rate, input_len=1024, output_len=128), replicas=(1, 1), decode_cost=cost)
    forecast = plan(m).current.decode.predicted_ms
    simulated = 1000 * simulate_decode(cost, rate, 128, n=1500)
    assert forecast == pytest.approx(simulated, rel=0.05), (forecast, simulated)


def test_rates_are_printed_to_three_significant_digits():
    m = measured(Traffic(rate=1.08422, input_len=500, output_len=50, requests=65, finished=60))
    text = render(plan(m), m)
    assert "for 1.08 req/s within the SLO" in text and "1.084" not in text
    m.traffic.rate = 123.456
    assert "for 123 req/s within the SLO" in render(plan(m, budget=64), m)


def test_needed_replicas_grow_with_the_rate():
    low = plan(measured(Traffic(rate=1, input_len=2000, output_len=200)))
    high = plan(measured(Traffic(rate=40, input_len=2000, output_len=200)))
    assert low.needed == (1, 1)
    assert high.needed[0] > low.needed[0] and high.needed[1] >= low.needed[1]
    unreachable = measured(Traffic(rate=1, input_len=2000, output_len=200))
    unreachable.slo = {"ttft_ms": 1, "tpot_ms": 100}  # a 2k prefill alone takes 405 ms
    p = plan(unreachable)
    assert p.needed[0] == 0 and "no number of prefill replicas meets the SLO" in render(p, unreachable)


def test_kv_transfer_time_counts_against_the_ttft():
    t = Traffic(rate=2, input_len=1000, output_len=50)
    slow = plan(measured(t, kv_s=0.5)).best
    fast = plan(measured(t, kv_s=0.0)).best
    assert slow.prefill.max_rate < fast.prefill.max_rate
    assert slow.prefill.predicted_ms == pytest.approx(fast.prefill.predicted_ms + 500, rel=0.01)


def test_expert_parallel_decode_takes_ep_units():
    p = plan(measured(Traffic(rate=5, input_len=100, output_len=500), replicas=(2, 1), budget=6, ep=2))
    assert [s.counts for s in p.splits] == [(1, 2), (2, 2), (3, 1), (4, 1)]
    assert all(s.prefill.replicas + 2 * s.decode.replicas <= 6 for s in p.splits)
    assert p.current.counts == (2, 1)


def test_a_tie_stays_where_the_cluster_is():
    # A TTFT target no prefill can meet: every split sustains 0 req/s within the SLO, so none is
    # better than another, and the planner does not move the cluster for nothing.
    m = measured(Traffic(rate=1, input_len=2000, output_len=20), budget=4)
    m.slo = {"ttft_ms": 1, "tpot_ms": 100}
    for now in ((1, 3), (2, 2), (3, 1)):
        m.replicas = dict(zip(("prefill", "decode"), now))
        p = plan(m)
        assert {s.max_rate for s in p.splits} == {0.0}
        assert p.best.counts == now and not p.change


def test_what_the_planner_cannot_answer_says_what_to_do():
    t = Traffic(rate=1, input_len=100, output_len=10)
    m = measured(t)
    m.steps = {"prefill": m.steps["prefill"], "decode": {}}
    with pytest.raises(PlannerError, match="no decode steps measured yet: send traffic"):
        plan(m)
    with pytest.raises(PlannerError, match="no requests arrived"):
        plan(measured(Traffic(rate=0, input_len=0, output_len=0)))
    colocated = measured(t)
    colocated.replicas = {"colocated": 2}
    with pytest.raises(PlannerError, match="colocated"):
        plan(colocated)
    with pytest.raises(PlannerError, match="cannot hold 1 prefill and 1 decode"):
        plan(measured(t, budget=2, ep=2))


# -- acting on it ---------------------------------------------------------------------------------


def test_hysteresis_confirms_cools_down_and_ignores_small_gains():
    shift = plan(measured(Traffic(rate=20, input_len=4096, output_len=8), replicas=(1, 5), budget=6))
    assert shift.change and shift.gain > 1.5
    h = Hysteresis(confirm=2, cooldown_s=60, margin=0.15)
    assert h.decide(0, shift)[0] is None  # once: not yet
    move, why = h.decide(1, shift)
    assert move == shift.best.counts and "moving to" in why
    again = plan(measured(Traffic(rate=20, input_len=4096, output_len=8), replicas=(1, 5), budget=6))
    h.decide(10, again)
    move, why = h.decide(11, again)
    assert move is None and "cooling down" in why  # 11 s after the last change, 60 s needed
    assert h.decide(70, again)[0] == again.best.counts
    # A better split, but by less than the margin, is left alone.
    near = plan(measured(Traffic(rate=20, input_len=4096, output_len=8), replicas=(1, 5), budget=6))
    near.current = dataclasses.replace(near.best, prefill=dataclasses.replace(
        near.best.prefill, replicas=near.best.prefill.replicas - 1, max_rate=near.best.max_rate / 1.1))
    assert near.change and near.gain == pytest.approx(1.1)
    move, why = Hysteresis(confirm=1, cooldown_s=0).decide(0, near)
    assert move is None and "only 10 % more (margin 15 %)" in why


def test_scale_steps_grow_first_unless_the_gpus_are_taken():
    assert scale_steps((1, 2), (2, 1), 0, 1, on_gpus=False) == [{"prefill": 2, "decode": 1}]
    assert scale_steps((1, 2), (2, 1), 1, 1, on_gpus=True) == [{"prefill": 2, "decode": 1}]
    assert scale_steps((1, 2), (2, 1), 0, 1, on_gpus=True) == [{"prefill": 1, "decode": 1},
                                                              {"prefill": 2, "decode": 1}]
    assert scale_steps((3, 1), (1, 2), 0, 2, on_gpus=True) == [{"prefill": 1, "decode": 1},
                                                              {"prefill": 1, "decode": 2}]


# -- the profile file and the offline answer -------------------------------------------------------


def test_profile_round_trips_and_bad_files_are_named(tmp_path):
    m = measured(Traffic(rate=3, input_len=500, output_len=50))
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(m.to_json()))
    back = Measured.load(str(path))
    assert back == m
    (tmp_path / "other.json").write_text(json.dumps({"runs": []}))
    with pytest.raises(PlannerError, match="not a pdserve profile .*pdserve tune --record"):
        Measured.load(str(tmp_path / "other.json"))
    with pytest.raises(PlannerError, match="no such file"):
        Measured.load(str(tmp_path / "missing.json"))


def test_offline_tune_answers_from_a_profile(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(measured(Traffic(rate=3, input_len=500, output_len=50)).to_json()))

    def tune(*args):
        return subprocess.run([sys.executable, "-m", "pdserve.cli", "tune", "--offline", *args],
                              capture_output=True, text=True, timeout=60)

    long_prompts = tune("--profile", str(path), "--rate", "20", "--input-len", "4096", "--output-len", "8",
                        "--budget", "6")
    assert long_prompts.returncode == 0, long_prompts.stderr
    out = long_prompts.stdout
    assert "budget: 6 workers (--budget)" in out and "<- recommended" in out
    recommended = out.split("recommended: ", 1)[1].split(" prefill", 1)[0]
    long_outputs = tune("--profile", str(path), "--rate", "20", "--input-len", "64", "--output-len", "512",
                        "--budget", "6")
    assert int(long_outputs.stdout.split("recommended: ", 1)[1].split(" prefill", 1)[0]) < int(recommended)
    # Two profiles recorded at different EP sizes: the one that sustains more is named.
    ep2 = measured(Traffic(rate=3, input_len=500, output_len=50), ep=2)
    ep2.steps["decode"] = steps_of((DECODE_COST[0] / 4, DECODE_COST[1] / 4), [1, 8, 32, 128])  # 4x faster ranks
    (tmp_path / "ep2.json").write_text(json.dumps(ep2.to_json()))
    both = tune("--profile", str(path), str(tmp_path / "ep2.json"), "--rate", "20", "--input-len", "64",
                "--output-len", "512", "--budget", "6")
    assert both.returncode == 0, both.stderr
    assert f"decode.ep_size 2 ({tmp_path / 'ep2.json'})" in both.stdout
    assert both.stdout.split("decode.ep_size 2", 1)[1].splitlines()[0].endswith("<- recommended")
    missing = tune("--profile", str(path), "--rate", "2")
    assert missing.returncode == 2 and "--offline needs --input-len, --output-len" in missing.stderr
    bad = tune("--profile", str(path), "--rate", "-1", "--input-len", "5", "--output-len", "5")
    assert bad.returncode == 2 and "--rate: -1; it must be above 0" in bad.stderr


# -- the controller's window over heartbeats --------------------------------------------------------


def stats(name: str, role: str, profile: StepProfile, blocks: int = 100) -> list[ReplicaStats]:
    return [ReplicaStats(name, role, 0, 0, blocks, blocks, 0, profile=profile.snapshot())]


def traffic(arrived: int, prompt: int, finished: int, generated: int) -> dict:
    return {"traffic": {"prompt_count": arrived, "prompt_sum": prompt, "generation_count": finished,
                        "generation_sum": generated, "ttft": {0.1: finished, math.inf: finished},
                        "itl": {0.01: generated, math.inf: generated}}, "pid": 1}


def test_load_window_differences_heartbeats():
    w = LoadWindow(keep_s=600)
    pre, dec = StepProfile(), StepProfile()
    pre.record(100, 0, 0.02)  # before the window: counted in the step costs (kept), not the traffic
    w.add(0.0, {"p": stats("p@0", "prefill", pre), "d": stats("d@0", "decode", dec, 64)},
          {"r": traffic(10, 1000, 10, 100)})
    for t in range(1, 11):
        pre.record(512, 0, 0.1)
        dec.record(0, 8, 0.01)
        w.add(float(t), {"p": stats("p@0", "prefill", pre), "d": stats("d@0", "decode", dec, 64)},
              {"r": traffic(10 + 2 * t, 1000 + 2 * t * 500, 10 + 2 * t, 100 + 2 * t * 20)})
    m = w.measured(5.0, Limits(), {"ttft_ms": 1000, "tpot_ms": 100}, {"prefill": 1, "decode": 1}, "cpu")
    assert m.window_s == 5.0
    assert m.traffic.rate == pytest.approx(2.0) and m.traffic.input_len == pytest.approx(500)
    assert m.traffic.output_len == pytest.approx(20)
    assert m.traffic.ttft_p90 is not None and m.traffic.ttft_p90 <= 100
    assert m.steps["prefill"] == {512: [10, 5120, pytest.approx(1.0)]}  # differenced over all kept
    assert m.steps["decode"] == {8: [10, 80, pytest.approx(0.1)]}
    assert w.decode_kv_blocks() == 64
    # A router that restarted counts from zero: its counts since are taken whole.
    w.add(11.0, {}, {"r": traffic(3, 1500, 3, 60)})
    m = w.measured(1.5, Limits(), {"ttft_ms": 1000, "tpot_ms": 100}, {}, "cpu")
    assert (m.traffic.requests, m.traffic.input_len, m.traffic.rate) == (3, 500, 3.0)


def test_watch_plans_only_on_a_window_whose_outputs_are_known():
    from pdserve.control.tune import too_little

    w = LoadWindow(keep_s=600)
    w.add(0.0, {}, {"r": traffic(0, 0, 0, 0)})
    w.add(10.0, {}, {"r": traffic(16, 256, 0, 0)})  # 16 arrived, none finished: output length unknown
    m = w.measured(10.0, Limits(), {"ttft_ms": 1000, "tpot_ms": 100}, {}, "cpu")
    assert m.traffic.output_len == 0 and "outputs are unknown" in too_little(m.traffic, m.window_s, 8)
    assert "waiting for 32" in too_little(m.traffic, m.window_s, 32)
    w.add(12.0, {}, {"r": traffic(18, 288, 4, 256)})
    m = w.measured(12.0, Limits(), {"ttft_ms": 1000, "tpot_ms": 100}, {}, "cpu")
    assert m.traffic.output_len == 64 and too_little(m.traffic, m.window_s, 8) is None


# -- the engine's own counts ------------------------------------------------------------------------


def test_an_engine_counts_its_steps_by_size_and_its_prefix_hits():
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import Engine
    from pdserve.protocol import SamplingParams

    e = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), role="colocated", device="cpu", block_size=16))
    prompt = [3 + i % 200 for i in range(100)]
    for rid in ("a", "b"):  # b's prompt is a's: its full blocks come from the prefix cache
        e.add_request(rid, prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        while e.has_unfinished():
            e.step()
    snap = e.profile.snapshot()
    assert snap["prefill"][128][0] == 1  # a: 100 prompt tokens in one step
    assert sum(row[0] for row in snap["prefill"].values()) == 2
    assert snap["decode"][1][0] == 8  # 4 more tokens each, one sequence at a time
    assert snap["prefix_queries"] == 200 and snap["prefix_hits"] == 96  # 6 full blocks of b's 99 looked up
    assert snap["busy_s"] == pytest.approx(sum(row[2] for p in ("prefill", "decode") for row in snap[p].values()))
