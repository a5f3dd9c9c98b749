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
        assert_padded_step_exact(e, pad, e.runner.prepare(scheduled), choice, gen)
        for i in range(len(lens)):
            e.abort(f"{k}-{i}")
    assert e.pool.num_free_blocks == idle
    assert pad.replays == {c: sum(1 for _, x in STEPS if x == c) for _, c in STEPS}


def assert_padded_step_exact(e: Engine, pad: PaddedPrefill, batch, choice, gen: torch.Generator) -> None:
    """The padded step gives the unpadded step's logits and writes the cache as it does, only there."""
    assert pad.choose(batch) == choice
    # A cache of random values: whatever a step writes, and only that, changes it (a cached prefix
    # is kept: the step reads it).
    keep = e.kv_cache.clone()
    before = torch.randn(e.kv_cache.shape, generator=gen).to(e.kv_cache.dtype)
    read = torch.zeros(e.kv_cache.shape[2], dtype=torch.bool)
    read[batch.block_tables.flatten()] = True
    before[:, :, read] = keep[:, :, read]
    e.kv_cache.copy_(before)
    want = e.model.compute_logits(e.model(batch)[batch.logits_indices])
    want_kv = e.kv_cache.clone()
    e.kv_cache.copy_(before)
    hidden = pad.run(batch, choice)
    assert hidden.shape[0] == choice[0]
    got = e.model.compute_logits(hidden[batch.logits_indices])
    assert got.shape == (len(batch.logits_indices), e.args.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    n = batch.query_start[-1]
    assert pad.slot_mapping[n:choice[0]].eq(-1).all()  # the padding's slots: nowhere
    # The same cache: the step's KV as the unpadded step wrote it (the CPU's GEMMs may round the
    # last bit of a row differently with more rows), nothing else touched.
    written = torch.zeros(e.kv_cache.shape[2] * e.kv_cache.shape[3], dtype=torch.bool)
    written[batch.slot_mapping] = True
    written = written.view(1, 1, *e.kv_cache.shape[2:4])
    assert torch.equal(e.kv_cache.view(torch.uint8)[:, :, ~written[0, 0]],
                       want_kv.view(torch.uint8)[:, :, ~written[0, 0]]), f"step {batch.query_lens}"
    assert_close_cache(e.kv_cache[:, :, written[0, 0]], want_kv[:, :, written[0, 0]])


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


@torch.inference_mode()
def test_steps_beyond_fresh_prompts_pad_as_varlen_and_are_exact():
    """A prompt whose prefix is cached, a decode row beside a prompt, a later chunk of a long prompt:
    `varlen` steps whose attention reads the cached keys through the block table, exactly as the
    unpadded step; with one prompt per graph (MLA's) they stay unpadded."""
    gen = torch.Generator().manual_seed(1)
    e = engine()
    pad = padded(e)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    e.generate([ids(40, 1)], SamplingParams(max_tokens=1))  # its first 32 tokens stay cached
    e.add_request("b", ids(40, 1) + ids(5, 2), greedy)
    scheduled = e.scheduler.schedule()
    assert scheduled[0].seq.num_cached_tokens == 32 and scheduled[0].num_new_tokens == 13
    batch = e.runner.prepare(scheduled)
    assert padded(e, max_seqs=1).choose(batch) is None
    assert_padded_step_exact(e, pad, batch, (32, VARLEN), gen)
    e.runner.launch(scheduled, None).result()
    for s in scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    e.abort("b")
    # A decoding row beside a prompt.
    e.add_request("c", ids(20, 3), greedy)
    e.step()
    e.add_request("d", ids(9, 4), greedy)
    scheduled = e.scheduler.schedule()
    assert sorted(s.num_new_tokens for s in scheduled) == [1, 9]
    assert_padded_step_exact(e, pad, e.runner.prepare(scheduled), (32, VARLEN), gen)
    for rid in ("c", "d"):
        e.abort(rid)
    # The second chunk of a prompt longer than a step's chunk.
    e = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=64, max_num_seqs=8,
                            max_num_batched_tokens=128, chunk_size=16))
    pad = padded(e)
    e.add_request("long", ids(40, 5), greedy)
    first = e.scheduler.schedule()
    assert padded(e).choose(e.runner.prepare(first)) == (32, SINGLE)  # the first chunk: fresh
    e.runner.launch(first, None).result()
    first[0].seq.num_computed_tokens += 16
    second = e.scheduler.schedule()
    assert second[0].num_new_tokens == 16 and second[0].seq.num_computed_tokens == 16
    assert_padded_step_exact(e, pad, e.runner.prepare(second), (32, VARLEN), gen)


def test_a_prompt_beside_more_decoders_than_the_default_graph_holds_pads_exactly():
    """EngineConfig.prefill_graph_max_seqs raised: a step mixing a prompt into 36 decoders (more
    than the default 32 sequences) pads as `varlen` into a graph of 40 slots and is exact; the
    default's graphs leave it eager."""
    gen = torch.Generator().manual_seed(2)
    e = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=128, max_num_seqs=48,
                            max_num_batched_tokens=128, chunk_size=128))
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i in range(36):
        e.add_request(f"d{i}", ids(3, 20 + i), greedy)
    e.step()  # 36 prompts of 3 tokens: now they decode
    e.add_request("p", ids(9, 3), greedy)
    scheduled = e.scheduler.schedule()
    assert sorted(s.num_new_tokens for s in scheduled) == [1] * 36 + [9]
    batch = e.runner.prepare(scheduled)
    assert padded(e, buckets=[64], max_seqs=32).choose(batch) is None
    assert_padded_step_exact(e, padded(e, buckets=[64], max_seqs=40), batch, (64, VARLEN), gen)


def test_generation_with_cached_prefixes_and_decoders_through_the_padding_is_the_engines():
    """Prompts sharing cached prefixes, arriving while others decode: every step with a prompt in it
    padded (fresh or `varlen`), the same tokens and logprobs as an engine without the padding."""
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    shared = ids(33, 7)
    prompts = [shared + ids(n, i) for i, n in enumerate((3, 17, 30))]

    def run(e: Engine) -> list:
        out = e.generate([shared + ids(2, 9)], params)  # the prefix cached
        e.add_request("x", prompts[0], params)
        e.step()
        e.add_request("y", prompts[1], params)  # beside x's decoding
        e.step()
        e.add_request("z", prompts[2], params)
        done = {}
        while e.has_unfinished():
            for o in e.step():
                d = done.setdefault(o.request_id, [[], []])
                d[0] += o.token_ids
                d[1] += [lp.logprob for lp in o.logprobs or []]
        return out, done

    want_first, want = run(engine())
    e = engine()
    pad = e.runner.prefill_graphs = padded(e)
    got_first, got = run(e)
    assert got_first[0].token_ids == want_first[0].token_ids
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    for k in want:
        assert got[k][1] == pytest.approx(want[k][1], abs=1e-4)
    assert any(layout == VARLEN for _, layout in pad.replays), pad.replays


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
    bad.write_text("prefill: {prefill_graph_max_tokens: 512}\ncolocated: {prefill_graph_max_tokens: 1}\n"
                   "decode: {prefill_graph_max_tokens: 256}\n")
    with pytest.raises(ConfigError) as err:
        load_cluster_config(str(bad))
    assert "prefill.prefill_graph_max_tokens: 512 is not allowed" in str(err.value)  # gpus: 0
    assert "colocated.prefill_graph_max_tokens: 1 is not allowed" in str(err.value)
    assert "decode.prefill_graph_max_tokens: 256 is not allowed" in str(err.value)
    assert EngineConfig(device="cpu", prefill_graph_max_tokens=0).prefill_graph_max_tokens == 0
    cfg = ClusterConfig(prefill={"gpus": 1, "prefill_graph_max_tokens": 1024},
                        decode={"gpus": 1, "prefill_graph_max_tokens": 512},
                        colocated={"gpus": 1, "prefill_graph_max_tokens": 0})
    assert cfg.engine_config("prefill").prefill_graph_max_tokens == 1024
    assert cfg.engine_config("colocated").prefill_graph_max_tokens == 0
    # A decode replica computes prompts too (local prefill): its own key reaches its engine.
    assert cfg.engine_config("decode").prefill_graph_max_tokens == 512
    assert cfg.engine_config("decode").prefill_graph_max_seqs == 128  # the default
    cfg = ClusterConfig(decode={"gpus": 1, "prefill_graph_max_seqs": 256},
                        colocated={"gpus": 1, "prefill_graph_max_seqs": 64})
    assert cfg.engine_config("decode").prefill_graph_max_seqs == 256
    assert cfg.engine_config("colocated").prefill_graph_max_seqs == 64
    assert engine().runner.prefill_graphs is None  # on the CPU, by default: none


def test_every_role_replays_prefill_graphs_where_the_kernels_allow():
    """A decode replica's local prefills are prefill steps like any other: graphed on a GPU with the
    Triton kernels, as the other roles' (eager, a short prompt's step held a decode replica's thread
    ~40 ms on an H200). Not for expert- or tensor-parallel ranks, nor with graphs off."""
    from pdserve.engine.graph_capture import prefill_graph_tokens
    from pdserve.engine.prefill_graphs import DEFAULT_MAX_TOKENS

    triton = object()  # any backend but the torch reference's
    for role in ("prefill", "decode", "colocated"):
        c = EngineConfig(device="cuda", role=role, max_num_batched_tokens=8192)
        assert prefill_graph_tokens(c, torch.device("cuda"), None, triton, triton, None) == DEFAULT_MAX_TOKENS
        c = EngineConfig(device="cuda", role=role, prefill_graph_max_tokens=1024)
        assert prefill_graph_tokens(c, torch.device("cuda"), None, triton, triton, None) == 1024
        assert prefill_graph_tokens(c, torch.device("cuda"), object(), triton, triton, None) == 0  # TP
        assert prefill_graph_tokens(c, torch.device("cuda"), None, triton, triton, object()) == 0  # EP
        off = EngineConfig(device="cuda", role=role, cuda_graphs=False)
        assert prefill_graph_tokens(off, torch.device("cuda"), None, triton, triton, None) == 0
    assert engine().runner.prefill_graphs is None  # on the CPU, by default: none
