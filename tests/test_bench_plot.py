"""`pdserve bench --plot` and `python -m pdserve.benchmarks.load.plot`: the charts of a sweep, several
runs on one chart, and files that are not results. No cluster: the sweep is made of records as
`run_rate` makes them (summarize), then goes through the command as `run_sweep`'s answer."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.benchmarks.load import command, plot
from pdserve.benchmarks.load.client import Server
from pdserve.benchmarks.load.records import RequestRecord, Slo, Workload, summarize
from pdserve.benchmarks.load.sweep import RateRun, Sweep

SIZES = {"ttft.png": (700, 500), "tpot.png": (1250, 500), "goodput.png": (1800, 500)}  # 1.5 + 5.5 in a panel, 5 in
LOAD = ["--num-prompts", "20", "--input-len", "32", "--output-len", "8", "--warmup", "0"]


def fake_sweep(rates: list[float], slo: Slo, slow: float = 1.0) -> Sweep:
    """Latencies that grow with the rate (inf: the worst), some requests over the SLO past 2 req/s."""
    workload = Workload(32, 8, num_prompts=20)
    sweep = Sweep(Server("http://127.0.0.1:8000", "tiny-moe", 512), workload, slo)
    for rate in rates:
        load = 16.0 if math.isinf(rate) else rate
        records = []
        for i in range(20):
            ttft = slow * (40 + 30 * load + 10 * i * load / 4)
            tpot = slow * (8 + 2 * load + (i % 5))
            records.append(RequestRecord(i, 32, start_s=i / load, ttft_ms=ttft, e2e_ms=ttft + 7 * tpot,
                                         itl_ms=[tpot * (0.5 + (j % 3) / 2) for j in range(7)], output_tokens=8,
                                         chunks=8, error="HTTP 503: full" if load >= 16 and i % 4 == 0 else None))
        sweep.runs.append(RateRun(summarize(rate, records, 20 / load + 0.5, slo), records))
    return sweep


@pytest.fixture
def bench(monkeypatch):
    """`pdserve bench ARGS` in this process, the sweep made up (run_sweep sees the command's options)."""
    def run(*args: str, sweep: Sweep | None = None) -> int:
        async def run_sweep(url, rates, workload, slo, model=None, stop_below=None, on_run=None, metrics_urls=None):
            assert sweep is not None, "the sweep ran"
            on_run(sweep)
            return sweep
        monkeypatch.setattr(command, "run_sweep", run_sweep)
        return command.main([*args])
    return run


def assert_png(path: Path, size: tuple[int, int]) -> None:
    from PIL import Image
    import numpy as np

    with Image.open(path) as im:
        assert im.format == "PNG" and im.size == size, (path, im.format, im.size)
        gray = np.asarray(im.convert("L"), dtype=float)
    assert gray.var() > 100, f"{path.name} is blank"  # white with a few lines would be ~0
    assert (gray < 128).mean() > 0.01, f"{path.name} has almost nothing drawn"


def legend_texts(fig) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]


# -- one sweep ----------------------------------------------------------------------------------------------


def test_plot_writes_the_charts_of_the_sweep(bench, tmp_path):
    out, charts = tmp_path / "out.json", tmp_path / "charts" / "new"  # created, parents too
    sweep = fake_sweep([1, 2, 4, 8, math.inf], Slo(ttft_ms=200, tpot_ms=20))
    assert bench("--rate", "1", "2", "4", "8", "inf", *LOAD, "--json", str(out), "--label", "pd1-1",
                 "--plot", str(charts), sweep=sweep) == 0
    assert sorted(p.name for p in charts.iterdir()) == sorted(SIZES)
    for name, size in SIZES.items():
        assert_png(charts / name, size)
    res = json.loads(out.read_text())
    assert res["label"] == "pd1-1" and res["meta"]["args"]["plot"] == str(charts)


def test_the_charts_draw_each_percentile_the_slo_and_inf_at_the_right_edge():
    [s] = plot.series_of(fake_sweep([1, 2, 4, 8, math.inf], Slo(200, 20)).to_json(False), "x", "run")
    figs = plot.draw([s])
    ttft = figs["ttft"].axes[0]
    assert legend_texts(figs["ttft"]) == ["p50", "p90", "p99", "SLO 200 ms"]
    assert ttft.get_xscale() == "log"  # 1..8: a doubling sweep
    assert [t.get_text() for t in ttft.get_xticklabels()] == ["1", "2", "4", "8", "inf"]
    p99 = ttft.get_lines()[2]
    assert list(p99.get_xdata()) == [1, 2, 4, 8, 16, 16]  # inf one step past 8, the line broken before it
    assert math.isnan(p99.get_ydata()[-2])
    assert p99.get_ydata()[-1] == s.stats["ttft_ms"]["p99"][-1]
    slo = [line for line in ttft.get_lines() if line.get_label() == "SLO 200 ms"]
    assert slo and list(slo[0].get_ydata()) == [200, 200]
    assert legend_texts(figs["tpot"]) == ["p50", "p90", "p99", "SLO 20 ms", "p50", "p90", "p99"]  # ITL: no SLO
    good, attained, tokens = figs["goodput"].axes
    assert [t.get_text() for t in good.get_legend().get_texts()] == [
        "offered (every request good)", f"goodput {plot.rate_label(s.goodput)} req/s"]
    assert "target 90 %" in [t.get_text() for t in attained.get_legend().get_texts()]
    # A few rates close together stay linear; inf still gets the last tick, one step on.
    axis = plot.RateAxis([1, 2, 3, math.inf])
    assert not axis.log and axis.inf_x == 4
    assert plot.RateAxis([math.inf]).x(math.inf) == 1.0


def test_bench_without_plot_imports_no_matplotlib(tmp_path):
    code = f"""
import sys, math
sys.path.insert(0, {str(Path(__file__).parent)!r})
import test_bench_plot as t
from pdserve.benchmarks.load import command
from pdserve.benchmarks.load.records import Slo
async def run_sweep(*a, on_run=None, **k):
    s = t.fake_sweep([1, math.inf], Slo())
    on_run(s)
    return s
command.run_sweep = run_sweep
import pdserve.benchmarks.pd_goodput
assert command.main(["--rate", "1", "inf", "--json", {str(tmp_path / 'o.json')!r}]) == 0
assert "matplotlib" not in sys.modules, "matplotlib was imported"
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


# -- several runs -------------------------------------------------------------------------------------------


def write_results(tmp_path: Path) -> tuple[Path, Path]:
    """a.json as `pdserve bench --json --label pd1-1` writes it; b.json as pd_goodput's --json (two clusters
    measured, one that did not start)."""
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"meta": {}, "label": "pd1-1",
                             **fake_sweep([1, 2, 4, math.inf], Slo(200, 20)).to_json(False)}))
    configs = [{"name": name, "error": None, **fake_sweep([1, 2, 4, 8], Slo(200, 20), slow).to_json(False)}
               for name, slow in (("pd2-2", 0.6), ("pd3-1", 0.8))]
    configs.append({"name": "pd1-3", "error": "port 8000 is already in use", "url": "", "runs": [], "goodput": None})
    b = tmp_path / "b.json"
    b.write_text(json.dumps({"meta": {}, "configs": configs}))
    return a, b


def test_compare_draws_every_run_on_one_chart_named_by_its_label(tmp_path):
    a, b = write_results(tmp_path)
    series = plot.load(a) + plot.load(b)
    assert [s.label for s in series] == ["pd1-1", "pd2-2", "pd3-1"]  # pd1-3 was not measured
    figs = plot.draw(series)
    assert legend_texts(figs["ttft"])[:3] == ["pd1-1", "pd2-2", "pd3-1"]  # colour: the run, style: the percentile
    good = figs["goodput"].axes[0].get_legend().get_texts()
    assert [t.get_text().split(":")[0] for t in good][1:] == ["pd1-1", "pd2-2", "pd3-1"]
    assert [t.get_text() for t in figs["ttft"].axes[0].get_xticklabels()] == ["1", "2", "4", "8", "inf"]
    # The standalone command writes the same three files.
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.load.plot", str(a), str(b), "--out",
                        str(tmp_path / "charts")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for name, size in SIZES.items():
        assert_png(tmp_path / "charts" / name, size)


def test_bench_compare_adds_saved_runs_to_this_sweep(bench, tmp_path, monkeypatch):
    a, b = write_results(tmp_path)
    drawn = []
    draw = plot.draw
    monkeypatch.setattr(plot, "draw", lambda series: drawn.append(draw(series)) or drawn[-1])
    sweep = fake_sweep([2, 4], Slo(200, 20), slow=0.5)
    assert bench("--rate", "2", "4", *LOAD, "--json", str(tmp_path / "new.json"), "--plot", str(tmp_path / "c"),
                 "--compare", str(a), str(b), sweep=sweep) == 0
    [figs] = drawn
    assert legend_texts(figs["ttft"])[:4] == ["new", "pd1-1", "pd2-2", "pd3-1"]  # no --label: the --json's name
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted(SIZES)


def test_two_runs_of_one_name_are_told_apart(tmp_path):
    a, _ = write_results(tmp_path)
    series = plot.load(a) + plot.load(a)
    plot.distinct_labels(series)
    assert [s.label for s in series] == ["pd1-1", "pd1-1 #2"]


# -- files that are not results -----------------------------------------------------------------------------


BAD = {
    "garbage.json": ("not json {", "not JSON"),
    "list.json": ("[1, 2]", "not a `pdserve bench --json` result"),
    "other.json": (json.dumps({"model": "x"}), "it has 'runs'"),
    "nostats.json": (json.dumps({"slo": {"ttft_ms": 1, "tpot_ms": 1, "attainment": 0.9},
                                 "runs": [{"rate": 1.0, "tpot_ms": {}, "itl_ms": {}}]}), "runs[0] has no 'ttft_ms'"),
    "noslo.json": (json.dumps({"runs": [{"rate": 1}]}), "has no 'slo'"),
    "rate.json": (json.dumps({"slo": {"ttft_ms": 1, "tpot_ms": 1, "attainment": 0.9}, "runs": [{"rate": "fast"}]}),
                  "runs[0].rate is 'fast'"),
    "failed.json": (json.dumps({"configs": [{"name": "pd1-3", "error": "port 8000 is already in use", "runs": []}]}),
                    "no cluster file of this pd_goodput result was measured: pd1-3 (port 8000 is already in use)"),
}


@pytest.mark.parametrize("name", BAD)
def test_a_file_that_is_not_a_result_is_named_with_what_it_lacks(tmp_path, name):
    text, expected = BAD[name]
    (tmp_path / name).write_text(text)
    with pytest.raises(plot.PlotError) as e:
        plot.load(tmp_path / name, "--compare")
    assert str(e.value).startswith(f"--compare {tmp_path / name}: ") and expected in str(e.value), str(e.value)


def test_the_commands_refuse_a_bad_file_before_anything_runs(bench, tmp_path, capsys):
    a, _ = write_results(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"slo": {}, "runs": []}))
    assert bench("--rate", "1", *LOAD, "--plot", str(tmp_path / "c"), "--compare", str(a), str(bad)) == 2
    err = capsys.readouterr().err
    assert f"--compare {bad}: " in err and "'ttft_ms'" in err, err  # the sweep did not run (it would assert)
    assert bench("--rate", "1", *LOAD, "--compare", str(a)) == 2
    assert "give --plot DIR too" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert bench("--rate", "1", *LOAD, "--plot", str(tmp_path / "file"),
                 sweep=fake_sweep([1], Slo())) == 2  # the folder is a file
    assert f"--plot {tmp_path / 'file'}: cannot create the folder" in capsys.readouterr().err
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.load.plot", str(a), str(bad), "--out",
                        str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"{bad}: " in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "c").exists()
