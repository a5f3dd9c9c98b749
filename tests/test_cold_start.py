"""`pdserve up` on a checkpoint written by `pdserve write-checkpoint`, its prefill replica tensor
parallel (2 ranks, each reading its slice of the files): it serves what one unsharded engine
computes from the same files, and its progress says what the start took (Ray, each worker's
weights in GB/s, the handshake, the routers, the checkpoint's prefetch), in lines the cold-start
benchmark reads."""

import re

import httpx

from pdserve.benchmarks.cold_start import parse_up
from pdserve.cli import main as cli
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from serving_cluster import Cluster


def test_up_serves_a_written_checkpoint_and_says_what_its_start_took(tmp_path):
    ck = tmp_path / "tiny-moe"
    assert cli(["write-checkpoint", "tiny-moe", str(ck), "--dtype", "float32", "--shard-size", "10MB"]) == 0
    c = Cluster(tmp_path, model={"path": str(ck)}, prefill={"replicas": 1, "tp_size": 2})
    try:
        c.wait_ready()
        model = httpx.get(f"{c.url}/v1/models", timeout=10).json()["data"][0]["id"]
        prompt = "Once upon a time"
        r = httpx.post(f"{c.url}/v1/completions", timeout=60,
                       json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        engine = Engine(EngineConfig(model=ModelConfig(path=str(ck)), num_kv_blocks=64))
        assert r.json()["choices"][0]["text"] == engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].text
    finally:
        assert c.stop() == 0, c.output()
    out = c.output()
    parts = parse_up(out)
    for key in ("ray_s", "workers_s", "handshake_s", "routers_s", "up_s"):
        assert parts[key] >= 0, (key, out)
    assert parts["up_s"] >= parts["ray_s"] + parts["workers_s"]
    workers = {w["name"]: w for w in parts["workers"]}
    assert sorted(workers) == ["pdserve-decode-0", "pdserve-prefill-0", "pdserve-prefill-0-tp1"], out
    assert workers["pdserve-decode-0"]["weights_gb"] == 0.03
    for w in parts["workers"]:  # (a TP rank skips the other rank's rows where they are long enough)
        assert w["source"] == "from 3 files" and 0 < w["weights_gb"] <= 0.03, w
        assert w["weights_gb_per_s"] > 0 and w["weights_s"] <= w["model_s"] <= w["engine_s"] <= w["ready_s"]
        assert w["graphs_s"] is None  # CPU: no CUDA graphs
    assert re.search(r"\] Ray started in [\d.]+ s[;\n]", out) and "ready; Ctrl-C stops everything" in out
    # the files were read into the page cache while Ray started (model.prefetch, on by default)
    assert "prefetching the checkpoint into the page cache while Ray starts: 0.03 of 0.03 GB (3 of 3 files" in out, out
    assert parts["prefetch_s"] >= 0, out
