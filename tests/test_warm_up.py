"""Warm-up before ready (pdserve/engine/warm_up.py): it covers every step shape the scheduler
produces for a workload, leaves nothing behind, and runs before a served replica is ready."""

import random

import httpx
import pytest

from pdserve.messages import Request
from pdserve.config import ClusterConfig, EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.engine.warm_up import signature, warm_up
from pdserve.protocol import SamplingParams
from serving_cluster import Cluster

# Small limits: the script's widest steps stay cheap on a CPU, and chunking happens.
LIMITS = dict(num_kv_blocks=256, max_num_seqs=24, max_num_batched_tokens=160, chunk_size=96)


def engine(role: str) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), role=role, **LIMITS))


def workload_shapes(e: Engine, rng: random.Random, tag: str, steps: int = 100) -> set[tuple]:
    """A random workload's step signatures: requests arriving at random steps with prompts of 1-150
    tokens, some sharing a prefix, 1-6 tokens each (decode role: reservations started at once, and
    every third a local prefill, its prompt computed beside them)."""
    shapes, prefixes, n = set(), [], 0
    for _ in range(steps):
        for _ in range(rng.choice((0,) * 12 + (1, 1, 2, 3, 16, 17))):  # mostly quiet, now and then a burst
            n += 1
            ids = [rng.randrange(3, 250) for _ in range(rng.choice((1, 2, 15, 16, 17, rng.randint(1, 150))))]
            if prefixes and rng.random() < 0.3:
                ids = rng.choice(prefixes) + ids[:40]
            elif len(ids) >= 32:
                prefixes.append(ids[:32])
            params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=0, ignore_eos=True)
            if e.config.role == "decode" and n % 3:
                if e.reserve(Request(f"{tag}-{n}", ids, params)) is not None:
                    e.start_decode(f"{tag}-{n}", 5)
            else:
                e.add_request(f"{tag}-{n}", ids, params)
        scheduled = e.scheduler.schedule()
        if scheduled:
            shapes.add(signature(e, scheduled))
        e.step(scheduled)
        if e.config.role == "prefill":
            for rid in [r for r, s in e.seqs.items() if s.finish_reason is not None or s.status.name == "PREFILLED"]:
                e.release(rid)
    return shapes


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_warm_up_covers_every_shape_a_random_workload_steps(role):
    e = engine(role)
    warmed = warm_up(e)
    seen = set()
    for seed in range(2):
        seen |= workload_shapes(e, random.Random(seed), f"s{seed}")
    assert len(seen) >= (5 if role == "decode" else 8), seen  # the workload is varied enough to mean something
    if role == "decode":
        assert any(s[0] == "paged" for s in seen), seen  # local prompts' chunks beside decoders
    assert seen <= warmed.shapes, f"steps the warm-up never ran: {sorted(seen - warmed.shapes)}"


@pytest.mark.parametrize("role", ["colocated", "prefill"])
def test_warm_up_covers_the_prefill_graphs(role):
    """With fresh-prompt steps padded to token buckets (what PrefillGraphs replays on a GPU; here
    PaddedPrefill, the same padding run eagerly): every bucket and layout a step can reach is run
    before ready, and a random workload makes no step the warm-up did not."""
    from pdserve.engine.prefill_graphs import SINGLE, VARLEN, PaddedPrefill

    e = engine(role)
    pad = e.runner.prefill_graphs = PaddedPrefill(e.model, e.kv_cache, e.layout.scales, [32, 64], 4, e.device)
    warmed = warm_up(e)
    graphed = {("fresh", "graph", b, layout) for b in (32, 64) for layout in (SINGLE, VARLEN)}
    assert graphed <= warmed.shapes
    assert set(pad.replays) == {(b, layout) for _, _, b, layout in graphed}
    seen = set()
    for seed in range(3):
        seen |= workload_shapes(e, random.Random(seed), f"s{seed}")
    assert seen & graphed and any(s[0] == "fresh" and s[1] != "graph" for s in seen), seen  # both kinds met
    assert seen <= warmed.shapes, f"steps the warm-up never ran: {sorted(seen - warmed.shapes)}"


def test_warm_up_leaves_nothing_behind():
    e = engine("colocated")
    lines = []
    warmed = warm_up(e, lines.append)
    assert warmed.steps > 20 and not e.seqs and not e.scheduler.running and not e.scheduler.waiting
    assert e.pool.num_free_blocks == e.pool.num_blocks and not e.pool.cached  # no prefix of its prompts cached
    snap = e.profile.snapshot()  # the planner must not count warm-up steps as traffic
    assert snap["busy_s"] == 0 and snap["prefill"] == snap["decode"] == {} and snap["prefix_queries"] == 0
    assert lines[0].startswith("warm-up 1/") and lines[-1].startswith(f"warm-up: {warmed.steps} steps of "
                                                                        f"{len(warmed.shapes)} shapes")
    # The engine serves as before: greedy output equals a fresh engine's.
    params = SamplingParams(max_tokens=8, temperature=0)
    got = e.generate([[5, 6, 7, 8, 9]], params)[0].token_ids
    assert got == engine("colocated").generate([[5, 6, 7, 8, 9]], params)[0].token_ids


def test_warm_up_is_on_by_default_only_where_kernels_compile():
    cfg = ClusterConfig()
    assert cfg.engine_config("prefill").warm_up is None  # None: on a GPU (EngineWorker._warm_up), off on a CPU
    cfg = ClusterConfig(prefill={"warm_up": True}, decode={"warm_up": False})
    assert cfg.engine_config("prefill").warm_up is True and cfg.engine_config("decode").warm_up is False


def test_a_served_replica_is_ready_only_after_its_warm_up(tmp_path):
    c = Cluster(tmp_path, colocated={"replicas": 1, "warm_up": True, "num_kv_blocks": 256, "max_num_seqs": 24,
                                     "max_batch_tokens": 160, "chunk_size": 96})
    try:
        c.wait_ready()
        out = c.output()
        warmed = out.index("pdserve-colocated-0: warm-up: ")  # its last line: steps and shapes
        assert out.index("pdserve-colocated-0: warm-up 1/") < warmed < out.index("pdserve-colocated-0 ready")
        r = httpx.post(f"{c.url}/v1/completions", json={"model": "tiny-moe", "prompt": [5, 6, 7], "max_tokens": 4,
                                                         "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert "KV blocks used 0/256" in c.status()  # nothing of the warm-up holds a block
    finally:
        c.stop()


def test_fresh_prompts_padded_to_few_lengths_attend_exactly():
    """Fresh prompts' SDPA runs at lengths padded to FRESH_BUCKET (few plans to build before ready):
    every real row equals attention over the prompt alone, GQA included."""
    import torch
    import torch.nn.functional as F

    from pdserve.ops.triton_attention import FRESH_BUCKET, _fresh_prompts

    torch.manual_seed(0)
    lens = [1, 5, FRESH_BUCKET - 1, FRESH_BUCKET, FRESH_BUCKET + 1, 300]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    q, k, v = torch.randn(starts[-1], 8, 16), torch.randn(starts[-1], 2, 16), torch.randn(starts[-1], 2, 16)
    got = _fresh_prompts(q, k, v, starts, 0.25)
    for a, b in zip(starts, starts[1:]):
        ref = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                             is_causal=True, scale=0.25, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(got[a:b], ref, rtol=1e-5, atol=1e-6)


def test_warm_up_prompts_stay_inside_a_small_vocabulary(tmp_path):
    # A tiny checkpoint's vocabulary (128 ids): every warm-up prompt is one the engine accepts.
    from hf_checkpoints import checkpoint_path

    e = Engine(EngineConfig(model=ModelConfig(path=str(checkpoint_path("qwen3_moe", tmp_path)), dtype="float32"),
                            num_kv_blocks=256))
    assert e.args.vocab_size == 128
    assert warm_up(e).steps > 20 and e.pool.num_free_blocks == e.pool.num_blocks
