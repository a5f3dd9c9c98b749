"""The router's choice of where a disaggregated attempt's prompt is computed (router/prefill_site.py),
against forecasts built from fitted step costs as the router fits them: which requests go local
(short prompts, cached prefixes, a backed-up prefill pool), which remote (long prompts while the
prefill pool keeps up, and whenever the forecasts cannot be made yet). Ray-free."""

from pdserve.messages import ReplicaStats
from pdserve.router.forecast import TTFTForecast
from pdserve.router.prefill_site import LOCAL, REMOTE, LocalCosts, PrefillSite, SiteForecast, forecast_sites
from pdserve.router.replica_set import ReplicaSet
from pdserve.step_cost import StepCost

# An H200-like replica of a 30B MoE: a prompt token 16 us beside a 4 ms step, a decode step
# 12 ms + 0.1 ms a sequence; a 4k prompt's KV moves in 2 ms.
PREFILL = StepCost(0.004, 16e-6, 100, 8192)
DECODE = StepCost(0.012, 1e-4, 100, 128)
SITE = PrefillSite(tpot_target_s=0.030, floor=16)  # slo.tpot_ms 30


def cluster(decoders: int, prefill_queue: int = 0, local_queue: int = 0) -> tuple[TTFTForecast, ReplicaSet]:
    fc = TTFTForecast(prefill_step_tokens=8192)
    fc.prefill_cost["p0"] = PREFILL
    fc.transfer_s["p0"] = 0.002
    fc.decode_cost["d0"] = DECODE
    rs = ReplicaSet("router")
    rs.prefill = {"p0": None}
    rs.stats["d0"] = ReplicaStats("d0", "decode", decoders, 0, 1000, 1000, 0)
    rs.prompt_tokens = {"p0": prefill_queue, "d0": local_queue}
    return fc, rs


def choose(tokens: int, decoders: int, prefill_queue: int = 0, local_queue: int = 0,
           cached: int = 0, site: PrefillSite = SITE) -> tuple[str, str]:
    fc, rs = cluster(decoders, prefill_queue, local_queue)
    return site.choose(tokens, True, lambda: forecast_sites(site, fc, rs, ["p0"], ["d0"], tokens,
                                                            lambda names: {"d0": cached}))


def test_short_prompts_go_local_long_ones_remote_beside_many_decoders():
    # 150 decoders: 27 ms a step, so the guard leaves a 30 ms target room for a block at a time:
    # a 4k prompt would take 256 steps locally, on the prefill replica 70 ms.
    assert choose(16, decoders=150) == (LOCAL, "sooner")
    assert choose(4096, decoders=150) == (REMOTE, "sooner")
    # With few decoders the guard leaves room for ~1,000 tokens a step: 4k in 4-5 steps, still slower
    # than the prefill replica plus the KV's move; 512 tokens in one step, quicker.
    assert choose(512, decoders=8) == (LOCAL, "sooner")
    assert choose(4096, decoders=8) == (REMOTE, "sooner")


def test_a_backed_up_prefill_pool_sends_prompts_local():
    # 60k tokens queued at the prefill replica (~1 s): a 4k prompt is sooner beside 8 decoders.
    assert choose(4096, decoders=8, prefill_queue=60_000) == (LOCAL, "sooner")
    # ... but not once the decode replica's own local queue is as long.
    assert choose(4096, decoders=8, prefill_queue=60_000, local_queue=60_000) == (REMOTE, "sooner")


def test_a_cached_prefix_sends_the_prompt_local():
    assert choose(4096, decoders=150) == (REMOTE, "sooner")
    assert choose(4096, decoders=150, cached=4080) == (LOCAL, "sooner")  # 16 tokens left to compute


def test_without_forecasts_or_in_remote_mode_prompts_go_remote():
    fc, rs = cluster(decoders=8)
    fc.decode_cost.clear()  # the decode replica has measured no step yet
    f = forecast_sites(SITE, fc, rs, ["p0"], ["d0"], 512, lambda names: {})
    assert f.local_s is None and f.remote_s is not None
    assert SITE.choose(512, True, lambda: f) == (REMOTE, "long")
    assert choose(16, decoders=150, site=PrefillSite(mode="remote")) == (REMOTE, "long")
    # The rules before the forecast: none asked for where they decide.
    asked = []
    assert SITE.choose(99_999, False, lambda: asked.append(1)) == (LOCAL, "no_prefill")
    assert PrefillSite(local_tokens=64).choose(64, True, lambda: asked.append(1)) == (LOCAL, "short")
    assert not asked


def test_the_local_forecast_uses_the_guards_budget():
    c = LocalCosts(DECODE, 16e-6, decoders=150, queued_tokens=0)
    # 27 ms of decoders leave less than a block of a 30 ms target: 16 tokens (the floor) a step.
    assert SITE.local_s(4096, c) == 256 * DECODE.time(150) + 4096 * 16e-6
    unguarded = PrefillSite(tpot_target_s=None)  # slo.tpot_guard false: chunk_tokens a step
    assert unguarded.local_s(4096, c) == 2 * DECODE.time(150) + 4096 * 16e-6
    assert SiteForecast().local_replica is None
