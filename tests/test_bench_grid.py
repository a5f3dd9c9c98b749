"""The goodput grid (pdserve/benchmarks/load/grid.py): goodput per SLO pair from each request's record,
the ratio of each configuration to the best of the others, bounds, the attainment's edge; and the table
printed by pd_goodput and again from its saved JSON. No cluster: sweeps are made of records."""

import json
import subprocess
import sys

import pytest
import yaml

from pdserve.benchmarks import pd_goodput
from pdserve.benchmarks.load import command, grid
from pdserve.benchmarks.load.client import Server
from pdserve.benchmarks.load.grid import AT_LEAST, BELOW, EXACT, Config, Goodput, goodput_at, ratio
from pdserve.benchmarks.load.records import RequestRecord, Slo, Workload, summarize
from pdserve.benchmarks.load.sweep import RateRun, Sweep


def rec(i: int, ttft: float, tpot: float, tokens: int = 8, error: str | None = None) -> RequestRecord:
    """A request whose TPOT, as records.py computes it from e2e, TTFT and the tokens, is `tpot`."""
    if error:
        return RequestRecord(i, 32, start_s=0.0, error=error)
    return RequestRecord(i, 32, start_s=0.0, ttft_ms=ttft, e2e_ms=ttft + tpot * (tokens - 1), output_tokens=tokens,
                         chunks=tokens)


def run_of(ttft: float, tpot: float, n: int = 20, slow: int = 0) -> list[RequestRecord]:
    """n requests at (ttft, tpot), the last `slow` of them 10x slower on both."""
    return [rec(i, ttft * (10 if i >= n - slow else 1), tpot * (10 if i >= n - slow else 1)) for i in range(n)]


# Latencies that grow with the rate: a loose SLO is met further than a tight one.
FAST = {1.0: run_of(200, 10), 2.0: run_of(400, 18), 4.0: run_of(900, 28), 8.0: run_of(2500, 60)}


def test_goodput_per_pair_is_the_highest_rate_meeting_both_bounds():
    assert goodput_at(FAST, Slo(2000, 50)) == Goodput(EXACT, 4.0)  # 8 misses both
    assert goodput_at(FAST, Slo(2000, 20)) == Goodput(EXACT, 2.0)  # 4's TPOT 28 misses
    assert goodput_at(FAST, Slo(500, 50)) == Goodput(EXACT, 2.0)  # 4's TTFT 900 misses
    assert goodput_at(FAST, Slo(5000, 100)) == Goodput(AT_LEAST, 8.0)  # met at the highest rate run: a bound
    assert goodput_at(FAST, Slo(100, 50)) == Goodput(BELOW, 1.0)  # met nowhere: below the lowest rate run
    assert [str(g) for g in (Goodput(EXACT, 4.0), Goodput(AT_LEAST, 8.0), Goodput(BELOW, 1.0))] == ["4", "≥ 8", "< 1"]


def test_the_goodput_is_the_highest_rate_met_even_past_one_missed():
    runs = {1.0: run_of(200, 10), 2.0: run_of(200, 10, slow=5), 4.0: run_of(200, 10)}
    assert goodput_at(runs, Slo()) == Goodput(AT_LEAST, 4.0)  # as records.goodput: the max of those met


def test_exactly_the_attainment_counts_and_failed_requests_count_against_it():
    slo = Slo(2000, 50, attainment=0.9)
    assert goodput_at({1.0: run_of(200, 10, n=20, slow=2), 2.0: run_of(200, 10, n=20, slow=3)}, slo) \
        == Goodput(EXACT, 1.0)  # 18/20 = 90 %: met; 17/20: not
    # 27/30 and 63/70 are 90 % too, with no rounding slack
    assert goodput_at({3.0: run_of(200, 10, n=30, slow=3), 7.0: run_of(200, 10, n=70, slow=7)}, slo) \
        == Goodput(AT_LEAST, 7.0)
    failed = run_of(200, 10, n=20, slow=0)[:17] + [rec(i, 0, 0, error="HTTP 503: full") for i in range(3)]
    assert goodput_at({1.0: failed}, slo) == Goodput(BELOW, 1.0)  # 17 of the 20 sent
    one_token = [rec(i, 200, 0, tokens=1) for i in range(20)]  # no TPOT: only TTFT can miss
    assert goodput_at({1.0: one_token}, Slo(300, 1)) == Goodput(AT_LEAST, 1.0)


def test_the_grid_agrees_with_the_sweeps_own_goodput_at_its_slo():
    slo = Slo(1000, 25)
    sweep = sweep_of(FAST, slo)
    assert goodput_at(grid.config_of("x", sweep).runs, slo).rate == sweep.goodput == 2.0


@pytest.mark.parametrize("own, other, text", [
    (Goodput(EXACT, 4), Goodput(EXACT, 8), "0.50×"),
    (Goodput(AT_LEAST, 8), Goodput(EXACT, 4), "≥ 2.00×"),
    (Goodput(EXACT, 4), Goodput(AT_LEAST, 8), "≤ 0.50×"),
    (Goodput(BELOW, 1), Goodput(EXACT, 4), "< 0.25×"),
    (Goodput(BELOW, 1), Goodput(AT_LEAST, 4), "< 0.25×"),
    (Goodput(EXACT, 4), Goodput(BELOW, 2), "> 2.00×"),
    (Goodput(AT_LEAST, 8), Goodput(BELOW, 2), "> 4.00×"),
    (Goodput(AT_LEAST, 8), Goodput(AT_LEAST, 8), "?"),  # both lower bounds: either may be higher
    (Goodput(BELOW, 1), Goodput(BELOW, 1), "?"),
])
def test_a_ratio_keeps_the_sign_of_its_bounds(own, other, text):
    assert ratio(own, other) == text


def cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines() if line.startswith("|")]


def test_the_table_has_a_ratio_to_the_best_of_the_others_per_pair():
    slower = {r: [rec(x.index, x.ttft_ms * 2, x.tpot_ms * 2) for x in recs] for r, recs in FAST.items()}
    never = {1.0: run_of(5000, 200), 2.0: run_of(9000, 400)}
    configs = [Config("pd2-2", FAST), Config("colocated4", slower), Config("pd1-3", never),
               Config("pd3-1", error="port 8000 is already in use")]
    text = grid.table(configs, [(2000, 50), (5000, 150), (300, 15)], 0.9)
    head, rule, *rows = cells(text)
    assert head == ["TTFT ≤ ms", "TPOT ≤ ms", "pd2-2", "colocated4", "pd1-3",
                    "pd2-2 / best other", "colocated4 / best other", "pd1-3 / best other"]
    assert rule == ["---:"] * 8
    assert rows == [
        ["2000", "50", "4", "2", "< 1", "2.00×", "0.50×", "< 0.25×"],  # slower: 4 req/s has TTFT 1800, TPOT 56
        ["5000", "150", "≥ 8", "≥ 8", "< 1", "?", "?", "< 0.12×"],  # 8: TTFT 2500/5000, TPOT 60/120: both bounds
        ["300", "15", "1", "< 1", "< 1", "> 1.00×", "< 1.00×", "< 1.00×"],
    ]
    assert "pd3-1: not in the grid, no rate measured (port 8000 is already in use)" in text
    assert "≥ 90 % of requests" not in text and ">= 90 % of requests" in text
    # One configuration: no ratios.
    head, _, *rows = cells(grid.table([Config("solo", FAST)], grid.DEFAULT_GRID, 0.9))
    assert head == ["TTFT ≤ ms", "TPOT ≤ ms", "solo"] and len(rows) == len(grid.DEFAULT_GRID)


def test_slo_grid_parses_ms_pairs_and_refuses_others():
    assert grid.parse_grid("2000/50, 1000/20,300/50") == [(2000, 50), (1000, 20), (300, 50)]
    assert grid.DEFAULT_GRID == ((2000, 50), (2000, 30), (1000, 25), (1000, 20), (500, 15), (300, 50))
    for bad in ("2000", "2000/50/3", "a/b", "2000/0", ""):
        with pytest.raises(Exception, match="TTFT_MS/TPOT_MS|> 0 ms"):
            grid.parse_grid(bad)


def test_a_record_reads_back_as_it_was_written_with_or_without_its_gaps():
    r = rec(3, 250.0, 12.5)
    r.itl_ms = [12.0, 13.0]
    back = RequestRecord.from_json(json.loads(json.dumps(r.to_json())))
    assert back == r and back.tpot_ms == 12.5
    slim = r.to_json(itl=False)
    assert "itl_ms" not in slim and RequestRecord.from_json(slim).tpot_ms == 12.5
    failed = rec(4, 0, 0, error="HTTP 503: full")
    assert RequestRecord.from_json(failed.to_json()) == failed


# -- the commands ------------------------------------------------------------------------------------------


def sweep_of(runs: dict[float, list[RequestRecord]], slo: Slo) -> Sweep:
    sweep = Sweep(Server("http://127.0.0.1:8000", "tiny-moe", 512), Workload(32, 8, num_prompts=20), slo)
    for rate, records in runs.items():
        sweep.runs.append(RateRun(summarize(rate, records, 20 / rate, slo), records))
    return sweep


def test_pd_goodput_prints_the_grid_last_and_the_grid_command_prints_it_again_from_its_json(
        tmp_path, monkeypatch, capsys):
    """pd_goodput's own writer saves the records; `python -m pdserve.benchmarks.load.grid` reads them."""
    sweeps = {"pd2-2": FAST, "colocated4": {r: run_of(300, 35) for r in FAST}}
    paths = []
    for name in (*sweeps, "pd1-3"):
        paths.append(tmp_path / f"{name}.yaml")
        paths[-1].write_text(yaml.safe_dump({"router": {"host": "127.0.0.1", "http_port": 0, "grpc_port": None}}))

    def run_config(path, cfg, a, log_dir):  # the cluster and its sweep, made up
        res = pd_goodput.ConfigResult(path.stem, str(path), "http://127.0.0.1:1", str(log_dir / "x.log"))
        if path.stem in sweeps:
            res.sweep = sweep_of(sweeps[path.stem], command.slo_of(a))
        else:
            res.error = "did not start"
        return res

    monkeypatch.setattr(pd_goodput, "run_config", run_config)
    out = tmp_path / "out.json"
    assert pd_goodput.main([*map(str, paths), "--rates", "1", "2", "4", "8", "--json", str(out),
                            "--log-dir", str(tmp_path)]) == 1  # pd1-3 did not start
    printed = capsys.readouterr().out
    table = printed[printed.index("goodput (req/s) per SLO pair"):].strip()
    assert printed.rstrip().endswith(table)  # last
    head, _, *rows = cells(table)
    assert head[2:] == ["pd2-2", "colocated4", "pd2-2 / best other", "colocated4 / best other"]
    assert len(rows) == 6 and rows[0] == ["2000", "50", "4", "≥ 8", "≤ 0.50×", "≥ 2.00×"]
    assert rows[1] == ["2000", "30", "4", "< 1", "> 4.00×", "< 0.25×"]  # colocated's TPOT 35 misses 30
    assert "pd1-3: not in the grid, no rate measured (did not start)" in table

    saved = json.loads(out.read_text())
    request = saved["configs"][0]["runs"][0]["requests"][0]
    assert "ttft_ms" in request and "itl_ms" not in request  # the records, their gaps only with --save-requests

    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.load.grid", str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == table, r.stdout + r.stderr
    # Other pairs, from the same file; a stricter attainment than the runs were saved with.
    assert grid.main([str(out), "--slo-grid", "2000/50,250/50", "--slo-attainment", "1"]) == 0
    assert cells(capsys.readouterr().out)[2:] == [["2000", "50", "4", "≥ 8", "≤ 0.50×", "≥ 2.00×"],
                                                  ["250", "50", "1", "< 1", "> 1.00×", "< 1.00×"]]


def test_bench_saves_the_records_with_a_grid_and_the_grid_command_needs_them(tmp_path, monkeypatch, capsys):
    sweep = sweep_of(FAST, Slo())

    async def run_sweep(url, rates, workload, slo, model=None, stop_below=None, on_run=None, metrics_urls=None):
        on_run(sweep)
        return sweep

    monkeypatch.setattr(command, "run_sweep", run_sweep)
    plain, gridded = tmp_path / "plain.json", tmp_path / "gridded.json"
    assert command.main(["--rate", "1", "--json", str(plain)]) == 0
    assert "per SLO pair" not in capsys.readouterr().out  # `pdserve bench` prints a grid only when asked
    assert grid.main([str(plain)]) == 2
    assert f"{plain}: runs[0] has no per-request records" in capsys.readouterr().err
    assert command.main(["--rate", "1", "--json", str(gridded), "--label", "pd1-1", "--slo-grid", "2000/50"]) == 0
    [[*_, bench_cell]] = cells(capsys.readouterr().out)[2:]
    assert bench_cell == "4"
    assert grid.main([str(gridded)]) == 0
    head, _, first, *_ = cells(capsys.readouterr().out)
    assert head == ["TTFT ≤ ms", "TPOT ≤ ms", "pd1-1"] and first == ["2000", "50", "4"]
