"""FP8 KV cache (`model.kv_cache_dtype: fp8_e4m3`): config, the torch path's exact semantics, greedy
output against the unquantized cache, disaggregated = colocated over NIXL and TCP, the handshake.

The oracles: a float32 cache holding K/V rounded through FP8 (the FP8 cache must give bit for bit
the same attention and generation: it adds nothing but the rounding); the unquantized engine
(greedy equal for 16 tokens where its logits have no near-tie); colocated generation with an FP8
cache for the disaggregated runs. The Triton kernels' FP8 paths are in tests/test_gpu_kernels.py.
"""

import math

import pytest
import torch

from hf_checkpoints import build_checkpoint, checkpoint_path, clear_prompts, write_tokenizer
from kv_pair import assert_staged, assert_staging_idle, start_pair
from pdserve.config import ConfigError, EngineConfig, ModelConfig, load_cluster_config
from pdserve.engine.engine import Engine
from pdserve.forward.forward_batch import ForwardBatch
from pdserve.forward.kv_cache import FP8, KVLayout, allocate_kv_cache
from pdserve.kvtransfer.metadata import HandshakeError, KVAgentMetadata, accept_peer
from pdserve.models import resolve_model_args
from pdserve.models.loader import load_model
from pdserve.ops.attention import TorchAttention
from pdserve.ops.kv_quant import round_trip
from pdserve.ops.testing import random_paged_case
from pdserve.protocol import SamplingParams

SCALES = (0.5, 2.0)  # (k, v) per layer: neither 1 nor equal, so a scale missed or swapped shows


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> str:
    """The tiny DeepSeek-V2 checkpoint of the HF parity tests (Multi-head Latent Attention), with a tokenizer."""
    ck = build_checkpoint("deepseek_v2", tmp_path_factory.mktemp("fp8"))
    write_tokenizer(ck.path, ck.hf_model.config.vocab_size)
    return str(ck.path)


# -- config -------------------------------------------------------------------------------------------

def test_kv_cache_dtype_is_validated_naming_the_key(tmp_path):
    assert ModelConfig().kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match=r"kv_cache_dtype\n.*Input should be 'auto' or 'fp8_e4m3'"):
        ModelConfig(kv_cache_dtype="fp8")
    f = tmp_path / "cluster.yaml"
    f.write_text("model:\n  kv_cache_dtype: int8\n")
    with pytest.raises(ConfigError, match=r"model.kv_cache_dtype: 'int8' is not allowed — Input should be "
                                          r"'auto' or 'fp8_e4m3'"):
        load_cluster_config(str(f))
    f.write_text("model:\n  kv_cache_dtype: fp8_e4m3\n")
    cfg = load_cluster_config(str(f))
    assert all(cfg.engine_config(r).model.kv_cache_dtype == "fp8_e4m3" for r in ("prefill", "decode"))


# -- bytes ----------------------------------------------------------------------------------------------

def test_fp8_halves_bf16_bytes_per_token():
    """A token's KV in bytes, for the GPU shapes: FP8 is half of bfloat16 (a quarter of float32),
    for a K/V cache (Qwen3-30B-A3B: 48 layers x K, V x 4 heads x 128) and a latent one
    (DeepSeek-V2-Lite: 27 layers x 512 + 64)."""
    want = {"qwen3-30b-a3b": 48 * 2 * 4 * 128, "deepseek-v2-lite": 27 * (512 + 64)}  # values per token
    for preset, values in want.items():
        args = resolve_model_args(preset)
        per_token = {dt: KVLayout.for_model(args, 8, 16, dt).bytes_per_token
                     for dt in (torch.float32, torch.bfloat16, FP8)}
        assert per_token == {torch.float32: 4 * values, torch.bfloat16: 2 * values, FP8: values}, preset


def test_an_fp8_engine_fits_four_times_the_float32_tokens():
    """The same kv_cache_gb holds 4x the blocks of a float32 cache (CPU), each block a quarter the bytes."""
    engines = {d: Engine(EngineConfig(model=ModelConfig(path="tiny-moe", kv_cache_dtype=d), kv_cache_gb=0.01))
               for d in ("auto", "fp8_e4m3")}
    f32, f8 = engines["auto"].layout, engines["fp8_e4m3"].layout
    assert f8.dtype == FP8 and engines["fp8_e4m3"].kv_cache.dtype == FP8 and f32.dtype == torch.float32
    assert f8.bytes_per_block * 4 == f32.bytes_per_block and f8.num_blocks // 4 == f32.num_blocks  # (floored)
    assert f8.scales == ((1.0, 1.0),) * f8.num_layers  # the static scale rule (kv_cache.py)


# -- the torch path is FP8 rounding and nothing else ---------------------------------------------------

def test_gqa_attention_over_fp8_equals_a_float32_cache_of_rounded_kv():
    """TorchAttention over an FP8 cache (scales 0.5, 2.0) gives bit for bit what it gives over a
    float32 cache holding the same K/V rounded through FP8, for prefill chunks after a cached
    prefix, fresh prompts and decode rows in one step; the cache holds the rounded values."""
    g = torch.Generator().manual_seed(5)
    seqs = [(33, 33), (40, 7), (16, 16), (50, 16), (9, 1), (17, 1)]
    case = random_paged_case(seqs, 8, 2, 32, 16, torch.float32, "cpu", g, cache_dtype=FP8, kv_scales=SCALES)
    fp8 = case.ref_batch
    ref = ForwardBatch(**{**fp8.__dict__, "kv_cache": _dequantized(fp8.kv_cache, [SCALES]), "kv_scales": ()})
    k_rt, v_rt = round_trip(case.k, SCALES[0]), round_trip(case.v, SCALES[1])
    assert not torch.equal(k_rt, case.k)  # the rounding is real
    out_ref = TorchAttention().forward(0, case.q, k_rt, v_rt, ref, 0.2)
    out = TorchAttention().forward(0, case.q, case.k, case.v, fp8, 0.2)
    assert torch.equal(out, out_ref)
    assert torch.equal(_dequantized(fp8.kv_cache, [SCALES]), ref.kv_cache)


def test_mla_attention_over_fp8_equals_a_float32_cache_of_rounded_latents(deepseek):
    """The same for Multi-head Latent Attention (DeepSeek-V2's layer, its own kv_b_proj): the latent
    plane stored as FP8 through its scale, up-projected from the dequantized latents."""
    model, args = load_model(deepseek, torch.float32, "cpu", attn_backend=TorchAttention())
    attn = model.layers[0].self_attn
    g = torch.Generator().manual_seed(6)
    seqs = [(20, 20), (30, 5), (17, 1)]
    _, _, heads, dim = args.kv_cache_entry()
    case = random_paged_case(seqs, 2, heads, dim, 16, torch.float32, "cpu", g, cache_dtype=FP8,
                             kv_scales=SCALES)  # K/V planes: the latent is plane 0, scale 0.5
    scale = SCALES[0]
    fp8 = ForwardBatch(**{**case.ref_batch.__dict__, "kv_cache": case.ref_batch.kv_cache[:, :1].contiguous(),
                          "kv_scales": ((scale,),)})
    ref = ForwardBatch(**{**fp8.__dict__, "kv_cache": _dequantized(fp8.kv_cache, [(scale,)]), "kv_scales": ()})
    t = case.q.shape[0]
    q = torch.randn(t, args.num_heads, args.qk_nope_head_dim + args.qk_rope_head_dim, generator=g)
    latent = torch.randn(t, dim, generator=g) * 3
    out_ref = TorchAttention().forward_mla(0, q, round_trip(latent, scale), ref, attn.scale, attn)
    out = TorchAttention().forward_mla(0, q, latent, fp8, attn.scale, attn)
    assert torch.equal(out, out_ref)
    assert torch.equal(_dequantized(fp8.kv_cache, [(scale,)]), ref.kv_cache)


def _dequantized(cache: torch.Tensor, scales) -> torch.Tensor:
    """An FP8 cache [layers, planes, ...] as float32 values: stored x scale, per layer and plane."""
    s = torch.tensor(scales, dtype=torch.float32).view(*cache.shape[:2], *[1] * (cache.dim() - 2))
    return cache.float() * s


# -- greedy output ------------------------------------------------------------------------------------------

NEW_TOKENS = 16


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 50, 200)]


def _engine(path: str, kv_cache_dtype: str, **kw) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path=path, kv_cache_dtype=kv_cache_dtype), num_kv_blocks=128, **kw))


class RoundedKVAttention(TorchAttention):
    """The oracle for the FP8 engine: the torch reference over a float32 cache, every K/V (or
    latent) rounded through FP8 at the engine's scale, 1, before it is written."""

    def forward(self, layer, q, k, v, batch, scale):
        return super().forward(layer, q, round_trip(k, 1.0), round_trip(v, 1.0), batch, scale)

    def forward_mla(self, layer, q, latent, batch, scale, attn):
        return super().forward_mla(layer, q, round_trip(latent, 1.0), batch, scale, attn)


@pytest.mark.parametrize("model", ["tiny-moe", "deepseek_v2"])
def test_fp8_engine_equals_a_float32_engine_of_rounded_kv(model, deepseek):
    """N = every token, and every logprob bit for bit: the FP8 engine generates exactly what a
    float32 engine does whose attention rounds each K/V (DeepSeek: each latent) through FP8 before
    caching it — the FP8 cache, its scales and every path that reads it (prefill chunks after a
    prefix, decode rows, the prefix cache on a second run) add nothing but that rounding. Small
    token budget: steps mix prompt chunks with decode rows."""
    path, vocab = ("tiny-moe", 256) if model == "tiny-moe" else (deepseek, 128)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    budget = dict(max_num_batched_tokens=64, chunk_size=40)
    oracle = _engine(path, "auto", **budget)
    attention = [m for m in oracle.model.modules() if isinstance(getattr(m, "backend", None), TorchAttention)]
    assert len(attention) == oracle.args.num_layers
    for module in attention:  # the reference backend of every attention layer, rounding
        module.backend = RoundedKVAttention()
    fp8 = _engine(path, "fp8_e4m3", **budget)
    idle = fp8.pool.num_free_blocks
    for _ in range(2):  # the second run reads its prompts' full blocks from the prefix cache
        want, got = oracle.generate(_prompts(vocab), params), fp8.generate(_prompts(vocab), params)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [[lp.logprob for lp in c.logprobs] for c in got] == [[lp.logprob for lp in c.logprobs] for c in want]
        assert fp8.pool.num_free_blocks == idle


@pytest.mark.parametrize("family", ["qwen3", "deepseek_v2"])
def test_fp8_greedy_equals_the_unquantized_cache_for_16_tokens(family, tmp_path):
    """Greedy with an FP8 cache equals the float32 reference (the same engine caching float32) for
    the first N = 16 tokens of 8 prompts — the 8 of 48 whose reference continuation stays clear of
    near-ties (its two best tokens at least 0.2 nats apart at every step) — on sharp checkpoints
    (tests/hf_checkpoints.py: a strong embedding path sets a leader, attention still moves the
    choice): a dense GQA model (Qwen3) and Multi-head Latent Attention (DeepSeek-V2, dense layers).

    Why N is bounded by near-ties: FP8 keeps 3 mantissa bits (each cached value within 6 %), which
    moves the logits by up to about 0.3 nats on these tiny models; where the reference's two best
    tokens stand closer, either may come out, and from there the texts differ. On plain random
    weights (logits a median 0.05 nats apart, tiny-moe) FP8 and float32 agreed for 0 to 32 of 32
    tokens, prompt by prompt; on these sharp ones, for all 16 tokens of 39 (Qwen3) and 35
    (DeepSeek-V2) of the 48 prompts, and of every one of the 8 clearest. MoE layers are left out:
    a routing decision that flips moves the logits by nats, which is the model's, not the cache's.
    The exact oracle, for every token, is the rounded-float32 engine above."""
    overrides = {"first_k_dense_replace": 3} if family == "deepseek_v2" else {}
    path = str(checkpoint_path(family, tmp_path, sharp=True, **overrides))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 128, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
               for _ in range(48)]
    clear, want = clear_prompts(_engine(path, "auto"), prompts, n=8, tokens=16, min_margin=0.2)
    fp8 = _engine(path, "fp8_e4m3")
    idle = fp8.pool.num_free_blocks
    got = fp8.generate(clear, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert [c.token_ids for c in got] == want
    assert fp8.pool.num_free_blocks == idle


# -- disaggregated: FP8 bytes moved as they are -----------------------------------------------------------

PAIR_PROMPT_LENS = [1, 15, 16, 17, 200]
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("backend,model,fragment", [
    ("nixl", "tiny-moe", False), ("nixl", "tiny-moe", True), ("nixl", "tiny-moe", "scattered"),
    ("tcp", "tiny-moe", False), ("nixl", "deepseek_v2", False)],
    ids=["nixl-tiny-moe", "nixl-tiny-moe-fragmented", "nixl-tiny-moe-scattered", "tcp-tiny-moe",
         "nixl-deepseek_v2"])
def test_disaggregated_fp8_equals_colocated_fp8(backend, model, fragment, deepseek):
    """Prefill and decode in two processes, both FP8, over a real backend: the decode side continues
    exactly as a colocated FP8 engine does (the bytes land as they were written, scales agreed in
    the handshake), each request moved 1 byte per cached value — half of bfloat16, a quarter of
    float32 — and both pools come back idle."""
    path, vocab = ("tiny-moe", 256) if model == "tiny-moe" else (deepseek, 128)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PAIR_PROMPT_LENS]
    colocated = Engine(EngineConfig(model=ModelConfig(path=path, kv_cache_dtype="fp8_e4m3"), num_kv_blocks=160))
    want = [c.token_ids for c in colocated.generate(prompts, SamplingParams(**GREEDY))]
    layout = colocated.layout
    values_per_token = layout.num_layers * layout.num_planes * layout.num_kv_heads * layout.head_dim
    p, d = start_pair(backend, fragment=fragment, model=path, kv_cache_dtype="fp8_e4m3")
    try:
        for i, prompt in enumerate(prompts):
            handle = d.call("reserve", f"r{i}", prompt, GREEDY, 30.0, None)
            p.call("prefill", f"r{i}", prompt, GREEDY, handle)
        presults, pfree, pidle = p.call("run", 60)
        dresults, dfree, didle = d.call("run", 60)
        assert presults == {f"r{i}": True for i in range(len(prompts))}
        assert [dresults[f"r{i}"] for i in range(len(prompts))] == want
        assert pfree == pidle and dfree == didle
        moved = sorted(nbytes for nbytes, _ in p.call("delivered"))
        # A prompt's blocks move whole: bytes = blocks x block_size x (1 byte per value).
        blocks = sorted(math.ceil(len(q) / layout.block_size) for q in prompts)
        assert moved == [b * layout.block_size * values_per_token for b in blocks]
        assert layout.bytes_per_token == values_per_token  # float32 would be 4x, bfloat16 2x
        if backend == "nixl":  # the FP8 bytes through the staging slots as they are
            assert_staged(p, d, fragment)
        assert_staging_idle(p, d)
    finally:
        p.stop()
        d.stop()


# -- the handshake --------------------------------------------------------------------------------------

def _meta(name: str, dtype: torch.dtype, scales=()) -> KVAgentMetadata:
    layout = KVLayout(2, 8, 4, 2, 8, dtype, scales=scales)
    return KVAgentMetadata.for_cache(name, "nixl", allocate_kv_cache(layout, torch.device("cpu")), layout, "tiny")


def test_the_handshake_refuses_another_kv_cache_dtype_by_name():
    """An FP8 prefill and a float32 (or bfloat16) decode never exchange blocks: refused both ways,
    naming kv_cache_dtype (and the block size in bytes it changes); scales are not compared across dtypes."""
    fp8, f32, bf16 = _meta("fp8", FP8), _meta("f32", torch.float32), _meta("bf16", torch.bfloat16)
    with pytest.raises(HandshakeError, match=r"kv_cache_dtype: ours 'float8_e4m3fn', peer 'f32' has 'float32'"
                                             r"; bytes_per_block: ours 64, peer 'f32' has 256$"):
        accept_peer(fp8, f32.pack())
    with pytest.raises(HandshakeError, match=r"kv_cache_dtype: ours 'bfloat16', peer 'fp8' has 'float8_e4m3fn'"):
        accept_peer(bf16, fp8.pack())
    assert accept_peer(fp8, _meta("fp8-peer", FP8).pack()).kv_scales == [[1.0, 1.0], [1.0, 1.0]]


def test_the_handshake_refuses_other_fp8_scales_by_name():
    """Two FP8 caches whose scales differ would read each other's bytes wrong: refused, naming kv_scales."""
    ours = _meta("a", FP8)
    theirs = _meta("b", FP8, scales=((1.0, 1.0), (0.5, 1.0)))
    with pytest.raises(HandshakeError, match=r"^KV handshake refused — kv_scales: ours \[\[1.0, 1.0\], \[1.0, 1.0\]\], "
                                             r"peer 'b' has \[\[1.0, 1.0\], \[0.5, 1.0\]\]$"):
        accept_peer(ours, theirs.pack())
