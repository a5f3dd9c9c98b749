"""The router's /dashboard: its JSON over the in-process app (no controller there: what the router
itself knows), the prefix-cache counters, and the page in real headless Chromium (Debian's, driven
by Playwright) against a cluster started through `pdserve up`, its charts updating under load."""

import os
import sys
import threading
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.messages import ReplicaStats
from pdserve.router.http_api import build_app
from pdserve.router.metrics import Metrics
from pdserve.router.core import RouterCore
from local_core import LocalCore, Served
from serving_cluster import Cluster

ROOT = Path(__file__).resolve().parents[1]
STATIC = ROOT / "router" / "static"
CHROMIUM = "/usr/bin/chromium"  # Debian's package (.ci/run installs it): Playwright's own download cannot run here
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ROUTER = "pdserve-router-test"
# Long enough for several full KV blocks (16 tokens each) that every request shares: prefix-cache hits.
SHARED_PREFIX = "The dashboard shows what the operators tune: " * 3


@pytest.fixture(scope="module")
def app_url():
    """The HTTP app over an engine in this process, as test_http_api.py serves it: no Ray, no controller."""
    core = LocalCore(Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=256)), "tiny-moe")
    served = Served(build_app(core, Metrics(ROUTER)))
    try:
        yield served.url
    finally:
        served.stop()
        core.close()


def stream_completion(url: str, prompt: str, max_tokens: int = 8) -> None:
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert any(line == "data: [DONE]" for line in r.iter_lines())


def test_data_without_a_controller_is_what_the_router_knows(app_url):
    first = httpx.get(f"{app_url}/dashboard/data", timeout=10).json()
    assert first["source"] == "router" and first["router"] == ROUTER and first["state"] == "running"
    assert first["replicas"] == []  # a LocalCore polls no replicas
    assert first["routers"] == [{"name": ROUTER, "health": "serving", "restarts": 0, "pid": os.getpid(),
                                 "streaming": 0}]
    assert first["latency"] is None and first["slo"] == {}  # one sample: nothing to difference yet
    for i in range(3):
        stream_completion(app_url, f"request {i}")
    time.sleep(1.1)  # past the one-sample-a-second limit
    d = httpx.get(f"{app_url}/dashboard/data", timeout=10).json()
    lat = d["latency"]
    assert d["time"] > first["time"] and lat["window_s"] > 1
    assert lat["requests_per_s"] == pytest.approx(3 / lat["window_s"])  # the router's own /metrics, differenced
    assert lat["ttft_p50"] > 0 and lat["ttft_p90"] >= lat["ttft_p50"] and lat["tpot_p50"] > 0
    assert lat["prefix_hit_rate"] is None  # no replica reported a prefix-cache lookup


def test_the_page_and_its_files_are_served_from_the_package(app_url):
    page = httpx.get(f"{app_url}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("uPlot.iife.min.js", "uPlot.min.css", "dashboard.js", "dashboard.css"):
        assert f'"dashboard/static/{name}"' in page.text
        r = httpx.get(f"{app_url}/dashboard/static/{name}", timeout=10)
        assert r.status_code == 200 and r.content == (STATIC / name).read_bytes()
    assert "http" not in page.text.split("<body>", 1)[1]  # nothing from a CDN: the page works offline
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()
    # An installed package has them: setuptools ships router/static/ as pdserve.router's data.
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "static/*" in data["pdserve.router"]


def test_prefix_cache_counters_follow_the_replicas_cumulative_tokens():
    metrics = Metrics("r")
    core = RouterCore("r", "tiny-moe", 64, None, [], "kv-aware", metrics)

    def stats(queries: int, hits: int) -> ReplicaStats:
        return ReplicaStats("pdserve-prefill-0", "prefill", 0, 0, 10, 10, 0,
                            profile={"prefix_queries": queries, "prefix_hits": hits})

    core.replicas.record(stats(100, 0), None)
    core.replicas.record(stats(250, 96), stats(100, 0))
    core.replicas.record(stats(40, 16), None)  # a replacement counts from 0 again: its first report is all new

    def value(name: str) -> float:
        return metrics.registry.get_sample_value(name, {"replica": "pdserve-prefill-0"})

    assert value("pdserve_prefix_cache_queries_total") == 290
    assert value("pdserve_prefix_cache_hits_total") == 112


def test_internal_refusals_follow_the_replicas_cumulative_counts():
    metrics = Metrics("r")
    core = RouterCore("r", "tiny-moe", 64, None, [], "kv-aware", metrics)

    def stats(refusals: dict) -> ReplicaStats:
        return ReplicaStats("pdserve-decode-0", "decode", 0, 0, 10, 10, 0, refusals=refusals)

    first = stats({"router_channel": {"not_a_router": 2}})
    core.replicas.record(first, None)
    core.replicas.record(stats({"router_channel": {"not_a_router": 3, "bad_mac": 1}, "kv_tcp": {"not_a_peer": 5}}),
                         first)
    core.replicas.record(stats({"kv_notices": {"foreign": 1}}), None)  # a replacement's first report: all new

    def value(endpoint: str, reason: str) -> float | None:
        return metrics.registry.get_sample_value("pdserve_internal_refusals_total", {
            "replica": "pdserve-decode-0", "endpoint": endpoint, "reason": reason})

    assert [value("router_channel", "not_a_router"), value("router_channel", "bad_mac"), value("kv_tcp", "not_a_peer"),
            value("kv_notices", "foreign"), value("kv_tcp", "bad_mac")] == [3, 1, 5, 1, None]


# -- the page in a browser, against a real cluster ------------------------------------------------------


def sync_playwright_or_skip():
    """Playwright's entry point, or a skip saying how to install what is missing; in CI a failure."""
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("Playwright (pip install -e '.[test]')")
    if not os.path.exists(CHROMIUM):
        missing.append(f"Debian's chromium at {CHROMIUM} (apt-get install -y chromium; .ci/run installs it)")
    if missing:
        why = "the dashboard's browser test needs " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return sync_playwright


def test_a_missing_browser_fails_in_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", str(ROOT / "no-such-chromium"))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="apt-get install -y chromium"):
        sync_playwright_or_skip()
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        sync_playwright_or_skip()


def test_the_page_draws_the_cluster_and_its_charts_update_under_load(tmp_path):
    sync_playwright = sync_playwright_or_skip()
    cluster = Cluster(tmp_path, kv_transfer={"backend": "tcp"})
    stop = threading.Event()
    try:
        cluster.wait_ready()
        with sync_playwright() as pw:
            browser = pw.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), headless=True,
                                                            executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{cluster.url}/dashboard")
            page.wait_for_function("window.pdserve && window.pdserve.polls >= 1", timeout=20_000)
            last = page.evaluate("window.pdserve.last")
            assert last["source"] == "controller", last  # the cluster's status, from the controller
            assert {(r["name"], r["health"]) for r in last["replicas"]} == {
                ("pdserve-prefill-0", "serving"), ("pdserve-decode-0", "serving")}
            assert (last["slo"]["ttft_ms"], last["slo"]["tpot_ms"]) == (1000, 100)  # the config's defaults
            routers = int(os.environ.get("PDSERVE_TEST_ROUTERS", "1"))  # (serving_cluster.py may start several)
            assert page.locator("#replicas tbody tr").count() == 2
            assert page.locator("#routers tbody tr").count() == routers
            charts = ["ttft", "tpot", "rps", "hits", "running", "waiting", "kv"]
            assert page.evaluate("Object.keys(window.pdserve.charts).sort()") == sorted(charts)
            assert page.locator(".uplot canvas").count() == len(charts)
            before = page.evaluate("window.pdserve.charts.rps.data[0].length")

            def load(worker: int) -> None:  # streaming requests sharing a prefix, until told to stop (at most 200)
                for i in range(100):
                    if stop.is_set():
                        return
                    stream_completion(cluster.url, f"{SHARED_PREFIX}request {worker}.{i}")

            threads = [threading.Thread(target=load, args=(w,), daemon=True) for w in range(2)]
            for t in threads:
                t.start()
            # The figures over the last minute fill in: requests/s above 0, a TTFT and TPOT p50, a hit rate.
            page.wait_for_function("""(() => { const l = window.pdserve.last.latency;
                return l && l.requests_per_s > 0 && l.ttft_p50 !== null && l.tpot_p50 !== null
                       && l.prefix_hit_rate > 0; })()""", timeout=40_000)
            page.wait_for_function(f"window.pdserve.charts.rps.data[0].length >= {before + 3}", timeout=20_000)
            plotted = page.evaluate("window.pdserve.charts.rps.data[1]")
            assert max(v for v in plotted if v is not None) > 0  # the requests/s line rose
            assert float(page.locator("#rps").inner_text()) > 0
            ttft = page.evaluate("window.pdserve.charts.ttft.series.map(s => s.label)")
            assert ttft[1:] == ["p50", "p90", "SLO"]  # the SLO line drawn against the percentiles
            (ROOT / "test-artifacts").mkdir(exist_ok=True)
            page.screenshot(path=str(ROOT / "test-artifacts" / "dashboard.png"), full_page=True)
            assert not errors, errors
            browser.close()
        stop.set()
        for t in threads:
            t.join(timeout=60)
        # The replicas' prefix-cache lookups in /metrics too (tokens, as vLLM counts them). Summed over
        # replicas, as the dashboard's hit rate is: the adaptive prefill site computes a prompt at the
        # prefill replica or, when its forecast first token is sooner there, at the decode replica.
        text = cluster.metrics()
        hits = {ln.split(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                if ln.startswith("pdserve_prefix_cache_hits_total{")}
        assert set(hits) <= {'pdserve_prefix_cache_hits_total{replica="pdserve-prefill-0"}',
                             'pdserve_prefix_cache_hits_total{replica="pdserve-decode-0"}'}, hits
        assert sum(hits.values()) > 0, text
    finally:
        stop.set()
        assert cluster.stop() == 0, cluster.output()
