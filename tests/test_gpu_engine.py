"""The engine's GPU path (Triton kernels, CUDA graphs) against its CPU reference; skipped without CUDA.

- float32 on the GPU (Triton kernels, CUDA graphs) equals the float32 CPU reference;
- bf16 on the GPU agrees with the float32 CPU reference for the first 16 greedy tokens of 8
  prompts whose reference continuation has no near-tie (non-degenerate);
- an FP8 KV cache on the GPU gives the CPU's FP8 output on prompts clear of near-ties;
- decode steps replayed from CUDA graphs equal the same steps run eagerly, token for token, while
  the batch shrinks through the buckets (padded rows) and prefills mix with decodes;
- DeepSeek-V2 and V3 (Multi-head Latent Attention: absorbed decode kernel with its fused latent
  write, expanded prefill chunks; routing in one launch, the shared experts folded into the
  routed experts' kernels) on the Triton backends equal the torch backends on the CPU, with and
  without CUDA graphs, over a float32 or an FP8 latent cache;
- steps of fresh prompts replayed from the prefill graph of their token bucket (one prompt, or
  several) equal the same steps run eagerly, GQA and MLA, bfloat16 and FP8 caches included; the
  warm-up replays every such graph; a decode replica's local prefills replay them too.

    python -m pytest -q tests/test_gpu_engine.py -k mla      (the DeepSeek ones)
"""

import pytest
import torch

from hf_checkpoints import checkpoint_path as checkpoint, clear_prompts
from pdserve.config import EngineConfig, ModelConfig
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu")


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (int(torch.randint(3, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def engine(path, device: str, dtype: str, kv_cache_dtype: str = "auto", **kw) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path=str(path), dtype=dtype, kv_cache_dtype=kv_cache_dtype),
                               device=device, num_kv_blocks=128, max_num_batched_tokens=64, chunk_size=32, **kw))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gpu_float32_greedy_equals_cpu(family, root):
    """Same dtype, different kernels (Triton, CUDA graphs): the same tokens."""
    path = checkpoint(family, root)
    ps = prompts(8, seed=11)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    want = [c.token_ids for c in engine(path, "cpu", "float32").generate(ps, params)]
    gpu = engine(path, "cuda:0", "float32")
    assert gpu.runner.graphs is not None, "decode steps should replay CUDA graphs on a GPU"
    idle = gpu.pool.num_free_blocks
    assert [c.token_ids for c in gpu.generate(ps, params)] == want
    assert gpu.pool.num_free_blocks == idle


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_gpu_bf16_greedy_matches_cpu_float32(family, root):
    path = checkpoint(family, root, sharp=True)
    ps, want = clear_prompts(engine(path, "cpu", "float32"), prompts(48, seed=11), n=8, tokens=16, min_margin=0.25)
    gpu = engine(path, "cuda:0", "bfloat16")
    got = [c.token_ids for c in gpu.generate(ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    assert got == want


# (family, prompts, min margin): FP8 K/V, or FP8 latents (MLA: fewer tiny-model prompts clear the margin).
FP8_CASES = [("qwen3", 8, 0.2), ("deepseek_v2", 6, 0.15), ("deepseek_v3", 6, 0.15)]


@pytest.mark.parametrize("family,n,margin", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_gpu_fp8_cache_greedy_matches_cpu(family, n, margin, root):
    """An FP8 KV cache on the GPU (Triton's write, decode with its fused write, prefill kernels;
    for MLA the latent write and every path reading FP8 latents; the scales in CUDA graphs) against
    the CPU reference caching FP8: the same rounding, so the same 16 tokens on prompts clear of
    near-ties (a value the two sides compute a float32 ulp apart can still round to neighbouring
    FP8 values)."""
    path = checkpoint(family, root, sharp=True)
    cpu = engine(path, "cpu", "float32", "fp8_e4m3")
    ps, want = clear_prompts(cpu, prompts(48, seed=11), n=n, tokens=16, min_margin=margin)
    gpu = engine(path, "cuda:0", "float32", "fp8_e4m3")
    assert gpu.runner.graphs is not None and gpu.kv_cache.dtype == torch.float8_e4m3fn
    idle = gpu.pool.num_free_blocks
    got = [c.token_ids for c in gpu.generate(ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    assert got == want
    assert gpu.pool.num_free_blocks == idle


def test_cuda_graphs_equal_eager(root):
    path = checkpoint("qwen3_moe", root)
    ps = prompts(5, seed=5)
    # Different lengths: the batch runs through buckets 8, 4, 2, 1 (3 and 5 are padded).
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (40, 9, 17, 30, 3)]
    eager = engine(path, "cuda:0", "float32", cuda_graphs=False)
    assert eager.runner.graphs is None
    want = [c.token_ids for c in eager.generate(ps, params)]
    del eager
    graphed = engine(path, "cuda:0", "float32", prefill_graph_max_tokens=0)  # decode graphs only: prefill ones below
    replays = []
    run = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda batch: replays.append(batch.num_seqs) or run(batch)
    got = [c.token_ids for c in graphed.generate(ps, params)]
    assert got == want
    assert {3, 5} & set(replays), f"padded buckets were not exercised: {sorted(set(replays))}"


MLA_FAMILIES = ["deepseek_v2", "deepseek_v3"]  # q straight from x (as V2-Lite) / through q_lora_rank, biases


@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_gpu_mla_greedy_equals_cpu(family, cuda_graphs, root):
    """MLA on the GPU path against the CPU reference (the latents up-projected every step), float32
    on both: the same 16 tokens for 8 prompts clear of near-ties (the absorbed form sums in
    another order, ~1e-6 apart). Prompts of up to 60 tokens in chunks of 32 beside decode rows:
    fresh prompts, chunks after a cached prefix, mixed steps, decode steps (graphs or eager)."""
    path = checkpoint(family, root, sharp=True)
    ps, want = clear_prompts(engine(path, "cpu", "float32"), prompts(48, seed=11), n=8, tokens=16, min_margin=0.05)
    gpu = engine(path, "cuda:0", "float32", cuda_graphs=cuda_graphs)
    assert type(gpu.model.attn_backend).__name__ == "TritonAttention"
    assert all(moe.num_shared_slots and moe.shared_expert is None for moe in gpu.model.moe_layers())
    assert (gpu.runner.graphs is not None) == cuda_graphs
    idle = gpu.pool.num_free_blocks
    got = [c.token_ids for c in gpu.generate(ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    assert got == want
    assert gpu.pool.num_free_blocks == idle


def step(e: Engine, out: dict[str, list[int]]) -> None:
    """One engine step, its tokens added to `out` by request."""
    for o in e.step():
        out.setdefault(o.request_id, []).extend(o.token_ids)


# Prefill graphs (engine/prefill_graphs.py): buckets 128, 256, 384, 512 with a 512-token budget.
# One prompt per step crossing every bucket edge, and steps of several prompts (their attention per
# prompt inside the graph: the varlen kernel; MLA runs those eagerly).
SINGLES = [[3], [127], [128], [129], [300], [512]]
GROUPS = [[5, 40, 60], [100, 200, 150]]
PREFILL_GRAPH_CASES = [("qwen3_moe", "float32", "auto"), ("qwen3_moe", "bfloat16", "auto"),
                       ("qwen3", "float32", "fp8_e4m3"), ("deepseek_v2", "float32", "auto"),
                       ("deepseek_v2", "bfloat16", "fp8_e4m3")]


def prefill_engine(path, dtype: str, kv_cache_dtype: str, graph_tokens: int) -> Engine:
    return Engine(EngineConfig(model=ModelConfig(path=str(path), dtype=dtype, kv_cache_dtype=kv_cache_dtype),
                               device="cuda:0", num_kv_blocks=320, max_num_seqs=32, max_num_batched_tokens=512,
                               chunk_size=512, prefill_graph_max_tokens=graph_tokens))


@pytest.mark.parametrize("family,dtype,kv", PREFILL_GRAPH_CASES, ids=["-".join(c) for c in PREFILL_GRAPH_CASES])
def test_prefill_graphs_equal_eager(family, dtype, kv, root):
    """Steps of fresh prompts replayed from the graph of their bucket give the eager engine's greedy
    tokens, prompt by prompt; the warm-up replays every graph once; each step replays the expected
    (bucket, layout), counted."""
    from pdserve.engine.prefill_graphs import SINGLE, VARLEN
    from pdserve.engine.warm_up import warm_up

    path = checkpoint(family, root, sharp=True, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randint(0, 128, (n,), generator=g).tolist() for n in lens] for lens in SINGLES + GROUPS]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    eager = prefill_engine(path, dtype, kv, 0)
    assert eager.runner.prefill_graphs is None
    want = [[c.token_ids for c in eager.generate(ps, params)] for ps in steps]
    del eager
    e = prefill_engine(path, dtype, kv, 512)
    graphs = e.runner.prefill_graphs
    mla = e.args.is_mla
    layouts = [SINGLE] if mla else [SINGLE, VARLEN]
    assert not graphs.failed and set(graphs.graphs) == {(b, x) for b in (128, 256, 384, 512) for x in layouts}
    warm_up(e)
    assert set(graphs.replays) == set(graphs.graphs), "the warm-up replays every graph before ready"
    graphs.replays.clear()
    idle = e.pool.num_free_blocks
    got = [[c.token_ids for c in e.generate(ps, params)] for ps in steps]
    assert got == want
    assert e.pool.num_free_blocks == idle
    expect = {(128, SINGLE): 3, (256, SINGLE): 1, (384, SINGLE): 1, (512, SINGLE): 1}
    if not mla:
        expect |= {(128, VARLEN): 1, (512, VARLEN): 1}
    assert graphs.replays == expect


# float32: the graphed engine pads each step to its bucket (and, where no graph takes a prompt with
# the decoders, steps apart), so its GEMMs differ in shape from the eager engine's; only float32
# keeps greedy tokens through that.
CACHED_CASES = [("qwen3_moe", "float32", "auto"), ("qwen3", "float32", "fp8_e4m3")]


@pytest.mark.parametrize("family,dtype,kv", CACHED_CASES, ids=["-".join(c) for c in CACHED_CASES])
def test_prefill_graphs_take_cached_prefixes_and_decoders_as_the_eager_engine(family, dtype, kv, root):
    """Prompts whose prefixes are cached, arriving while others decode: their steps replay `varlen`
    graphs (the cached keys read through the block table) and give the eager engine's greedy tokens;
    blocks back to idle."""
    from pdserve.engine.prefill_graphs import VARLEN

    path = checkpoint(family, root, sharp=True, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, 128, (200,), generator=g).tolist()
    tails = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 60, 130)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(e: Engine) -> dict[str, list[int]]:
        e.generate([shared + [7, 8]], params)  # the prefix cached (12 blocks)
        out: dict[str, list[int]] = {}
        for i, tail in enumerate(tails):
            e.add_request(f"p{i}", shared + tail, params)
            step(e, out)  # one step each: the next arrives while this one decodes
        while e.has_unfinished():
            step(e, out)
        return out

    eager = prefill_engine(path, dtype, kv, 0)
    want = run(eager)
    del eager
    e = prefill_engine(path, dtype, kv, 512)
    idle = e.pool.num_free_blocks
    assert run(e) == want
    assert e.pool.num_free_blocks == idle
    assert sum(n for (_, layout), n in e.runner.prefill_graphs.replays.items() if layout == VARLEN) >= len(tails)


def test_a_decode_replica_prefills_its_local_prompts_in_graphs(root):
    """A decode replica computes the prompts routed to it whole (adaptive local prefill): its prompt
    steps replay prefill graphs (each step of prompt tokens, alone or beside decoders), and give
    the eager decode engine's greedy tokens; blocks back to idle. float32, as the cached-prefix case."""
    path = checkpoint("qwen3_moe", root, sharp=True, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(6)
    ps = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (40, 130, 300, 7)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(graph_tokens: int) -> tuple[dict[str, list[int]], Engine]:
        e = Engine(EngineConfig(model=ModelConfig(path=str(path), dtype="float32"), role="decode",
                                device="cuda:0", num_kv_blocks=320, max_num_seqs=32, max_num_batched_tokens=512,
                                chunk_size=512, prefill_graph_max_tokens=graph_tokens))
        idle, out = e.pool.num_free_blocks, {}
        for i, p in enumerate(ps):  # one step each: the next arrives while those before decode
            e.add_request(f"p{i}", p, params)
            step(e, out)
        while e.has_unfinished():
            step(e, out)
        assert e.pool.num_free_blocks == idle
        return out, e

    want, eager = run(0)
    assert eager.runner.prefill_graphs is None
    del eager
    got, e = run(512)
    assert e.runner.prefill_graphs is not None and e.runner.graphs is not None
    assert got == want
    # Every step that computed prompt tokens replayed a graph. Not one per prompt: the decode role's
    # scheduler may run a prompt's step apart from the decoders and join two prompts in one (an
    # H200 run, 2026-11-29: 128 and 256 `single`, then 384 `varlen` for the last two).
    replays = e.runner.prefill_graphs.replays
    prompt_steps = sum(row[0] for row in e.profile.phases["prefill"].values())
    assert prompt_steps >= 2 and sum(replays.values()) == prompt_steps, (replays, e.profile.phases)


def test_a_chunk_beside_more_decoders_than_32_replays_a_graph_of_more_slots(root):
    """prefill_graph_max_seqs 48: a prompt mixed into 40 decoders replays a `varlen` graph of 49 slots
    (its attention over the sequences' tiles end to end, ops/prefill_attention.py `flat`), and the
    greedy tokens are the eager engine's; blocks back to idle. float32, as the cached-prefix case."""
    path = checkpoint("qwen3_moe", root, sharp=True, max_position_embeddings=1024)
    g = torch.Generator().manual_seed(7)
    decoders = [torch.randint(0, 128, (int(n),), generator=g).tolist() for n in torch.randint(2, 300, (40,), generator=g)]
    late = torch.randint(0, 128, (200,), generator=g).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def run(graph_tokens: int) -> tuple[dict[str, list[int]], Engine]:
        e = Engine(EngineConfig(model=ModelConfig(path=str(path), dtype="float32"), device="cuda:0",
                                num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=4096, chunk_size=512,
                                prefill_graph_max_tokens=graph_tokens, prefill_graph_max_seqs=48))
        idle, out = e.pool.num_free_blocks, {}
        for i, p in enumerate(decoders):
            e.add_request(f"d{i}", p, params)
        step(e, out)  # every prompt at once: then 40 decoders
        e.add_request("late", late, params)  # its chunk mixed into their step
        while e.has_unfinished():
            step(e, out)
        assert e.pool.num_free_blocks == idle
        return out, e

    want, eager = run(0)
    del eager
    got, e = run(4096)
    assert got == want
    assert any(b >= 200 + 40 for b, _ in e.runner.prefill_graphs.replays), e.runner.prefill_graphs.replays
    assert e.runner.prefill_graphs.max_seqs == 48


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_prefill_graphs_on_the_grouped_gemm_path_equal_eager(family, root):
    """bf16 steps of 3,072 tokens and more take the grouped-GEMM MoE (torch._grouped_mm over
    device-side group offsets) inside the graph, with the padding rows routed like any token: the
    greedy tokens are the eager engine's."""
    path = checkpoint(family, root, sharp=True, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(5)
    lens = [[3100], [3328]] + ([] if family == "deepseek_v2" else [[1400, 1800]])  # MLA: one prompt a graph
    steps = [[torch.randint(0, 128, (n,), generator=g).tolist() for n in ls] for ls in lens]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    def engine(graph_tokens):
        return Engine(EngineConfig(model=ModelConfig(path=str(path), dtype="bfloat16"), device="cuda:0",
                                   num_kv_blocks=896, max_num_seqs=8, max_num_batched_tokens=3328,
                                   chunk_size=3328, prefill_graph_max_tokens=graph_tokens))

    eager = engine(0)
    want = [[c.token_ids for c in eager.generate(ps, params)] for ps in steps]
    del eager
    e = engine(3328)
    graphs = e.runner.prefill_graphs
    assert not graphs.failed and e.runner.prefill_graphs.buckets[-2:] == [3072, 3328]
    from pdserve.ops.triton_moe import GROUPED_MM_MIN_TOKENS
    assert GROUPED_MM_MIN_TOKENS <= 3100, "the premise: these steps take the grouped GEMM"
    got = [[c.token_ids for c in e.generate(ps, params)] for ps in steps]
    assert got == want
    assert all(b == 3328 for b, _ in graphs.replays), graphs.replays


def test_prefill_graph_max_tokens_needs_the_triton_kernels(root):
    with pytest.raises(ValueError, match="prefill_graph_max_tokens=512 needs the Triton kernels"):
        Engine(EngineConfig(model=ModelConfig(path=str(checkpoint("qwen3_moe", root))), device="cuda:0",
                            num_kv_blocks=64, attention_backend="torch", prefill_graph_max_tokens=512))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_verify_steps_replay_decode_graphs_and_keep_greedy_output(family, root):
    """Speculative decoding (n-gram drafts) on the GPU, float32: a verify step is a decode step of a
    row per checked token, replayed from the decode graphs, and greedy output equals speculation off."""
    path = checkpoint(family, root)
    ps = [[5, 6, 7, 8] * 6 + [5], [9, 10, 11] * 8, *prompts(2, seed=9)]  # repetitive: drafts to check
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in ps]
    plain = engine(path, "cuda:0", "float32", prefill_graph_max_tokens=0)
    want = [c.token_ids for c in plain.generate(ps, params)]
    del plain
    spec = engine(path, "cuda:0", "float32", prefill_graph_max_tokens=0,
                  speculative={"method": "ngram", "num_tokens": 3})
    rows = []
    run = spec.runner.graphs.run
    spec.runner.graphs.run = lambda batch: rows.append(batch.num_seqs) or run(batch)
    got = [c.token_ids for c in spec.generate(ps, params)]
    assert got == want
    assert spec.profile.snapshot()["spec_accepted_tokens"] > 0
    assert max(rows) > len(ps), f"no verify step was replayed from a graph: {sorted(set(rows))}"
