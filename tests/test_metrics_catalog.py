"""The router's metrics as documented and charted: docs/metrics.md lists exactly the metrics the
router exports, and every metric the Grafana dashboard queries exists."""

import json
import re
from pathlib import Path

from pdserve.router.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
SERIES_SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}


def exported() -> dict[str, str]:
    """Each metric as exported (a counter's name with _total) -> its type. From the registry's families,
    not its samples: a labelled metric nobody has set yet has no sample but is a metric all the same."""
    out = {}
    for family in Metrics("router").registry.collect():  # named: pdserve_router_info exists only then
        out[family.name + ("_total" if family.type == "counter" else "")] = family.type
    return out


def series_names() -> set[str]:
    """Every series name a query may use: counters' _total, histograms' _bucket/_sum/_count, gauges'."""
    names = set()
    for family in Metrics("router").registry.collect():
        names |= {family.name + s for s in SERIES_SUFFIXES[family.type]}
    return names


def test_the_metrics_table_lists_exactly_the_exported_metrics():
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| `pdserve_")]
    listed = {re.fullmatch(r"\s*`(\w+)`\s*", r[0])[1]: r[1].strip() for r in rows}
    assert len(listed) == len(rows), "a metric listed twice"
    assert listed == exported()  # names and types
    assert all(r[5].strip() for r in rows), "every row names vLLM's metric, or — for none"


def test_every_metric_the_grafana_dashboard_queries_exists():
    board = json.loads((ROOT / "deploy" / "grafana" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"\bpdserve_\w+", e)}
    assert used and used <= series_names(), used - series_names()
    # Everything but the pdserve_router_info label is charted.
    charted = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    assert {re.sub(r"_total$", "", n) for n in exported()} - charted == {"pdserve_router_info"}
    # One data source variable, which every panel and query names.
    assert [v["type"] for v in board["templating"]["list"] if v["name"] == "DS_PROMETHEUS"] == ["datasource"]
    sources = [p["datasource"] for p in board["panels"] if p["type"] != "row"]
    sources += [t["datasource"] for p in board["panels"] for t in p.get("targets", [])]
    assert all(s == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"} for s in sources)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
