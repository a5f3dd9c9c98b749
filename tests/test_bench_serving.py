"""`pdserve bench` and the P:D goodput driver as a user runs them: real `pdserve up` clusters on the
CPU, real HTTP. The pure parts (arrivals, percentiles, attainment, goodput) on hand-made records."""

import dataclasses
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import pytest
import yaml

from pdserve.benchmarks.load.records import RequestRecord, Slo, Stats, goodput, summarize
from pdserve.benchmarks.load.sweep import poisson_gaps
from serving_cluster import Cluster

NO_SLO = ["--slo-ttft-ms", "600000", "--slo-tpot-ms", "600000"]  # every request meets these


def run(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=os.environ | env if env else None)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# -- the pure parts -----------------------------------------------------------------------------------


def test_poisson_gaps_average_one_over_the_rate():
    gaps = poisson_gaps(4.0, 20000, random.Random(0))
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: stdev = mean
    assert gaps[:50] == poisson_gaps(4.0, 50, random.Random(0))  # seeded: the same arrivals again
    assert poisson_gaps(math.inf, 3, random.Random(0)) == [0.0, 0.0, 0.0]


def test_percentiles_interpolate_between_ranks():
    values = [float(x) for x in range(1, 101)]
    random.Random(0).shuffle(values)
    assert Stats.of(values) == Stats(mean=50.5, p50=50.5, p90=90.1, p99=99.01)
    assert Stats.of([7.0]) == Stats(7.0, 7.0, 7.0, 7.0)
    assert Stats.of([]) == Stats(None, None, None, None)


def record(ttft_ms: float | None, e2e_ms: float | None, tokens: int = 11, error: str | None = None) -> RequestRecord:
    return RequestRecord(0, 32, start_s=0.0, ttft_ms=ttft_ms, e2e_ms=e2e_ms, output_tokens=tokens, error=error)


def test_attainment_counts_every_request_sent():
    slo = Slo(ttft_ms=100, tpot_ms=10, attainment=0.75)
    records = [record(50, 150),  # TPOT (150 - 50) / 10 = 10: meets both
               record(90, 90, tokens=1),  # one token: no TPOT, TTFT meets
               record(150, 200),  # TTFT misses
               record(50, 300),  # TPOT 25 misses
               record(None, None, error="HTTP 503: full")]
    s = summarize(2.0, records, duration_s=4.0, slo=slo)
    assert (s.sent, s.completed, s.failed) == (5, 4, 1)
    assert s.slo_attainment == 0.4 and s.good_rps == 0.5
    assert s.errors == {"HTTP 503: full": 1}
    assert s.tpot_ms.p50 == 10 and s.ttft_ms.mean == 85  # the failed request is in neither
    assert s.request_throughput == 1.0 and s.output_throughput == 34 / 4


def test_goodput_is_the_highest_rate_that_meets_the_attainment():
    slo = Slo(attainment=0.9)
    base = summarize(1.0, [record(10, 20)], 1.0, slo)

    def at(rate: float, attainment: float):
        return dataclasses.replace(base, rate=rate, slo_attainment=attainment)

    assert goodput([at(1, 1.0), at(2, 0.95), at(4, 0.5), at(8, 0.9)], slo) == 8  # the highest, not the first
    assert goodput([at(1, 0.89), at(2, 0.2)], slo) is None
    assert goodput([at(4, 1.0), at(math.inf, 0.9)], slo) == math.inf


def test_the_commands_import_no_torch():
    code = ("import sys; import pdserve.cli, pdserve.benchmarks.load.command, pdserve.benchmarks.pd_goodput; "
            "pdserve.cli.build_parser(); assert 'torch' not in sys.modules, 'torch was imported'")
    r = run("-c", code)
    assert r.returncode == 0, r.stderr


def test_a_server_that_is_not_there_is_a_clear_error():
    with socket.socket() as s:  # bound and not listening: nothing answers there, and no test can take it
        s.bind(("127.0.0.1", 0))
        r = run("-m", "pdserve.cli", "bench", "--url", f"http://127.0.0.1:{s.getsockname()[1]}",
                "--num-prompts", "1")
    assert r.returncode == 2
    assert "cannot reach" in r.stderr and "pdserve up" in r.stderr and "Traceback" not in r.stderr


# -- the P:D driver: its own cluster, before the shared one exists (one Ray at a time) ------------------


def test_pd_goodput_measures_each_config_and_stops_its_cluster(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump({"router": {"host": "127.0.0.1", "http_port": 0, "grpc_port": None},
                                      "prefill": {"num_kv_blocks": 512}, "decode": {"num_kv_blocks": 512}}))
    out = tmp_path / "out.json"
    r = run("-m", "pdserve.benchmarks.pd_goodput", str(config), "--rates", "2", "--num-prompts", "4",
            "--input-len", "16", "--output-len", "4", *NO_SLO, "--log-dir", str(tmp_path), "--json", str(out),
            "--start-timeout", "240", "--plot", str(tmp_path / "charts"), timeout=420)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [c] = json.loads(out.read_text())["configs"]
    assert c["name"] == "tiny" and c["error"] is None and c["goodput"] == 2.0
    [rate] = c["runs"]
    assert rate["rate"] == 2.0 and rate["completed"] == 4 and rate["slo_attainment"] == 1.0
    assert c["exit_code"] == 0 and c["stopped"] == "interrupted" and c["port_closed"]
    assert not port_open(int(c["url"].rsplit(":", 1)[1]))
    assert "ready" in (tmp_path / "pdserve-up.tiny.log").read_text()
    assert "tiny" in r.stdout  # the table
    assert sorted(p.name for p in (tmp_path / "charts").iterdir()) == ["goodput.png", "tpot.png", "ttft.png"]


# -- `pdserve bench` against one shared cluster -------------------------------------------------------


# The shared cluster's slo:, neither cluster.yaml's default nor pd_goodput's: `pdserve bench` takes it.
CLUSTER_SLO = {"ttft_ms": 1500, "tpot_ms": 75}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Every prompt remote: the bench reports each phase of the disaggregated path, the decode
    # replica's reservation included (a local prefill reserves nothing).
    # Its processes trace each request's hops (pdserve/hop_trace.py): test_hop_trace_* read them.
    trace = tmp_path_factory.mktemp("hops")
    c = Cluster(tmp_path_factory.mktemp("bench"), env={"PDSERVE_HOP_TRACE": str(trace)}, slo=CLUSTER_SLO,
                router={"prefill_site": "remote"})
    c.hop_dir = trace
    try:
        c.wait_ready()
        yield c
    finally:
        assert c.stop() == 0, c.output()


def bench(cluster: Cluster, tmp_path, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "out.json"
    own = list(cluster.router_urls().values())  # several routers: each one's phases, added up
    r = run("-m", "pdserve.cli", "bench", "--url", cluster.url, "--num-prompts", "6", "--input-len", "32",
            "--output-len", "8", "--json", str(out), "--save-requests", *(["--metrics-url", *own] if own else []),
            *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(out.read_text()), r


def test_bench_measures_every_request_at_each_rate(cluster, tmp_path):
    res, r = bench(cluster, tmp_path, "--rate", "4", "inf", *NO_SLO)
    assert res["model"] == "tiny-moe" and [x["rate"] for x in res["runs"]] == [4.0, "inf"]
    for x in res["runs"]:
        assert x["sent"] == x["completed"] == 6 and x["failed"] == 0 and x["errors"] == {}
        for req in x["requests"]:
            assert req["ok"] and req["output_tokens"] == 8  # ignore_eos: exactly --output-len
            assert 0 < req["ttft_ms"] <= req["e2e_ms"] and req["tpot_ms"] >= 0
            assert len(req["itl_ms"]) == req["chunks"] - 1
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = x[key]
            assert s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert x["slo_attainment"] == 1.0 and x["good_rps"] == x["request_throughput"] > 0
        assert x["output_throughput"] == pytest.approx(8 * x["request_throughput"], rel=0.01)
        # The router's split of the same requests' TTFT (its /metrics before and after the run).
        phases = x["server_ms"]
        assert {"admit", "reserve", "dispatch", "first_token"} <= phases.keys(), phases
        assert 0 < phases["admit"] + phases["reserve"] + phases["dispatch"] + phases["first_token"] < x["ttft_ms"]["mean"]
        assert phases["dispatch"] <= phases["dispatch p99<="] * 1.0001, phases  # a mean is below the p99's bound
        assert 0 < x["client_cpu"] < 1.5, x["client_cpu"]  # the client's own share of a core (one thread, mostly)
        # The router's process_cpu_seconds_total over the run: counted in 10 ms ticks, so a burst of six
        # short requests may read 0; the 1.5 s of the Poisson run cannot.
        assert x["router_cpu_s"] is not None and x["router_cpu_s"] >= (x["rate"] != "inf") * 0.01, x
    starts = [req["start_s"] for req in res["runs"][0]["requests"]]
    assert starts == sorted(starts) and starts[-1] > 0.1  # Poisson arrivals, spread over about 1.5 s
    assert res["goodput"] == "inf"  # every rate passed: the highest one
    assert "goodput: inf" in r.stdout and "[bench] rate 4 req/s" in r.stderr


def test_several_client_processes_send_one_run(cluster, tmp_path):
    """--clients 3: the requests dealt over three processes, each keeping its share of the cap; the
    parent's records are every request's, ordered as sent, and measured as one run."""
    res, r = bench(cluster, tmp_path, "--rate", "inf", "--max-concurrency", "3", "--clients", "3", *NO_SLO)
    [x] = res["runs"]
    assert x["sent"] == x["completed"] == 6 and x["failed"] == 0, x["errors"]
    assert [req["index"] for req in x["requests"]] == list(range(6))
    assert all(req["ok"] and req["output_tokens"] == 8 and req["start_s"] >= 0 for req in x["requests"])
    assert x["output_throughput"] == pytest.approx(8 * x["request_throughput"], rel=0.01)
    assert 0 < x["client_cpu"] < 1.5 and res["workload"]["clients"] == 3
    assert "from 3 client processes" in r.stderr
    bad = run("-m", "pdserve.cli", "bench", "--url", cluster.url, "--clients", "4", "--max-concurrency", "2")
    assert bad.returncode == 2 and "--max-concurrency 2 is below --clients 4" in bad.stderr, bad.stderr


def test_multi_turn_sessions_wait_on_their_own_answers(cluster, tmp_path):
    """--workload multi-turn: each session's turns go one after another (a turn starts after the one
    before it ended), carry the session as `user`, and grow by the history; two client processes
    each send whole sessions."""
    res, r = bench(cluster, tmp_path, "--rate", "inf", "--workload", "multi-turn", "--turns", "3",
                   "--prefix-len", "16", "--input-len", "8", "--think-time", "0.05", "--clients", "2", *NO_SLO)
    [x] = res["runs"]
    assert x["sent"] == x["completed"] == 6 and x["failed"] == 0, x["errors"]
    reqs = x["requests"]
    # Two sessions of three turns: 16 + 8, then + 8 (answer) + 8, then + 16 again.
    assert [q["prompt_tokens"] for q in reqs] == [24, 40, 56] * 2
    for s in (reqs[:3], reqs[3:]):
        for before, after in zip(s, s[1:]):
            assert after["start_s"] >= before["start_s"] + before["e2e_ms"] / 1e3 + 0.05 - 0.01
    assert res["workload"]["kind"] == "multi-turn" and res["workload"]["turns"] == 3


def test_shared_prefix_prompts_share_their_prefixes():
    import random as rnd

    from pdserve.benchmarks.load.workloads import plan

    p = plan("shared-prefix", 40, 4.0, rnd.Random(1), 8, 4, prefix_len=16, prefixes=3)
    assert len({tuple(q[:16]) for q in p.prompts}) == 3 and all(len(q) == 24 for q in p.prompts)
    assert len({tuple(q[16:]) for q in p.prompts}) == 40  # each its own part
    again = plan("shared-prefix", 40, 4.0, rnd.Random(1), 8, 4, prefix_len=16, prefixes=3)
    assert again.prompts == p.prompts and again.dues == p.dues  # seeded


def test_an_impossible_slo_is_met_by_no_request(cluster, tmp_path):
    res, r = bench(cluster, tmp_path, "--rate", "4", "--slo-ttft-ms", "0.001")
    [x] = res["runs"]
    assert x["completed"] == 6 and x["slo_attainment"] == 0.0 and x["good_rps"] == 0.0
    assert res["goodput"] is None and "none of these rates" in r.stdout


def test_the_default_slo_is_the_clusters(cluster, tmp_path):
    """What `pdserve status --watch` and /dashboard judge by: the same traffic is not "ok" there and
    a miss in bench. One target given, the other is still the cluster's."""
    res, r = bench(cluster, tmp_path, "--rate", "inf")
    assert res["slo"]["ttft_ms"] == 1500 and res["slo"]["tpot_ms"] == 75, res["slo"]
    assert "SLO TTFT <= 1500 ms, TPOT <= 75 ms: the cluster's slo:" in r.stderr
    res, r = bench(cluster, tmp_path, "--rate", "inf", "--slo-tpot-ms", "30")
    assert res["slo"]["ttft_ms"] == 1500 and res["slo"]["tpot_ms"] == 30


def test_bad_requests_say_what_to_do(cluster):
    r = run("-m", "pdserve.cli", "bench", "--url", cluster.url, "--model", "nope", "--num-prompts", "1")
    assert r.returncode == 2 and "it serves tiny-moe" in r.stderr
    r = run("-m", "pdserve.cli", "bench", "--url", cluster.url, "--input-len", "4096", "--num-prompts", "1")
    assert r.returncode == 2 and "exceed the context" in r.stderr and "Traceback" not in r.stderr


def test_the_p99_of_a_phase_is_the_bound_of_the_bucket_holding_it():
    from pdserve.benchmarks.load.server_metrics import means_ms, parse
    from pdserve.router.metrics import Metrics

    m, other = Metrics("pdserve-router-0"), Metrics("pdserve-router-1")
    before = parse(m.render().decode())
    for _ in range(99):
        m.observe_phase("dispatch", 0.0008)  # the 1 ms bucket
    m.observe_phase("dispatch", 0.04)  # the 50 ms bucket: the 100th of 100 is above the p99
    out = means_ms(before, parse(m.render().decode()))
    assert out["dispatch p99<="] == 1.0 and out["dispatch"] == pytest.approx((99 * 0.8 + 40) / 100, abs=0.01)
    assert means_ms(parse(m.render().decode()), before) == {}  # counts went down: not the same router
    for _ in range(200):
        other.observe_phase("dispatch", 0.001)
    assert means_ms(before, parse(other.render().decode())) == {}  # another router answered the second scrape
    # The loop's longest pause over the run: the bucket of its last sample, past the p99's.
    for lag in [0.0001] * 100 + [0.004] + [0.0001] * 99:
        m.loop_lag.observe(lag)
    out = means_ms(before, parse(m.render().decode()))
    assert out["loop_lag max<="] == 5.0 and out["loop_lag p99<="] == 0.25


def test_the_routers_cpu_over_a_run_is_read_off_their_process_counter():
    from pdserve.benchmarks.load.server_metrics import parse, router_cpu_s
    from pdserve.router.metrics import Metrics

    m, other = Metrics("pdserve-router-0"), Metrics("pdserve-router-1")  # (this process's CPU, both)
    before = parse(m.render().decode())
    t0 = time.process_time()
    while time.process_time() - t0 < 0.1:  # 0.1 s of CPU: /proc counts in ticks of 10 ms
        pass
    spent = router_cpu_s(before, parse(m.render().decode()))
    assert spent == pytest.approx(0.1, abs=0.03)
    assert router_cpu_s(before, parse(other.render().decode())) is None  # another router answered
    assert router_cpu_s(before, None) is None


def test_hop_trace_splits_a_lone_requests_ttft_by_process(cluster, tmp_path):
    """PDSERVE_HOP_TRACE on the cluster and the bench: every process's hops of requests sent one at a
    time line up, in the order a disaggregated request crosses them, within the client's TTFT."""
    r = run("-m", "pdserve.cli", "bench", "--url", cluster.url, "--rate", "4", "--max-concurrency", "1",
            "--num-prompts", "4", "--input-len", "32", "--output-len", "2", "--warmup", "0", *NO_SLO,
            env={"PDSERVE_HOP_TRACE": str(cluster.hop_dir)})
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "hops.json"
    r = run("-m", "pdserve.benchmarks.hop_trace", str(cluster.hop_dir), "--last", "4", "--json", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    at = {row["hop"]: row["after_send_ms"] for row in res["rows"]}
    # Client -> router -> decode worker (reserve) and prefill worker -> engine steps -> deltas -> client.
    order = ["send", "door", "validated", "began", "admitted", "out_reserve", "out_prefill", "deltas_out",
             "deltas_in", "first_delta", "first_event"]
    assert res["requests"] == 4 and all(row["requests"] == 4 for row in res["rows"] if row["hop"] in order), res
    assert [h for h in at if h in order] == order, at
    assert {"frame_in", "inbox", "taken", "step", "stepped", "answer_in"} <= at.keys(), at
    assert "first_event" in r.stdout and "after previous ms" in r.stdout


def test_hop_trace_leaves_out_requests_sent_while_another_streams():
    from pdserve.benchmarks.hop_trace import segments, table
    ms = 1_000_000
    marks = [(0, "send"), (1 * ms, "door"), (5 * ms, "first_event"), (6 * ms, "done"),  # alone
             (10 * ms, "send"), (12 * ms, "first_event"), (13 * ms, "send"),  # sent while the one before streams
             (14 * ms, "door"), (15 * ms, "done"), (16 * ms, "first_event"), (17 * ms, "done"),
             (20 * ms, "send"), (21 * ms, "door"), (23 * ms, "first_event"), (24 * ms, "done")]  # alone
    segs, left_out = segments(marks)
    assert segs == [{"send": 0.0, "door": 1.0, "first_event": 5.0}, {"send": 0.0, "first_event": 2.0},
                    {"send": 0.0, "door": 1.0, "first_event": 3.0}]
    assert left_out == 1
    assert [(r["hop"], r["requests"], r["after_send_ms"], r["after_previous_ms"]) for r in table(segs)] == [
        ("send", 3, 0.0, None), ("door", 2, 1.0, 1.0), ("first_event", 3, 3.0, 3.0)]


def test_hop_trace_says_what_to_do_without_a_trace(tmp_path):
    r = run("-m", "pdserve.benchmarks.hop_trace", str(tmp_path))
    assert r.returncode != 0 and "PDSERVE_HOP_TRACE" in r.stderr
