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
  without CUDA graphs, over a float32 or an FP8 latent cache.

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


def test_gpu_fp8_cache_greedy_matches_cpu(root):
    """An FP8 KV cache on the GPU (Triton's write, decode with its fused write, prefill kernels;
    the scales in CUDA graphs) against the CPU reference caching FP8: the same rounding of K/V, so
    the same 16 tokens on prompts clear of near-ties (a K/V value the two sides compute a float32
    ulp apart can still round to neighbouring FP8 values)."""
    path = checkpoint("qwen3", root, sharp=True)
    cpu = engine(path, "cpu", "float32", "fp8_e4m3")
    ps, want = clear_prompts(cpu, prompts(48, seed=11), n=8, tokens=16, min_margin=0.2)
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
    graphed = engine(path, "cuda:0", "float32")
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


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_gpu_mla_fp8_cache_greedy_matches_cpu(family, root):
    """An FP8 latent cache on the GPU (the Triton latent write, the decode kernel's fused write,
    FP8 latents read by every path, the scale in CUDA graphs) against the CPU reference caching
    FP8: the same 16 tokens for 6 prompts clear of near-ties."""
    path = checkpoint(family, root, sharp=True)
    cpu = engine(path, "cpu", "float32", "fp8_e4m3")
    ps, want = clear_prompts(cpu, prompts(48, seed=11), n=6, tokens=16, min_margin=0.15)
    gpu = engine(path, "cuda:0", "float32", "fp8_e4m3")
    assert gpu.runner.graphs is not None and gpu.kv_cache.dtype == torch.float8_e4m3fn
    idle = gpu.pool.num_free_blocks
    got = [c.token_ids for c in gpu.generate(ps, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    assert got == want
    assert gpu.pool.num_free_blocks == idle
