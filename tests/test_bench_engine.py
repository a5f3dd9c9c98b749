"""`pdserve bench-engine` as a dry run on the CPU: every part runs and every figure is there.

The figures themselves mean nothing here; the GPU run is what docs/benchmarks.md reports.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from pdserve.benchmarks.bench_engine import ModelCost
from pdserve.models import ModelArgs, resolve_model_args
from pdserve.models.loader import MODEL_CLASSES, load_model

PREFILL_KEYS = {"tokens", "ms", "tok_s", "TFLOP_s", "MFU_pct", "TFLOP"}
DECODE_KEYS = {"batch", "context", "step_ms", "tok_s", "experts_per_layer", "experts_uniform", "weights_GB",
               "experts_GB", "kv_GB", "GB_s", "roofline_pct", "roofline_tok_s"}


def _positive(row: dict, keys: set[str]) -> None:
    assert keys <= row.keys(), keys - row.keys()
    for k in keys:
        assert row[k] > 0, (k, row)


def test_cpu_dry_run_reports_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    # One thread: on a loaded 2-core machine, OpenMP threads spinning against each other cost seconds.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench-engine", "--model", "tiny-moe", "--device", "cpu",
         "--prefill-sizes", "32", "64", "--decode-batches", "1", "2", "--context", "32", "--reps", "1",
         "--decode-steps", "2", "--hf-steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert res["ceilings"]["hbm_copy_GB_s"] > 0 and res["ceilings"]["matmul_TFLOP_s"] > 0
    assert res["meta"]["model"] == "tiny-moe" and res["meta"]["total_params"] > 0

    for side in (res["engine_prefill"]["rows"], res["hf"]["prefill"]):
        assert [x["tokens"] for x in side] == [32, 64]
        for row in side:
            _positive(row, PREFILL_KEYS)
    for side in (res["engine_decode"]["rows"], res["hf"]["decode"]):
        assert [x["batch"] for x in side] == [1, 2]
        for row in side:
            _positive(row, DECODE_KEYS)
            assert row["experts_source"] == "counted"  # the router hooks fired on both models
            assert 2 <= row["experts_per_layer"] <= min(8, 2 * row["batch"])  # tiny-moe: top-2 of 8
    assert res["engine_decode"]["backends"] == {"attn": "TorchAttention", "moe": "TorchMoE"}
    assert "prefill" in r.stdout and "HF roofl %" in r.stdout  # the table at the end


def test_cpu_dry_run_of_a_deepseek_shape(tmp_path):
    """Multi-head Latent Attention through every part, against transformers' DeepseekV2ForCausalLM
    of the same shape; the decode bytes count the latent cache (kv_lora_rank + qk_rope_head_dim
    per token and layer), not K and V per head."""
    from hf_checkpoints import checkpoint_path

    path = checkpoint_path("deepseek_v2", tmp_path)
    out = tmp_path / "bench.json"
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench-engine", "--model", str(path), "--device", "cpu",
         "--prefill-sizes", "32", "--decode-batches", "2", "--context", "32", "--reps", "1",
         "--decode-steps", "2", "--hf-steps", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["errors"] == []
    assert res["meta"]["kv_bytes_per_token"] == 3 * (32 + 8) * 4  # 3 layers, float32 latents
    assert "DeepseekV2ForCausalLM" in r.stdout  # the HF baseline built
    for side in (res["engine_prefill"]["rows"], res["hf"]["prefill"]):
        assert [x["tokens"] for x in side] == [32]
        _positive(side[0], PREFILL_KEYS)
    for side in (res["engine_decode"]["rows"], res["hf"]["decode"]):
        row, = side
        _positive(row, DECODE_KEYS)
        assert row["kv_GB"] == pytest.approx(2 * row["context"] * 3 * 40 * 4 / 1e9, rel=1e-3)
    assert res["hf"]["decode"][0]["experts_source"] == "counted"  # HF's router returns its top-k ids


def test_cost_model_counts_every_parameter():
    model, args = load_model("tiny-moe", torch.float32, "cpu")
    assert ModelCost(args, 4).total_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch,extra", [
    ("DeepseekV2ForCausalLM", dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1)),
    ("DeepseekV3ForCausalLM", dict(q_lora_rank=24, attention_bias=True, n_group=2, topk_group=1)),
])
def test_cost_model_counts_every_parameter_of_mla_models(arch, extra):
    """Multi-head Latent Attention's projections and norms, ungated shared experts, V3's routing bias."""
    cfg = dict(architectures=[arch], vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
               intermediate_size=48, max_position_embeddings=64, kv_lora_rank=16, qk_nope_head_dim=8,
               qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, n_shared_experts=2, num_experts_per_tok=2,
               moe_intermediate_size=12, first_k_dense_replace=1, **extra)
    args = ModelArgs.from_hf_config(cfg)
    with torch.device("meta"):
        model = MODEL_CLASSES[arch](args)
    cost = ModelCost(args, 2)
    assert cost.total_params() == sum(p.numel() for p in model.parameters())
    assert cost.kv_bytes_per_token() == 3 * (16 + 4) * 2  # one latent per layer, no V
    lite = ModelCost(resolve_model_args("deepseek-v2-lite"), 2)
    assert 15.6e9 < lite.total_params() < 15.8e9  # DeepSeek's "15.7B"


def test_cost_model_of_qwen3_30b_a3b():
    cost = ModelCost(resolve_model_args("qwen3-30b-a3b"), 2)
    assert 30.4e9 < cost.total_params() < 30.6e9  # "30.5B"
    assert 3.2e9 < cost.active_params_per_token() + 2 * cost.lm_head_params < 3.4e9  # "A3B": 3.3B activated
    assert cost.kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2
    # Batch 1 reads the weights outside the experts plus 8 experts per layer: about 6.1 GB.
    assert cost.decode_bytes(1, 1024, 8)["total"] == pytest.approx(6.18e9, rel=0.01)
    assert cost.uniform_experts_hit(1) == pytest.approx(8)
    assert cost.uniform_experts_hit(256) == pytest.approx(128, rel=0.01)


def test_in_process_light_load_benchmarks_run_on_the_cpu(tmp_path):
    """cached_prefix (a prompt fresh, then again with its prefix cached) and after_load (a light load
    before and after a heavy one) on tiny-moe: every figure they print is there."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: tiny-moe}\ncolocated: {replicas: 1, gpus: 0}\n")
    out = tmp_path / "cached.json"
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.cached_prefix", str(cfg), "--reps", "2",
                        "--gap-s", "0", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert len(res["fresh_ms"]) == len(res["cached_ms"]) == 2 and res["cached_over_fresh"] > 0
    out = tmp_path / "after.json"
    r = subprocess.run([sys.executable, "-m", "pdserve.benchmarks.after_load", str(cfg), "--reps", "2", "--gap-s", "0",
                        "--heavy", "8", "--concurrency", "4", "--len", "16", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["fresh"]["first_token_ms_p50"] > 0 and res["after"]["step_ms_p50"] > 0 and res["heavy"]["seconds"] >= 0
