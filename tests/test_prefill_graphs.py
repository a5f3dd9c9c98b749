"""Steps of fresh prompts padded to a token bucket (pdserve/engine/prefill_graphs.py), on the CPU.

The GPU replays a CUDA graph of the padded step; here `PaddedPrefill` runs the same padding eagerly:
for prompts crossing the bucket edges, one prompt or several, GQA (tiny-moe, an FP8 cache too) and
MLA (DeepSeek-V2), the padded step gives the unpadded step's logits and leaves the KV cache exactly
as it does (padding writes nowhere); generation through it is the engine's; a prefill engine's layer
hook still hears of every layer. The graphs themselves: tests/test_gpu_engine.py.
"""

import pytest
import torch
from pydantic import ValidationError

from hf_checkpoints import checkpoint_path
from pdserve.config import ClusterConfig, ConfigError, EngineConfig, ModelConfig, load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.engine.prefill_graphs import SINGLE, VARLEN, PaddedPrefill, prefill_buckets
from pdserve.protocol import SamplingParams

BUCKETS = [8, 32, 64]
# (prompt lengths of one step, the bucket and layout it pads to): every bucket edge crossed.
STEPS = [([2], (8, SINGLE)), ([7], (8, SINGLE)), ([8], (8, SINGLE)), ([9], (32, SINGLE)),
         ([32], (32, SINGLE)), ([33], (64, SINGLE)), ([64], (64, SINGLE)),
         ([3, 5], (8, VARLEN)), ([3, 6], (32, VARLEN)), ([20, 12, 1], (64, VARLEN)),
         ([10, 10, 10, 10], (64, VARLEN))]


def engine(path: str = "tiny-moe", **kw) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path=path, **kw), num_kv_blocks=64, max_num_seqs=8,
                               max_num_batched_tokens=128, chunk_size=128))


def padded(e: Engine, buckets=BUCKETS, max_seqs: int = 4) -> PaddedPrefill:
    return PaddedPrefill(e.model, e.kv_cache, e.layout.scales, buckets, max_seqs, e.device)


def ids(n: int, salt: int) -> list[int]:
    return [3 + (salt * 37 + i * 11) % 120 for i in range(n)]


@torch.inference_mode()
def check_padding_is_exact(e: Engine) -> None:
    pad = padded(e)
    idle = e.pool.num_free_blocks
    gen = torch.Generator().manual_seed(0)
    for k, (lens, choice) in enumerate(STEPS):
        for i, n in enumerate(lens):
            e.add_request(f"{k}-{i}", ids(n, 10 * k + i), SamplingParams(max_tokens=1))
        scheduled = e.scheduler.schedule()
        assert [s.num_new_tokens for s in scheduled] == lens
        batch = e.runner.prepare(scheduled)
        assert pad.choose(batch) == choice
        # A cache of random values: whatever a step writes, and only that, changes it.
        before = torch.randn(e.kv_cache.shape, generator=gen).to(e.kv_cache.dtype)
        e.kv_cache.copy_(before)
        want = e.model.compute_logits(e.model(batch)[batch.logits_indices])
        want_kv = e.kv_cache.clone()
        e.kv_cache.copy_(before)
        hidden = pad.run(batch, choice)
        assert hidden.shape[0] == choice[0]
        got = e.model.compute_logits(hidden[batch.logits_indices])
        assert got.shape == (len(lens), e.args.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        n = sum(lens)
        assert pad.slot_mapping[n:choice[0]].eq(-1).all()  # the padding's slots: nowhere
        # The same cache: the prompts' KV as the unpadded step wrote it (the CPU's GEMMs may round
        # the last bit of a row differently with more rows), nothing else touched.
        written = torch.zeros(e.kv_cache.shape[2] * e.kv_cache.shape[3], dtype=torch.bool)
        written[batch.slot_mapping] = True
        written = written.view(1, 1, *e.kv_cache.shape[2:4])
        assert torch.equal(e.kv_cache.view(torch.uint8)[:, :, ~written[0, 0]],
                           want_kv.view(torch.uint8)[:, :, ~written[0, 0]]), f"step {lens}"
        assert_close_cache(e.kv_cache[:, :, written[0, 0]], want_kv[:, :, written[0, 0]])
        for i in range(len(lens)):
            e.abort(f"{k}-{i}")
    assert e.pool.num_free_blocks == idle
    assert pad.replays == {c: sum(1 for _, x in STEPS if x == c) for _, c in STEPS}


def assert_close_cache(got: torch.Tensor, want: torch.Tensor) -> None:
    """Cache entries alike: float32 to rounding; FP8 to one step of its 3-bit mantissa (a float32
    ulp apart before quantizing can round to neighbouring FP8 values), and nearly all equal."""
    if got.dtype != torch.float8_e4m3fn:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), rtol=0.07, atol=2 ** -9)
    assert (got.view(torch.uint8) != want.view(torch.uint8)).float().mean() < 0.01


def test_buckets_and_the_steps_they_take():
    assert prefill_buckets(2048) == [128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert prefill_buckets(1000) == [128, 256, 384, 512, 768, 1000] and prefill_buckets(64) == [64]
    assert prefill_buckets(4096)[-8:] == [2304, 2560, 2816, 3072, 3328, 3584, 3840, 4096]
    assert prefill_buckets(5000)[-3:] == [4096, 4608, 5000]
    pad = padded(engine())
    assert pad.shape(8, 1) == (8, SINGLE) and pad.shape(9, 1) == (32, SINGLE)
    assert pad.shape(9, 2) == (32, VARLEN) and pad.shape(64, 4) == (64, VARLEN)
    assert pad.shape(4, 4) is None  # one token per prompt: decode-shaped
    assert pad.shape(65, 1) is None  # larger than the largest bucket: eager
    assert pad.shape(40, 5) is None  # more prompts than a graph holds: eager


def test_padded_step_equals_unpadded_gqa():
    check_padding_is_exact(engine())


def test_padded_step_equals_unpadded_fp8_cache():
    e = engine(kv_cache_dtype="fp8_e4m3")
    assert e.kv_cache.dtype == torch.float8_e4m3fn
    check_padding_is_exact(e)


def test_padded_step_equals_unpadded_mla(tmp_path):
    e = engine(str(checkpoint_path("deepseek_v2", tmp_path)))
    assert e.layout.kind == "latent"
    check_padding_is_exact(e)


def test_only_fresh_prompt_steps_are_padded():
    """A chunk after a cached prefix and a decode row beside a prompt run unpadded."""
    e = engine()
    pad = e.runner.prefill_graphs = padded(e)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    e.add_request("a", ids(40, 1), params)
    e.step()  # fresh: padded to 64
    e.add_request("b", ids(40, 1) + ids(5, 2), params)  # its first 32 tokens are cached
    e.step()  # a's decode row beside b's chunk after its prefix
    while e.has_unfinished():
        e.step()
    assert pad.replays == {(64, SINGLE): 1}


def test_generation_through_the_padding_is_the_engines():
    """Steps of one and of several fresh prompts padded, decode and later chunks not: the same
    tokens and logprobs as an engine without it."""
    prompts = [ids(n, i) for i, n in enumerate((5, 9, 31, 2, 60, 17))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    want = engine().generate(prompts, params)
    e = engine()
    pad = e.runner.prefill_graphs = padded(e)
    # One prompt (5 tokens: 8), three (42: 64), two (77: more than the largest bucket, eager).
    got = e.generate(prompts[:1], params) + e.generate(prompts[1:4], params) + e.generate(prompts[4:], params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
    assert pad.replays == {(8, SINGLE): 1, (64, VARLEN): 1}


def test_a_padded_prefill_step_calls_the_layer_hook_for_every_layer():
    """Layer-wise KV streaming: a replayed step has no layer boundaries, so the hook hears of every
    layer, in order, once the step is queued."""
    e = Engine(EngineConfig(role="prefill", num_kv_blocks=64, max_num_batched_tokens=128, chunk_size=128))
    pad = e.runner.prefill_graphs = padded(e)
    heard = []
    e.layer_hook = lambda layer, scheduled: heard.append((layer, [s.seq.request_id for s in scheduled]))
    e.add_request("p", ids(20, 3), SamplingParams(max_tokens=1))
    out, = e.step()
    assert out.finished and out.kv_block_ids
    assert heard == [(layer, ["p"]) for layer in range(e.args.num_layers)]
    assert pad.replays == {(32, SINGLE): 1}
    e.release("p")


def test_prefill_graph_max_tokens_errors_name_the_key(tmp_path):
    with pytest.raises(ValidationError, match="prefill_graph_max_tokens") as err:
        EngineConfig(device="cpu", prefill_graph_max_tokens=512)
    assert "needs a GPU" in str(err.value)
    with pytest.raises(ValidationError, match="prefill_graph_max_tokens") as err:
        EngineConfig(device="cuda", prefill_graph_max_tokens=1)
    assert "0 (off) or at least 2" in str(err.value)
    with pytest.raises(ValidationError, match="prefill_graph_max_tokens"):
        EngineConfig(device="cuda", prefill_graph_max_tokens=-1)
    bad = tmp_path / "cluster.yaml"
    bad.write_text("prefill: {prefill_graph_max_tokens: 512}\ncolocated: {prefill_graph_max_tokens: 1}\n")
    with pytest.raises(ConfigError) as err:
        load_cluster_config(str(bad))
    assert "prefill.prefill_graph_max_tokens: 512 is not allowed" in str(err.value)  # gpus: 0
    assert "colocated.prefill_graph_max_tokens: 1 is not allowed" in str(err.value)
    assert EngineConfig(device="cpu", prefill_graph_max_tokens=0).prefill_graph_max_tokens == 0
    cfg = ClusterConfig(prefill={"gpus": 1, "prefill_graph_max_tokens": 1024},
                        decode={"gpus": 1}, colocated={"gpus": 1, "prefill_graph_max_tokens": 0})
    assert cfg.engine_config("prefill").prefill_graph_max_tokens == 1024
    assert cfg.engine_config("colocated").prefill_graph_max_tokens == 0
    assert cfg.engine_config("decode").prefill_graph_max_tokens is None  # the decode role prefills nothing
    assert engine().runner.prefill_graphs is None  # on the CPU, by default: none
