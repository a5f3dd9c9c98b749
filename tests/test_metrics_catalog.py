"""The router's metrics as documented and charted: docs/metrics.md lists exactly the metrics the
router exports, every metric the Grafana dashboard queries exists, and so does every series vLLM's
published Grafana dashboard queries (vLLM's names, router/vllm_metrics.py), with its model_name."""

import json
import re
from pathlib import Path

from pdserve.router.metrics import Metrics

ROOT = Path(__file__).resolve().parents[1]
SERIES_SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}


def exported(prefix: str = "pdserve_") -> dict[str, str]:
    """Each metric as exported (a counter's name with _total) -> its type. From the registry's families,
    not its samples: a labelled metric nobody has set yet has no sample but is a metric all the same."""
    out = {}
    for family in Metrics("router").registry.collect():  # named: pdserve_router_info exists only then
        if family.name.startswith(prefix):
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


# The series vLLM's Grafana dashboard (vllm-project/vllm, examples/observability/prometheus_grafana/
# grafana.json) queries, each selected by {model_name="$model_name"}.
VLLM_DASHBOARD_SERIES = {
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:inter_token_latency_seconds_bucket", "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:kv_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
}


def test_every_series_vllms_dashboard_queries_exists_with_its_model_name():
    assert VLLM_DASHBOARD_SERIES <= series_names(), VLLM_DASHBOARD_SERIES - series_names()
    for family in Metrics("router", "my-model").registry.collect():
        if family.name.startswith("vllm:"):
            assert all(s.labels["model_name"] == "my-model" for s in family.samples), family.name


def test_the_vllm_names_are_documented():
    text = (ROOT / "docs" / "metrics.md").read_text()
    listed = {re.fullmatch(r"\s*`([\w:]+)`\s*", line.split("|")[1])[1]
              for line in text.splitlines() if line.startswith("| `vllm:")}
    assert listed == set(exported("vllm:"))
