"""The router's choice of where a disaggregated attempt's prompt is computed (router/prefill_site.py),
against forecasts built from fitted step costs as the router fits them: which requests go local
(short prompts, cached prefixes, a backed-up prefill pool), which remote (long prompts while the
prefill pool keeps up, and whenever the forecasts cannot be made yet). Ray-free."""


import pytest

from pdserve.messages import ReplicaStats
from pdserve.router.forecast import TTFTForecast
from pdserve.router.prefill_site import (COLOCATED, DISAGGREGATED, LOCAL, MIXED_OVERHEAD_PRIOR, REMOTE,
                                         LocalCosts, PathForecast, PrefillSite, SiteForecast, as_quick, forecast_paths,
                                         forecast_sites, per_replica)
from pdserve.router.replica_set import ReplicaSet
from pdserve.step_cost import STARVE_STEPS, MixedCost, StepCost

# An H200-like replica of a 30B MoE: a prompt token 16 us beside a 4 ms step, a decode step
# 12 ms + 0.1 ms a sequence, a mixed step 5 ms more and 25 us a prompt token; a 4k prompt's KV
# moves in 2 ms.
PREFILL = StepCost(0.004, 16e-6, 100, 8192)
DECODE = StepCost(0.012, 1e-4, 100, 128)
MIXED = MixedCost(DECODE, 0.005, 25e-6)
SITE = PrefillSite(mode="adaptive", tpot_target_s=0.030, floor=16)  # slo.tpot_ms 30


def cluster(decoders: int, prefill_queue: int = 0, local_queue: int = 0) -> tuple[TTFTForecast, ReplicaSet]:
    fc = TTFTForecast(prefill_step_tokens=8192)
    fc.prefill_cost["p0"] = PREFILL
    fc.transfer_s["p0"] = 0.002
    fc.decode_cost["d0"] = DECODE
    fc.mixed_cost["d0"] = MIXED
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


def test_short_prompts_go_local_long_ones_remote():
    # Beside 8 decoders (12.8 ms a step: 14.2 ms of slack under 0.9 x 30 ms), 32 tokens go in the
    # next mixed step (18.6 ms) against the prefill step, the KV's move and a decode step (19.3 ms);
    # 512 tokens wait a step for their mixed one (43 ms against 27 ms); 4k bank 6 steps for two
    # mixed ones of 2048 tokens (0.21 s against 84 ms).
    assert choose(32, decoders=8) == (LOCAL, "sooner")
    assert choose(512, decoders=8) == (REMOTE, "sooner")
    assert choose(4096, decoders=8) == (REMOTE, "sooner")
    # 150 decoders fill the target (27 ms a step): even 16 tokens wait for the guard's trickle.
    assert choose(16, decoders=150) == (REMOTE, "sooner")


def test_a_backed_up_prefill_pool_sends_prompts_local():
    # 60k tokens queued at the prefill replica (~1.03 s): a 4k prompt is 8 guarded steps, 0.21 s.
    assert choose(4096, decoders=8, prefill_queue=60_000) == (LOCAL, "sooner")
    # ... but not once the decode replica's own local queue is as long.
    assert choose(4096, decoders=8, prefill_queue=60_000, local_queue=60_000) == (REMOTE, "sooner")


def test_a_cached_prefix_sends_the_prompt_local():
    assert choose(4096, decoders=8) == (REMOTE, "sooner")
    assert choose(4096, decoders=8, cached=4080) == (LOCAL, "sooner")  # 16 tokens left to compute


def test_without_forecasts_or_in_remote_mode_prompts_go_remote():
    fc, rs = cluster(decoders=8)
    fc.decode_cost.clear()  # the decode replica has measured no step yet
    fc.mixed_cost.clear()
    f = forecast_sites(SITE, fc, rs, ["p0"], ["d0"], 512, lambda names: {})
    assert f.local_s is None and f.remote_s is not None
    assert SITE.choose(512, True, lambda: f) == (REMOTE, "long")
    assert choose(16, decoders=8, site=PrefillSite()) == (REMOTE, "long")  # (a PrefillSite built without a config: remote)
    # The rules before the forecast: none asked for where they decide.
    asked = []
    assert SITE.choose(99_999, False, lambda: asked.append(1)) == (LOCAL, "no_prefill")
    assert PrefillSite(local_tokens=64).choose(64, True, lambda: asked.append(1)) == (LOCAL, "short")
    assert not asked


def test_before_a_mixed_step_is_measured_the_prior_forecasts_it():
    fc, rs = cluster(decoders=8)
    fc.mixed_cost.clear()  # decode steps measured, no mixed one yet: 0.6 x the decode step more,
    f = forecast_sites(SITE, fc, rs, ["p0"], ["d0"], 32, lambda names: {})  # the prefill replica's per token
    prior = MixedCost(DECODE, MIXED_OVERHEAD_PRIOR * DECODE.time(8), PREFILL.per_unit)
    # Its 32 tokens and overhead (8.2 ms) cost less than a step's slack (14.2 ms): the next step mixes.
    assert f.local_s == pytest.approx(prior.time(8, 32))


def test_the_local_forecast_follows_the_guards_pace():
    # 150 decoders fill a 30 ms target: a least chunk (200 tokens, worth the 5 ms overhead) every
    # STARVE_STEPS steps.
    c = LocalCosts(MIXED, decoders=150, queued_tokens=0)
    assert SITE.local_s(4096, c) == pytest.approx(21 * (STARVE_STEPS * DECODE.time(150) + 0.005) + 4096 * 25e-6)
    # 8 decoders: chunks of chunk_tokens (2048), each once the bank pays for it (its 5 ms overhead
    # and 51.2 ms of tokens): 8 steps' slack (14.2 ms each) pay for both; 8 decoders' steps and the
    # mixing's 112.4 ms.
    c = LocalCosts(MIXED, decoders=8, queued_tokens=0)
    assert SITE.local_s(4096, c) == pytest.approx(8 * DECODE.time(8) + 2 * 0.005 + 4096 * 25e-6)
    # A queue ahead of it is paid for first.
    assert SITE.local_s(4096, LocalCosts(MIXED, 8, queued_tokens=4096)) > 2 * SITE.local_s(4096, c) - 0.01
    unguarded = PrefillSite(mode="adaptive", tpot_target_s=None)  # slo.tpot_guard off: chunk_tokens a step
    step = DECODE.time(8) + MIXED.overhead
    assert unguarded.local_s(4096, c) == pytest.approx(2 * step + 4096 * MIXED.per_token)
    assert SiteForecast().local_replica is None


def test_replicas_as_quick_as_the_quickest_are_the_routing_policys_to_order():
    """Forecasts within AS_QUICK of the quickest tie: the router orders those by its policy (a light
    load went all to the replica whose fit was a hair lower, whatever router.policy said); a replica
    clearly slower is left out, and one not forecast is not a candidate."""
    each = (("d0", 0.100), ("d1", 0.104), ("d2", 0.200))
    f = SiteForecast(0.3, 0.100, "d0", each)
    assert f.local_candidates(["d0", "d1", "d2"]) == ["d0", "d1"]
    assert f.local_candidates(["d1", "d2"]) == ["d1"]  # the quickest of those with room
    assert f.local_candidates(["d2", "d3"]) == ["d2"] and f.local_candidates(["d3"]) == []
    assert as_quick(each, ["d2", "d1", "d0"]) == ["d1", "d0"]  # in the order given
    # forecast_sites gives every local replica's forecast: equal replicas tie.
    fc, rs = cluster(decoders=8)
    fc.decode_cost["d1"], fc.mixed_cost["d1"] = fc.decode_cost["d0"], fc.mixed_cost["d0"]
    rs.stats["d1"] = ReplicaStats("d1", "decode", 8, 0, 1000, 1000, 0)
    sites = forecast_sites(SITE, fc, rs, ["p0"], ["d0", "d1"], 512, lambda names: {})
    assert [n for n, _ in sites.local_each] == ["d0", "d1"] and sites.local_candidates(["d0", "d1"]) == ["d0", "d1"]
    rs.prompt_tokens["d0"] = 8192  # a queue at d0: d1 alone is as quick
    sites = forecast_sites(SITE, fc, rs, ["p0"], ["d0", "d1"], 512, lambda names: {})
    assert sites.local_replica == "d1" and sites.local_candidates(["d0", "d1"]) == ["d1"]


def test_a_mixed_cluster_sends_each_attempt_down_the_path_whose_first_token_comes_sooner():
    """Colocated replica c0 (prompt steps as p0's, decode steps as d0's) beside p0 and d0: with both
    queues empty it is the sooner by the KV's move (no KV moves there); prompt tokens of ours queued
    at c0 send the next attempt down the disaggregated path, and those at p0 send it back."""
    fc, rs = cluster(decoders=8)
    fc.prefill_cost["c0"], fc.decode_cost["c0"] = PREFILL, DECODE
    rs.colocated = {"c0": None}
    rs.stats["c0"] = ReplicaStats("c0", "colocated", 8, 0, 1000, 1000, 0)

    def path(tokens: int, colocated_queue: int = 0, prefill_queue: int = 0) -> tuple[str, str]:
        rs.prompt_tokens |= {"c0": colocated_queue, "p0": prefill_queue}
        remote = forecast_sites(SITE, fc, rs, ["p0"], ["d0"], tokens, lambda names: {}).remote_s
        f = forecast_paths(fc, rs, ["c0"], tokens, {}, remote)
        assert f.colocated_replica == "c0"
        return SITE.choose_path(f, 0, 0)

    assert path(512) == (COLOCATED, "sooner")
    assert path(512, colocated_queue=4096) == (DISAGGREGATED, "sooner")
    assert path(512, colocated_queue=4096, prefill_queue=8192) == (COLOCATED, "sooner")
    # A cached prefix at the colocated replica counts only what it lacks.
    rs.prompt_tokens |= {"c0": 0, "p0": 0}
    cached = forecast_paths(fc, rs, ["c0"], 4096, {"c0": 4080}, None).colocated_s
    assert cached < forecast_paths(fc, rs, ["c0"], 4096, {}, None).colocated_s


def test_a_mixed_clusters_disaggregated_path_counts_its_local_site():
    """Where the prefill pool is backed up, the disaggregated path's first token is its decode
    replica's local prefill (the site the rule picks there), not the remote queue: a colocated
    replica with some queue of its own then loses the attempt to it. In remote mode, the remote
    forecast stands."""
    fc, rs = cluster(decoders=8, prefill_queue=64 * 1024)
    fc.prefill_cost["c0"], fc.decode_cost["c0"] = PREFILL, DECODE
    rs.colocated = {"c0": None}
    rs.stats["c0"] = ReplicaStats("c0", "colocated", 8, 0, 1000, 1000, 0)
    rs.prompt_tokens |= {"c0": 8192}
    sites = forecast_sites(SITE, fc, rs, ["p0"], ["d0"], 512, lambda names: {})
    assert sites.local_s < sites.remote_s
    assert SITE.path_s(512, True, sites) == sites.local_s
    assert SITE.choose_path(forecast_paths(fc, rs, ["c0"], 512, {}, SITE.path_s(512, True, sites)), 0, 0) == \
        (DISAGGREGATED, "sooner")
    remote = PrefillSite(mode="remote")
    assert remote.path_s(512, True, sites) == sites.remote_s
    assert remote.choose_path(forecast_paths(fc, rs, ["c0"], 512, {}, remote.path_s(512, True, sites)), 0, 0) == \
        (COLOCATED, "sooner")


def test_without_forecasts_a_mixed_cluster_balances_requests_in_flight():
    fc, rs = cluster(decoders=0)
    rs.colocated = {"c0": None}  # no step measured there yet: no colocated forecast
    f = forecast_paths(fc, rs, ["c0"], 512, {}, 0.02)
    assert f.colocated_s is None
    # Ours in flight per replica: a tie goes colocated (no KV moves), then to the emptier path.
    assert SITE.choose_path(f, 0, 0) == (COLOCATED, "balance")
    assert SITE.choose_path(f, 1, 0) == (DISAGGREGATED, "balance")
    rs.loads = {"c0": 2, "c1": 0, "d0": 1}
    assert per_replica(rs, ["c0", "c1"]) == 1 and per_replica(rs, ["d0"]) == 1
    assert SITE.choose_path(f, per_replica(rs, ["c0", "c1"]), per_replica(rs, ["d0"])) == (COLOCATED, "balance")
    assert SITE.choose_path(PathForecast(None, None, None), 3, 1) == (DISAGGREGATED, "balance")
