"""`pdserve bench`'s charts: latency percentiles, goodput and token rate against the offered rate (PNG).

    pdserve bench --rate 1 2 4 8 inf ... --json a.json --plot charts/         this sweep's charts
    pdserve bench ... --label pd2-2 --plot charts/ --compare a.json            beside earlier results
    python -m pdserve.benchmarks.load.plot a.json b.json goodput.json --out charts/   saved results only

A file is what `pdserve bench --json` writes (one curve, named by its --label, else by the file's
name) or what pd_goodput's --json writes (a curve per cluster file measured, named by the file).
The folder (created if missing) gets, every curve on the same axes:
  ttft.png      TTFT p50 / p90 / p99 (ms), the SLO's TTFT as a line
  tpot.png      TPOT p50 / p90 / p99 with the SLO's TPOT; beside it ITL p50 / p90 / p99 (no SLO)
  goodput.png   requests/s meeting both SLOs against the offered rate (the legend gives each
                sweep's goodput), SLO attainment with its target, output tokens/s
Rate inf (everything at once) sits at the right edge, past the highest finite rate, with its own
tick. matplotlib (the `plot` extra) is imported only to draw, with the Agg canvas (no display).
"""

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.benchmarks.load.records import Slo, rate_label

CHARTS = ("ttft", "tpot", "goodput")
PERCENTILES = {"p50": ("-", "o"), "p90": ("--", "s"), "p99": (":", "^")}  # line style, marker
_STATS = ("ttft_ms", "tpot_ms", "itl_ms")
_NUMBERS = ("good_rps", "slo_attainment", "output_throughput")
_HINT = ("not a `pdserve bench --json` result (it has 'runs') nor a pd_goodput --json one "
         "(it has 'configs')")


class PlotError(ValueError):
    """A file or folder the charts cannot use: the message names it (and the option that gave it)."""


@dataclass
class Series:
    """One sweep's curves: a bench result, or one cluster file of a pd_goodput result."""
    label: str
    model: str | None
    workload: dict[str, Any]
    slo: Slo
    rates: list[float]
    stats: dict[str, dict[str, list[float]]]  # "ttft_ms" -> "p50" -> one value per rate (nan: none completed)
    numbers: dict[str, list[float]]  # "good_rps" -> one value per rate
    goodput: float | None


# -- reading results ----------------------------------------------------------------------------------


def load(path: str | Path, option: str = "") -> list[Series]:
    """The curves of one saved result; PlotError naming `option` and the file if it is none."""
    where = f"{option} {path}".strip()
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        raise PlotError(f"{where}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlotError(f"{where}: not JSON ({e}); {_HINT}") from None
    return series_of(result, where, default_label=Path(path).stem)


def series_of(result: Any, where: str, default_label: str) -> list[Series]:
    """The curves of a result as `pdserve bench` or pd_goodput writes it (also before it is saved)."""
    if not isinstance(result, dict) or ("runs" not in result and "configs" not in result):
        raise PlotError(f"{where}: {_HINT}")
    if "runs" in result:
        return [_series(result, where, "", result.get("label") or default_label)]
    configs = result["configs"]
    if not isinstance(configs, list):
        raise PlotError(f"{where}: 'configs' is not a list")
    out, unmeasured = [], []
    for i, c in enumerate(configs):
        if not isinstance(c, dict):
            raise PlotError(f"{where}: configs[{i}] is not an object")
        name = c.get("name") or f"{default_label}[{i}]"
        if c.get("runs"):
            out.append(_series(c, where, f"configs[{i}].", name))
        else:  # the cluster did not start, or failed before its first rate
            unmeasured.append(f"{name} ({c.get('error') or 'no runs'})")
    if not out:
        raise PlotError(f"{where}: no cluster file of this pd_goodput result was measured: {', '.join(unmeasured)}")
    return out


def _series(d: dict, where: str, prefix: str, label: str) -> Series:
    def need(obj: dict, key: str, at: str) -> Any:
        if not isinstance(obj, dict) or key not in obj:
            raise PlotError(f"{where}: {at or 'it'} has no {key!r}, which `pdserve bench --json` writes "
                            f"(a file of another tool, or cut short?)")
        return obj[key]

    def number(x: Any, at: str) -> float:
        if x is None:  # a statistic of a rate where nothing completed
            return math.nan
        if isinstance(x, bool) or not isinstance(x, int | float):
            raise PlotError(f"{where}: {at} is {x!r}, not a number")
        return float(x)

    slo_json = need(d, "slo", prefix.rstrip("."))
    slo = Slo(*(number(need(slo_json, k, f"{prefix}slo"), f"{prefix}slo.{k}")
                for k in ("ttft_ms", "tpot_ms", "attainment")))
    runs = need(d, "runs", prefix.rstrip("."))
    if not isinstance(runs, list) or not runs:
        raise PlotError(f"{where}: {prefix}runs is {'empty' if runs == [] else 'not a list'}: no rate to draw")
    rates, stats, numbers = [], {k: {p: [] for p in PERCENTILES} for k in _STATS}, {k: [] for k in _NUMBERS}
    for j, run in enumerate(runs):
        at = f"{prefix}runs[{j}]"
        rates.append(_rate(need(run, "rate", at), f"{where}: {at}.rate"))
        for k in _STATS:
            table = need(run, k, at)
            for p in PERCENTILES:
                stats[k][p].append(number(need(table, p, f"{at}.{k}"), f"{at}.{k}.{p}"))
        for k in _NUMBERS:
            numbers[k].append(number(need(run, k, at), f"{at}.{k}"))
    return Series(label, d.get("model"), d.get("workload") or {}, slo, rates, stats, numbers,
                  _rate(d["goodput"], f"{where}: {prefix}goodput") if d.get("goodput") is not None else None)


def _rate(x: Any, at: str) -> float:
    if x == "inf":  # JSON has no infinity (records.rate_json)
        return math.inf
    if isinstance(x, bool) or not isinstance(x, int | float) or not x > 0:
        raise PlotError(f"{at} is {x!r}: a rate is a number > 0 or \"inf\"")
    return float(x)


def distinct_labels(series: list[Series]) -> None:
    """Two curves of one name (two runs without --label, or two pd_goodput files naming the same
    cluster file) are told apart by their position: "name #2"."""
    seen: dict[str, int] = {}
    for s in series:
        seen[s.label] = seen.get(s.label, 0) + 1
        if seen[s.label] > 1:
            s.label = f"{s.label} #{seen[s.label]}"


# -- drawing ------------------------------------------------------------------------------------------


def require_matplotlib(option: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError(f"{option} needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)") from None


class RateAxis:
    """Where each rate sits on x: finite rates as they are (log-spaced when they span >= 4x, as a
    doubling sweep does), inf one step past the highest, with its own tick and a dotted break."""

    def __init__(self, rates: list[float]):
        self.finite = sorted({r for r in rates if not math.isinf(r)})
        self.has_inf = any(math.isinf(r) for r in rates)
        f = self.finite
        self.log = len(f) >= 2 and f[-1] / f[0] >= 4
        if not f:
            self.inf_x = 1.0
        elif self.log or len(f) == 1:
            self.inf_x = f[-1] * 2
        else:
            self.inf_x = f[-1] + (f[-1] - f[0]) / (len(f) - 1)

    def x(self, rate: float) -> float:
        return self.inf_x if math.isinf(rate) else rate

    def apply(self, ax) -> None:
        from matplotlib.ticker import NullLocator

        if self.log:
            ax.set_xscale("log")
        ticks = self.finite + ([self.inf_x] if self.has_inf else [])
        ax.set_xticks(ticks, [rate_label(r) for r in self.finite] + (["inf"] if self.has_inf else []),
                      rotation=45 if len(ticks) > 8 else 0)
        ax.xaxis.set_minor_locator(NullLocator())
        if self.has_inf and self.finite:
            edge = math.sqrt(self.finite[-1] * self.inf_x) if self.log else (self.finite[-1] + self.inf_x) / 2
            ax.axvline(edge, color="0.6", linestyle=":", linewidth=1)
        ax.set_xlabel("offered rate (requests/s; inf: all at once)")
        ax.grid(True, alpha=0.3)


def draw(series: list[Series]) -> dict[str, Any]:
    """The charts as matplotlib Figures (name -> Figure, CHARTS' names), not saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    axis = RateAxis([r for s in series for r in s.rates])
    title = _title(series)
    figures = {}
    for name, panels in (("ttft", 1), ("tpot", 2), ("goodput", 3)):
        fig = Figure(figsize=(1.5 + 5.5 * panels, 5), dpi=100, layout="constrained")
        FigureCanvasAgg(fig)  # PNG through Agg: no display, whatever backend matplotlib would pick
        fig.suptitle(title, fontsize="medium")
        figures[name] = fig
    ttft = figures["ttft"].subplots()
    tpot, itl = figures["tpot"].subplots(1, 2)
    good, attained, tokens = figures["goodput"].subplots(1, 3)

    _percentiles(ttft, axis, series, "ttft_ms", "TTFT (ms)", lambda s: s.slo.ttft_ms)
    _percentiles(tpot, axis, series, "tpot_ms", "TPOT (ms)", lambda s: s.slo.tpot_ms)
    _percentiles(itl, axis, series, "itl_ms", "ITL (ms)", None)

    finite = axis.finite
    if finite:
        good.plot(finite, finite, color="0.6", linestyle=":", label="offered (every request good)")
    for i, s in enumerate(series):
        g = f"goodput {rate_label(s.goodput)} req/s" if s.goodput is not None else "no rate meets the SLO"
        name = f"{s.label}: {g}" if len(series) > 1 else g
        _line(good, axis, s, s.numbers["good_rps"], i, name)
        _line(attained, axis, s, [100 * v for v in s.numbers["slo_attainment"]], i, s.label)
        _line(tokens, axis, s, s.numbers["output_throughput"], i, s.label)
    good.set_title("goodput: requests/s meeting both SLOs")
    good.set_ylabel("requests/s")
    attained.set_title("SLO attainment (share of requests sent)")
    attained.set_ylabel("%")
    attained.set_ylim(-3, 103)
    _slo_lines(attained, series, lambda s: 100 * s.slo.attainment, "target {:g} %")
    tokens.set_title("output tokens/s")
    tokens.set_ylabel("tokens/s")
    for ax in (good, attained, tokens):
        axis.apply(ax)
        ax.set_ylim(bottom=0 if ax is not attained else -3)
        if ax is good or len(series) > 1 or ax is attained:
            ax.legend(fontsize="small", loc="best")
    return figures


def _line(ax, axis: RateAxis, s: Series, values: list[float], i: int, label: str) -> None:
    xs, ys = _sorted_points(axis, s.rates, values)
    ax.plot(xs, ys, color=f"C{i % 10}", marker="o", label=label)


def _sorted_points(axis: RateAxis, rates: list[float], values: list[float]) -> tuple[list[float], list[float]]:
    """The points left to right (a sweep runs its rates in the order given); inf's point stands
    apart: a nan before it breaks the line, since nothing lies between the last rate and inf."""
    points = sorted(zip((axis.x(r) for r in rates), values, (math.isinf(r) for r in rates)))
    xs, ys = [], []
    for x, y, is_inf in points:
        if is_inf and xs:
            xs.append(x)
            ys.append(math.nan)
        xs.append(x)
        ys.append(y)
    return xs, ys


def _percentiles(ax, axis: RateAxis, series: list[Series], key: str, ylabel: str, slo) -> None:
    from matplotlib.lines import Line2D

    handles = []
    for i, s in enumerate(series):
        for p, (style, marker) in PERCENTILES.items():
            xs, ys = _sorted_points(axis, s.rates, s.stats[key][p])
            ax.plot(xs, ys, color=f"C{i % 10}", linestyle=style, marker=marker, markersize=5)
        if len(series) > 1:  # colour: the run; style: the percentile
            handles.append(Line2D([], [], color=f"C{i % 10}", linewidth=3, label=s.label))
    color = "C0" if len(series) == 1 else "0.25"
    handles += [Line2D([], [], color=color, linestyle=style, marker=marker, markersize=5, label=p)
                for p, (style, marker) in PERCENTILES.items()]
    if slo is not None:
        handles += _slo_lines(ax, series, slo, "SLO {:g} ms")
    values = [v for s in series for p in PERCENTILES for v in s.stats[key][p] if v > 0]  # nan > 0 is False
    if slo is not None:
        values += [slo(s) for s in series]
    if values and max(values) / min(values) > 30:  # past saturation the tail outgrows the rest by orders
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    name = ylabel.split(" ")[0]
    ax.set_title(f"{name} p50 / p90 / p99")
    ax.set_ylabel(ylabel)
    axis.apply(ax)
    ax.legend(handles=handles, fontsize="small", loc="best")


def _slo_lines(ax, series: list[Series], value, text: str) -> list:
    """The SLO's target as a horizontal line: one if every run has the same, else one per run in its colour."""
    values = [value(s) for s in series]
    if len(set(values)) == 1:
        return [ax.axhline(values[0], color="black", linestyle="-.", linewidth=1.2, label=text.format(values[0]))]
    return [ax.axhline(v, color=f"C{i % 10}", linestyle="-.", linewidth=1.2, label=f"{s.label} {text.format(v)}")
            for i, (s, v) in enumerate(zip(series, values))]


def _title(series: list[Series]) -> str:
    shapes = {(s.model, s.workload.get("input_len"), s.workload.get("output_len")) for s in series}
    if len(shapes) != 1:
        return "runs of different models or workloads: compare with care"
    model, inp, out = next(iter(shapes))
    shape = f"prompts {inp} tokens, output {out}" if inp is not None else ""
    return ": ".join(x for x in (model, shape) if x) or "pdserve bench"


def write_charts(series: list[Series], out_dir: str | Path, option: str = "--plot") -> list[Path]:
    """Draw and save CHARTS as PNG files into `out_dir` (created if missing); their paths."""
    require_matplotlib(option)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PlotError(f"{option} {out_dir}: cannot create the folder ({e.strerror or e})") from None
    distinct_labels(series)
    paths = []
    for name, fig in draw(series).items():
        path = out / f"{name}.png"
        try:
            fig.savefig(path)
        except OSError as e:
            raise PlotError(f"{option} {out_dir}: cannot write {path.name} ({e.strerror or e})") from None
        paths.append(path)
    return paths


def load_compare(files: list[str] | None, out_dir: str | None) -> list[Series]:
    """`--compare`'s files, read (and matplotlib found) before a sweep starts, not after it."""
    if files and not out_dir:
        raise PlotError("--compare adds saved results to --plot's charts: give --plot DIR too")
    if out_dir:
        require_matplotlib("--plot")
    return [s for f in files or [] for s in load(f, "--compare")]


# -- the command --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.load.plot", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE", help="JSON of `pdserve bench --json` or pd_goodput --json")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder for the PNG files (created if missing)")
    a = p.parse_args(argv)
    try:
        series = [s for f in a.files for s in load(f)]
        paths = write_charts(series, a.out, "--out")
    except PlotError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
