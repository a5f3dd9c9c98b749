"""Goodput over a grid of SLO pairs, from each request's record: one sweep answers every SLO.

    python -m pdserve.benchmarks.load.grid out.json [more.json ...] [--slo-grid 2000/50,1000/20]

A file is what pd_goodput --json writes (a configuration per cluster file, named by the file's stem)
or `pdserve bench --json --slo-grid ...` (one, named by its --label, else by the file's name); the
grid needs the per-request records, which both save then. pd_goodput prints the same table last.

At a pair (TTFT <= X ms, TPOT <= Y ms), a configuration's goodput is the highest rate of its sweep
at which >= --slo-attainment of the requests sent met both (records.Slo.met; TPOT per request as
records.py defines it: (e2e - TTFT) / (output tokens - 1)). The attainment is the exact fraction
(the saved summaries round theirs to 3 digits, which would lift 89.96 % to 90 %). A goodput reads:
  16     met at 16 req/s and not at the next rate run (true to the sweep's resolution)
  ≥ 32   met at the highest rate run: a lower bound, higher rates were not run
  < 12   met at no rate run; 12 was the lowest (the goodput may be 0)
Beside each, "NAME / best other": its goodput over the best of the other configurations at that
pair, with the same signs when a side is a bound (≥ 32 over 16 is "≥ 2.00×"; 16 over ≥ 32 is
"≤ 0.50×"; < 12 over 16 is "< 0.75×") and "?" when the bounds leave it open (≥ 32 over ≥ 32).
"""

import argparse
import json
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.benchmarks.load.records import RequestRecord, Slo, rate_from_json, rate_label

if TYPE_CHECKING:
    from pdserve.benchmarks.load.sweep import Sweep

Pair = tuple[float, float]  # (TTFT ms, TPOT ms)
# Issue 39's grid: from the loose SLO of docs/benchmarks.md to tight TPOTs (where decode-only GPUs
# should pay) and a tight TTFT (where they should not).
DEFAULT_GRID: tuple[Pair, ...] = ((2000, 50), (2000, 30), (1000, 25), (1000, 20), (500, 15), (300, 50))

EXACT, AT_LEAST, BELOW = "=", "≥", "<"


class GridError(ValueError):
    """A file the grid cannot use: the message names it and what it lacks."""


@dataclass
class Config:
    """One configuration's sweep: rate -> the records of the requests sent at it."""
    label: str
    runs: dict[float, list[RequestRecord]] = field(default_factory=dict)
    attainment: float | None = None  # the one its sweep ran with, when read from a file
    error: str | None = None  # why it has no runs (the cluster did not start, ...)


def config_of(label: str, sweep: "Sweep | None", error: str | None = None) -> Config:
    if sweep is None:
        return Config(label, error=error)
    return Config(label, {run.summary.rate: run.records for run in sweep.runs}, sweep.slo.attainment, error)


# -- goodput at one pair --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goodput:
    kind: str  # EXACT, AT_LEAST (met at the highest rate run) or BELOW (met at none; rate: the lowest run)
    rate: float

    def __str__(self) -> str:
        return rate_label(self.rate) if self.kind == EXACT else f"{self.kind} {rate_label(self.rate)}"

    def rank(self) -> tuple[float, int, float]:
        """Best first when sorted in reverse: what was met, then a bound over an exact figure of the
        same rate (it may be higher), then among "met nothing" the one whose lowest rate was higher."""
        if self.kind == BELOW:
            return (0.0, 0, self.rate)
        return (self.rate, 2 if self.kind == AT_LEAST else 1, 0.0)


def attained(records: list[RequestRecord], slo: Slo) -> float:
    """The share of the requests sent (failed ones included) that met both of the SLO's bounds."""
    return sum(slo.met(r) for r in records) / len(records) if records else 0.0


def goodput_at(runs: dict[float, list[RequestRecord]], slo: Slo) -> Goodput:
    met = [rate for rate, records in runs.items() if attained(records, slo) >= slo.attainment]
    if not met:
        return Goodput(BELOW, min(runs))
    best = max(met)
    # "all at once" met is no bound on anything higher: there is nothing higher.
    return Goodput(AT_LEAST if best == max(runs) and not math.isinf(best) else EXACT, best)


def ratio(own: Goodput, other: Goodput) -> str:
    """own / other, as far as the bounds tell."""
    if (own.kind, other.kind) in ((AT_LEAST, AT_LEAST), (BELOW, BELOW)):
        return "?"
    if own.kind == BELOW:  # own < r, other >= b: own / other < r / b
        sign = "< "
    elif other.kind == BELOW:  # other < r: own / other > a / r
        sign = "> "
    else:
        sign = {(EXACT, EXACT): "", (AT_LEAST, EXACT): "≥ ", (EXACT, AT_LEAST): "≤ "}[own.kind, other.kind]
    x = own.rate / other.rate
    if math.isnan(x):  # inf over inf
        return "?"
    return f"{sign}{'inf' if math.isinf(x) else f'{x:.2f}'}×"


def grid(configs: list[Config], pairs: Iterable[Pair], attainment: float) -> list[list[Goodput]]:
    """A row per pair, a goodput per configuration (each must have runs)."""
    return [[goodput_at(c.runs, Slo(ttft, tpot, attainment)) for c in configs] for ttft, tpot in pairs]


# -- the table ------------------------------------------------------------------------------------------


def table(configs: list[Config], pairs: Iterable[Pair], attainment: float) -> str:
    """The grid as a markdown table: the pair, each configuration's goodput (req/s), and with several
    configurations each one's ratio to the best of the others."""
    pairs = list(pairs)
    measured = [c for c in configs if c.runs]
    lines = [f"goodput (req/s) per SLO pair: the highest rate with >= {100 * attainment:g} % of requests "
             f"meeting both; ≥ g: met at the highest rate run (a lower bound); < r: met at none, r the lowest "
             f"rate run; NAME / best other: its goodput over the best other configuration's at that "
             f"pair (? when the bounds leave it open)"]
    if measured:
        head = ["TTFT ≤ ms", "TPOT ≤ ms", *(c.label for c in measured)]
        if len(measured) > 1:
            head += [f"{c.label} / best other" for c in measured]
        lines += ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
        for (ttft, tpot), row in zip(pairs, grid(measured, pairs, attainment)):
            cells = [f"{ttft:g}", f"{tpot:g}", *map(str, row)]
            if len(measured) > 1:
                cells += [ratio(g, max(row[:i] + row[i + 1:], key=Goodput.rank)) for i, g in enumerate(row)]
            lines.append("| " + " | ".join(cells) + " |")
    for c in configs:
        if not c.runs:
            lines.append(f"{c.label}: not in the grid, no rate measured ({c.error or 'no runs'})")
    return "\n".join(lines)


def parse_grid(text: str) -> list[Pair]:
    """--slo-grid "2000/50,1000/20": TTFT ms / TPOT ms pairs."""
    pairs = []
    for item in text.split(","):
        try:
            ttft, tpot = (float(x) for x in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item.strip()!r} is not TTFT_MS/TPOT_MS (e.g. --slo-grid 2000/50,1000/20)") from None
        if not (ttft > 0 and tpot > 0):
            raise argparse.ArgumentTypeError(f"{item.strip()!r}: both bounds must be > 0 ms")
        pairs.append((ttft, tpot))
    return pairs


SLO_GRID_HELP = "TTFT_MS/TPOT_MS pairs, comma-separated: goodput at each, from the same runs"
DEFAULT_GRID_TEXT = ",".join(f"{t:g}/{p:g}" for t, p in DEFAULT_GRID)


# -- reading saved results ------------------------------------------------------------------------------


def load(path: str | Path) -> list[Config]:
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        raise GridError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GridError(f"{path}: not JSON ({e})") from None
    return configs_of(result, str(path), Path(path).stem)


def configs_of(result: Any, where: str, default_label: str) -> list[Config]:
    if isinstance(result, dict) and "runs" in result:
        return [_config(result, where, "", result.get("label") or default_label)]
    if isinstance(result, dict) and isinstance(result.get("configs"), list):
        return [_config(c, where, f"configs[{i}].", c.get("name") or f"{default_label}[{i}]")
                for i, c in enumerate(result["configs"])]
    raise GridError(f"{where}: not a `pdserve bench --json` result (it has 'runs') nor a pd_goodput --json "
                    f"one (it has 'configs')")


def _config(d: dict, where: str, prefix: str, label: str) -> Config:
    if not d.get("runs"):
        return Config(label, error=d.get("error"))
    runs = {}
    for j, run in enumerate(d["runs"]):
        if "requests" not in run:
            raise GridError(f"{where}: {prefix}runs[{j}] has no per-request records ('requests'), which the grid "
                            f"is computed from: pd_goodput saves them, `pdserve bench` with --slo-grid or "
                            f"--save-requests")
        runs[rate_from_json(run["rate"])] = [RequestRecord.from_json(r) for r in run["requests"]]
    return Config(label, runs, (d.get("slo") or {}).get("attainment"))


def saved_attainment(configs: list[Config]) -> float:
    """The attainment the runs were judged with; the files must agree (else --slo-attainment says)."""
    saved = {c.attainment for c in configs if c.attainment is not None}
    if len(saved) > 1:
        raise GridError(f"the files' runs used different --slo-attainment ({', '.join(map(str, sorted(saved)))}): "
                        f"give --slo-attainment")
    return saved.pop() if saved else Slo().attainment


# -- the command ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    from pdserve.benchmarks.load.plot import distinct_labels  # no matplotlib: it is imported only to draw

    p = argparse.ArgumentParser(prog="python -m pdserve.benchmarks.load.grid", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE", help="JSON of pd_goodput --json or `pdserve bench --json`")
    p.add_argument("--slo-grid", type=parse_grid, default=list(DEFAULT_GRID), metavar="TTFT/TPOT,...",
                   help=f"{SLO_GRID_HELP} (default: {DEFAULT_GRID_TEXT})")
    p.add_argument("--slo-attainment", type=float,
                   help="share of requests that must meet both (default: the one the runs were saved with)")
    a = p.parse_args(argv)
    if a.slo_attainment is not None and not 0 < a.slo_attainment <= 1:
        p.error(f"--slo-attainment must be in (0, 1], got {a.slo_attainment}")
    try:
        configs = [c for f in a.files for c in load(f)]
        share = a.slo_attainment if a.slo_attainment is not None else saved_attainment(configs)
    except GridError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    distinct_labels(configs)
    print(table(configs, a.slo_grid, share))
    return 0


if __name__ == "__main__":
    sys.exit(main())
