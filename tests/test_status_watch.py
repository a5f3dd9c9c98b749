"""`pdserve status --watch`: the windowed latency math on known histograms (no cluster), and the live
view against a real `pdserve up`, its output piped, stopped with Ctrl-C; then another, which ends by
itself, saying so, once `pdserve down` took the cluster away."""

import math
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from prometheus_client import generate_latest

from pdserve.cluster_view import (TPOT, TTFT, Snapshot, Window, combine, difference, latency, parse_metrics, percentile,
                                  replica_snapshots, router_urls)
from pdserve.control.watch import Gone, Unanswered, call, gcs_answers, render_text, slo_mark, view
from pdserve.messages import ReplicaStats
from pdserve.router.metrics import Metrics
from serving_cluster import Cluster, until


def test_percentile_interpolates_inside_the_bucket():
    buckets = {0.1: 0, 0.2: 10, 0.5: 20, math.inf: 20}
    assert percentile(buckets, 0.5) == 0.2
    assert math.isclose(percentile(buckets, 0.9), 0.2 + 0.3 * 8 / 10)
    assert percentile({0.1: 0, math.inf: 0}, 0.5) is None
    # Beyond the last finite bound: that bound, as histogram_quantile says.
    assert percentile({0.1: 1, 1.0: 1, math.inf: 10}, 0.9) == 1.0


def test_the_window_is_the_difference_of_two_scrapes():
    old = Snapshot({TTFT: {0.1: 5, 0.2: 5, 0.5: 10, math.inf: 10}}, requests=10)
    new = Snapshot({TTFT: {0.1: 5, 0.2: 15, 0.5: 30, math.inf: 30}}, requests=40)
    w = difference(new, old)
    assert w.histograms[TTFT] == {0.1: 0, 0.2: 10, 0.5: 20, math.inf: 20} and w.requests == 30
    lat = latency(w, 60.0)
    assert lat.requests_per_s == 0.5
    assert lat.ttft_p50 == 0.2 and math.isclose(lat.ttft_p90, 0.44)
    assert lat.tpot_p50 is None
    # A router that restarted counts from zero again: all it counted since is in the window.
    assert difference(Snapshot({TTFT: {0.1: 1, math.inf: 1}}, 1), old).requests == 1


def _router_metrics(ttfts, itls, requests):
    m = Metrics("r")
    for v in ttfts:
        m.ttft.observe(v)
    for v in itls:
        m.itl.observe(v)
    for _ in range(requests):
        m.count_request("/v1/completions", 200)
    return m


def test_two_routers_add_up_over_the_window():
    # The router's real metrics, through the text a scrape reads: the names cluster_view.py reads are the router's.
    a, b = _router_metrics([0.03] * 2, [0.004] * 10, 2), _router_metrics([0.03] * 2, [], 2)
    w = Window(window_s=60)
    w.add(0.0, {"http://a": parse_metrics(generate_latest(a.registry).decode()),
                "http://b": parse_metrics(generate_latest(b.registry).decode())})
    assert w.latency() is None  # one scrape: nothing to difference yet
    for _ in range(10):  # 10 more requests at each router, TTFT in (0.025, 0.05]
        a.ttft.observe(0.04), b.ttft.observe(0.04)
        a.count_request("/v1/completions", 200), b.count_request("/v1/chat/completions", 200)
    a.itl.observe(0.007)
    w.add(10.0, {"http://a": parse_metrics(generate_latest(a.registry).decode()),
                 "http://b": parse_metrics(generate_latest(b.registry).decode())})
    lat = w.latency()
    assert lat.window_s == 10 and lat.requests_per_s == 2.0  # 20 requests in 10 s
    assert math.isclose(lat.ttft_p50, 0.025 + 0.025 * 10 / 20) and math.isclose(lat.ttft_p90, 0.025 + 0.025 * 18 / 20)
    assert math.isclose(lat.tpot_p90, 0.005 + 0.005 * 0.9)  # the one inter-token latency in the window, in (0.005, 0.01]
    # Summed bucket by bucket, as combine() does for the window.
    both = combine([Snapshot({TPOT: {0.01: 1, math.inf: 1}}, 1), Snapshot({TPOT: {0.01: 2, math.inf: 3}}, 2)])
    assert both.histograms[TPOT] == {0.01: 3, math.inf: 4} and both.requests == 3


def test_the_window_keeps_at_most_a_minute():
    w = Window(window_s=60)
    for t in range(0, 100, 10):
        w.add(float(t), {"u": Snapshot({}, requests=t)})
    assert w.scrapes[0][0] == 30 and w.latency().window_s == 60 and w.latency().requests_per_s == 1.0


def test_the_prefix_hit_rate_is_over_the_window_and_survives_a_replacement():
    def status(**profiles):
        return {"replicas": {name: ReplicaStats(name, "prefill", 0, 0, 10, 10, 0, profile=p) for name, p in
                             profiles.items()} | {"pdserve-prefill-9": "down: its process died"}}

    w = Window(window_s=60)
    w.add(0.0, replica_snapshots(status(a={"prefix_queries": 1000, "prefix_hits": 900})))
    w.add(10.0, replica_snapshots(status(a={"prefix_queries": 1200, "prefix_hits": 950},
                                         b={"prefix_queries": 100, "prefix_hits": 50})))
    assert w.latency().prefix_hit_rate == (50 + 50) / (200 + 100)  # the window's lookups, not since the start
    # a replaced (counts from 0 again): all it counted since is in the window
    w.add(20.0, replica_snapshots(status(a={"prefix_queries": 100, "prefix_hits": 0},
                                         b={"prefix_queries": 300, "prefix_hits": 150})))
    assert w.latency().prefix_hit_rate == (0 + 150) / (100 + 300)
    assert w.latency().requests_per_s == 0 and w.latency().ttft_p50 is None  # replicas add no requests
    assert "prefix cache hit rate 38%" in render_text(view({"state": "running", "replicas": {}}, w.latency()))
    assert Window().latency() is None and latency(Snapshot(), 1.0).prefix_hit_rate is None


def test_a_p90_above_the_slo_is_marked():
    assert slo_mark(0.25, 200) == "BREACH"
    assert slo_mark(0.15, 200) == "ok"
    assert slo_mark(None, 200) == "" and slo_mark(0.25, None) == ""
    status = {"state": "degraded", "slo": {"ttft_ms": 100, "tpot_ms": 50},
              "replicas": {"pdserve-colocated-0": ReplicaStats("pdserve-colocated-0", "colocated", 2, 1, 30, 100, 0),
                           "pdserve-colocated-1": "down: process died; a replacement is starting"},
              "routers": {"pdserve-router-0": {"pid": 42, "in_flight": 3, "endpoints": {"http": "http://h:1"}}},
              "restarts": {"pdserve-colocated-1": 2}, "endpoints": {"http": "http://h:1"}}
    assert router_urls(status) == ["http://h:1"]
    text = render_text(view(status, latency(Snapshot({TTFT: {0.1: 0, 0.25: 10, math.inf: 10},
                                                      TPOT: {0.01: 10, math.inf: 10}}, 10), 5.0)))
    lines = text.splitlines()
    assert lines[0].startswith("state: degraded")
    assert any(ln.split()[:7] == ["colocated", "pdserve-colocated-0", "serving", "0", "2", "1", "70/100"] for ln in lines)
    assert any("pdserve-colocated-1" in ln and "down: process died" in ln and " 2 " in ln for ln in lines)
    assert any(ln.split()[:4] == ["pdserve-router-0", "42", "serving", "3"] for ln in lines)
    assert "2.00 requests/s" in text
    ttft = next(ln for ln in lines if ln.startswith("TTFT"))
    tpot = next(ln for ln in lines if ln.startswith("TPOT"))
    assert ttft.endswith("BREACH") and "100 ms" in ttft  # p90 235 ms against 100 ms
    assert tpot.endswith("ok") and "9.0 ms" in tpot  # p90 9 ms against 50 ms


def _watch(cluster: Cluster, interval: float) -> tuple[subprocess.Popen, list[str], threading.Thread]:
    """`pdserve status --watch` of the cluster, its stdout read as it comes (into the list)."""
    watch = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "status", "--watch", "--interval", str(interval),
                              "--address", cluster.up.ray_address()],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(watch.stdout), daemon=True)
    reader.start()
    return watch, out, reader


def test_watch_shows_replicas_and_latency_until_ctrl_c_and_ends_once_the_cluster_is_down(tmp_path):
    cluster = Cluster(tmp_path, colocated={"replicas": 1})
    try:
        cluster.wait_ready()
        watch, out, reader = _watch(cluster, 0.5)
        body = {"model": "tiny-moe", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
                "ignore_eos": True}
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:  # requests until a TTFT figure shows
            assert httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=60).status_code == 200
            if any(ln.startswith("TTFT") and ln.split()[1] != "-" for ln in list(out)):
                break
            time.sleep(0.3)
        time.sleep(1)
        watch.send_signal(signal.SIGINT)
        rc = watch.wait(timeout=30)
        reader.join(timeout=10)
        err = watch.stderr.read()
        text = "".join(out)
        assert rc == 0, err
        assert "Traceback" not in err, err
        assert "state: running" in text and f"dashboard: {cluster.url}/dashboard" in text, text
        assert any(ln.split()[:3] == ["colocated", "pdserve-colocated-0", "serving"] for ln in text.splitlines()), text
        ttft = [ln.split() for ln in text.splitlines() if ln.startswith("TTFT")]
        assert any(f[1] != "-" and f[2] == "ms" for f in ttft), text  # a p50 figure, in ms
        assert "requests/s" in text and "1000 ms" in text  # against the default slo.ttft_ms

        # Issue 37: after `pdserve down` the watch went on showing "running" for a minute, then Ray
        # ended it. Now it sees the cluster go within its interval, says so, and exits 1.
        watch, out, reader = _watch(cluster, 1)
        until(lambda: any(ln.startswith("state: running") for ln in list(out)), 30, "the watch's first view")
        down = cluster.cli("down", timeout=120)
        assert down.returncode == 0, down.stderr
        try:
            rc = watch.wait(timeout=10)
        except subprocess.TimeoutExpired:
            watch.kill()
            raise AssertionError(f"the watch still ran 10 s after `pdserve down`:\n{''.join(out)}") from None
        reader.join(timeout=10)
        err = watch.stderr.read()
        assert rc == 1, err
        assert "the cluster is gone" in err and "`pdserve up` starts one" in err, err
        assert "Traceback" not in err and "Failed to connect to GCS" not in err, err
        assert cluster.proc.wait(timeout=60) == 0, cluster.output()  # `pdserve up` ends by itself after down
    finally:
        assert cluster.stop() == 0, cluster.output()


def _reuse_port_socket(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    return s


def test_the_gcs_is_asked_by_tcp_and_a_call_is_waited_on_with_a_deadline():
    hung = threading.Event()  # a Ray call that never returns (until set, at the end: its threads end)
    # The "GCS": a listener on port 0 (any free one), beside a socket bound to the same port that
    # never listens: once the listener closes, connections are refused and the port stays ours (no
    # other test can take it and answer in its place).
    with _reuse_port_socket() as holder:
        port = holder.getsockname()[1]
        gcs = f"127.0.0.1:{port}"
        server = _reuse_port_socket(port)
        server.listen()
        assert gcs_answers(gcs)
        assert call(lambda: 42, time.monotonic() + 5, gcs, 0.1) == 42
        with pytest.raises(ZeroDivisionError):  # the call's own error, raised here
            call(lambda: 1 / 0, time.monotonic() + 5, gcs, 0.1)
        t0 = time.monotonic()
        with pytest.raises(Unanswered):
            call(hung.wait, time.monotonic() + 0.5, gcs, 0.1)
        assert time.monotonic() - t0 < 2
        threading.Timer(0.3, server.close).start()  # the GCS goes while the call hangs
        t0 = time.monotonic()
        with pytest.raises(Gone, match=gcs):
            call(hung.wait, time.monotonic() + 30, gcs, 0.1)
        assert time.monotonic() - t0 < 2
        assert not gcs_answers(gcs) and not gcs_answers("not-an-address")
    hung.set()


def test_the_terminal_view_draws_the_same_rows():
    from rich.console import Console

    from pdserve.control.watch import render_rich

    status = {"state": "running", "slo": {"ttft_ms": 100, "tpot_ms": 50},
              "replicas": {"pdserve-decode-0": ReplicaStats("pdserve-decode-0", "decode", 1, 0, 90, 100, 0),
                           "pdserve-prefill-0": "draining"},
              "routers": {}, "restarts": {}, "endpoints": {}}
    console = Console(record=True, width=120, force_terminal=True)
    console.print(render_rich(view(status, None)))
    text = console.export_text()
    assert "pdserve-decode-0" in text and "10/100" in text and "draining" in text and "collecting" in text
