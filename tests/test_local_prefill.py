"""Local prefill (router/prefill_site.py): a disaggregated cluster's decode replica computing a prompt
itself. Its greedy output is the remote path's and the colocated engine's, token for token; while
no prefill replica can take a request (its worker SIGKILLed) every request is served by local
prefill instead of waiting, and the replacement takes prompts again once it serves; every block
goes back to the pool."""

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.messages import Request
from pdserve.protocol import SamplingParams
from pdserve.router.prefill_site import LOCAL, REMOTE, PrefillSite
from serving_cluster import Cluster

MODEL = "tiny-moe"
PROMPTS = ["the quick brown fox", "a lazy dog sleeps under the seven wizards' tree while", "hex"]
MAX_TOKENS = 12


def test_the_site_rule():
    site = PrefillSite(local_tokens=64)
    assert site.choose(64, prefill_can_take=True) == (LOCAL, "short")
    assert site.choose(65, prefill_can_take=True) == (REMOTE, "long")
    assert site.choose(10_000, prefill_can_take=False) == (LOCAL, "no_prefill")
    assert PrefillSite().choose(1, prefill_can_take=True) == (REMOTE, "long")  # 0, and no forecast: remote


def test_a_decode_engine_prefills_a_request_as_a_colocated_one_does():
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    out = {}
    for role in ("colocated", "decode"):
        e = Engine(EngineConfig(model=ModelConfig(path=MODEL), num_kv_blocks=64, role=role))
        for i, p in enumerate(PROMPTS):
            e.add(Request(f"r{i}", e.tokenize(p), params))
        done = {}
        while e.has_unfinished():
            for o in e.step():
                done.setdefault(o.request_id, []).extend(o.token_ids)
        out[role] = done
        assert e.pool.num_free_blocks == 64  # every block back
    assert out["decode"] == out["colocated"]


def complete(url: str, prompt: str) -> dict:
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0, "ignore_eos": True, "logprobs": 1}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def sites(c: Cluster) -> dict[tuple[str, str], float]:
    out = {}
    for line in c.metrics().splitlines():
        if line.startswith("pdserve_prefill_site_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            key = (labels["site"].strip('"'), labels["why"].strip('"'))
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """The same two replicas three times: prompts of up to 10,000 tokens prefilled locally; none
    (router.prefill_site: remote); and each where the forecast says (adaptive, the default)."""
    local = Cluster(tmp_path_factory.mktemp("local"), router={"local_prefill_tokens": 10_000},
                    kv_transfer={"lease_s": 30})
    remote = Cluster(tmp_path_factory.mktemp("remote"), router={"prefill_site": "remote"}, kv_transfer={"lease_s": 30})
    adaptive = Cluster(tmp_path_factory.mktemp("adaptive"), router={"prefill_site": "adaptive"},
                       kv_transfer={"lease_s": 30}, slo={"tpot_ms": 50})
    try:
        for c in (local, remote, adaptive):
            c.wait_ready()
        yield local, remote, adaptive
    finally:
        for c in (local, remote, adaptive):
            assert c.stop() == 0, c.output()


def test_local_and_remote_prefill_give_the_same_greedy_tokens_and_logprobs(clusters):
    local, remote, _ = clusters
    for p in PROMPTS:
        a, b = complete(local.url, p), complete(remote.url, p)
        assert a["text"] == b["text"], p
        la, lb = a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"]
        assert la == pytest.approx(lb, abs=1e-4), p
    assert sites(local).get((LOCAL, "short"), 0) >= len(PROMPTS) and not sites(local).get((REMOTE, "long"))
    assert sites(remote).get((REMOTE, "long"), 0) >= len(PROMPTS) and not sites(remote).get((LOCAL, "short"))
    for c in (local, remote):
        stats = c.wait_idle()
        assert stats and all(s["used"] == 0 for s in stats.values()), stats


def test_adaptive_chooses_by_forecast_and_gives_the_same_greedy_tokens(clusters):
    """Under concurrent requests of short and long prompts, the adaptive router asks its forecast
    (once both replicas have measured steps) and whatever site each request got, its tokens are the
    remote path's."""
    _, remote, adaptive = clusters
    prompts = [p * k for p in PROMPTS for k in (1, 40)]  # a few tokens, and hundreds
    expect = {p: complete(remote.url, p)["text"] for p in prompts}
    for _ in range(2):  # the first round measures both replicas' steps; the second forecasts from them
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = dict(zip(prompts, pool.map(lambda p: complete(adaptive.url, p)["text"], prompts)))
        assert got == expect
        time.sleep(1.5)  # (the routers' stats poll: 0.5 s)
    chosen = sites(adaptive)
    assert chosen.get((LOCAL, "sooner"), 0) + chosen.get((REMOTE, "sooner"), 0) >= len(prompts), chosen
    stats = adaptive.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats


def test_with_the_prefill_replica_killed_every_request_is_prefilled_locally(clusters):
    _, c, _ = clusters
    before = sites(c)
    results, errors, stop = [], [], threading.Event()

    def load():  # a steady stream of requests, each waited for to its end
        i = 0
        while not stop.is_set():
            try:
                results.append(complete(c.url, f"{PROMPTS[i % len(PROMPTS)]} {i}"))
            except Exception as e:  # noqa: BLE001 (any failure is the test's finding)
                errors.append(repr(e))
            i += 1
            time.sleep(0.1)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    try:
        time.sleep(1)
        os.kill(c.pid("pdserve-prefill-0"), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while c.replacements("pdserve-prefill-0") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)  # (until `pdserve up` says the replacement serves)
        assert c.replacements("pdserve-prefill-0") >= 1, c.output()
        time.sleep(3)  # the load runs on the replacement a while
    finally:
        stop.set()
        t.join(timeout=90)
    assert not errors, errors[:3]
    after = sites(c)
    assert after.get((LOCAL, "no_prefill"), 0) > before.get((LOCAL, "no_prefill"), 0), after  # while it was down
    # The replacement takes prompts again once paired: within 30 s (its pairing after it serves
    # takes a loaded host a few seconds; a request before that is prefilled locally).
    remote_after, deadline = after.get((REMOTE, "long"), 0), time.monotonic() + 30
    while sites(c).get((REMOTE, "long"), 0) == remote_after and time.monotonic() < deadline:
        complete(c.url, PROMPTS[0])
    assert sites(c).get((REMOTE, "long"), 0) > remote_after, sites(c)
    stats = c.wait_idle()
    assert stats and all(s["used"] == 0 for s in stats.values()), stats
