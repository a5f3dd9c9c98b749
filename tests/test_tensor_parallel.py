"""Tensor parallelism: a model split over 2 ranks (gloo, 2 processes) computes what one rank does,
for every family: the logits of a prompt (close: the all-reduce sums in another order) and the
greedy tokens an engine generates from them (equal). Then through `pdserve up`: a TP = 2 colocated
replica, and a TP = 2 prefill replica feeding a one-rank and an expert-parallel decode replica,
answer what one engine generates."""

import pytest
import torch

from hf_checkpoints import FAMILIES, checkpoint_path
from pdserve.config import EngineConfig, ModelConfig
from pdserve.forward.forward_batch import ForwardBatch
from pdserve.forward.kv_cache import KVLayout, allocate_kv_cache
from pdserve.models.checkpoint_writer import write_checkpoint
from pdserve.models.loader import load_model
from pdserve.models.tensor_parallel import TensorParallel, check_tp_size
from pdserve.protocol import SamplingParams
from tp_ranks import run_ranks

BLOCK, NUM_BLOCKS = 4, 16
PROMPTS = [[3, 17, 42, 5, 99, 64, 7, 120, 31, 8, 77], [11, 2, 90, 45, 6]]
MAX_TOKENS = 6


def prompt_logits(path: str, load_format: str, tp: TensorParallel | None, fold: bool = False
                  ) -> tuple[torch.Tensor, int]:
    """The logits of every position of PROMPTS[0], prefilled in one step, and how many weights
    the model holds. `fold`: DeepSeek's shared experts folded into the routed ones (each rank's
    share of them: the GPU path's fold, on TorchMoE)."""
    from pdserve.ops.moe import TorchMoE

    moe = TorchMoE()
    moe.fold_shared_experts = fold
    model, args = load_model(path, torch.float32, "cpu", load_format=load_format, tp=tp, moe_backend=moe)
    assert all(m.num_shared_slots > 0 for m in model.moe_layers()) == fold or not args.shared_expert_intermediate_size
    cache = allocate_kv_cache(KVLayout.for_model(args, NUM_BLOCKS, BLOCK, torch.float32, tp=tp), torch.device("cpu"))
    ids = PROMPTS[0]
    n = len(ids)
    batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.arange(n), slot_mapping=torch.arange(n),
                         block_tables=torch.arange(-(-n // BLOCK))[None], query_start=[0, n], context_lens=[n],
                         logits_indices=torch.arange(n), kv_cache=cache)
    with torch.inference_mode():
        return model.compute_logits(model(batch)[batch.logits_indices]), sum(p.numel() for p in model.parameters())


def greedy(path: str, tp: TensorParallel | None) -> list[list[int]]:
    """Every rank runs the same requests through its own engine: the schedule is deterministic, so
    the ranks take the same steps and their collectives pair up (the model-level check; a replica's
    rank 0 schedules for all)."""
    from pdserve.engine.engine import Engine

    config = EngineConfig(model=ModelConfig(path=path, dtype="float32"), device="cpu", num_kv_blocks=NUM_BLOCKS,
                          block_size=BLOCK, chunk_size=8, max_num_batched_tokens=16, enable_prefix_cache=False)
    engine = Engine(config, tp=tp)
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
    for _ in range(100):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            tokens[o.request_id] += o.token_ids
    assert engine.pool.num_free_blocks == NUM_BLOCKS  # every block back
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))]


def _rank(tp: TensorParallel, jobs: list[tuple[str, str, bool, bool]]) -> list:
    # Plain lists: a tensor sent through a queue is shared memory the exiting rank takes with it.
    out = []
    for path, fmt, gen, fold in jobs:
        logits, weights = prompt_logits(path, fmt, tp, fold)
        out.append((logits.tolist(), weights, greedy(path, tp) if gen else None))
    return out


def staged_kv(kv_cache_dtype: str, tp: TensorParallel | None) -> tuple[torch.Tensor, list[int]]:
    """A prefill engine's KV of PROMPTS as a decode replica would receive it: rank 0's staging cache
    (every rank gathers its heads there each layer), or one rank's own cache; and the blocks."""
    from pdserve.engine.engine import Engine
    from pdserve.worker.tp_group import TPGroup

    config = EngineConfig(model=ModelConfig(path="tiny-moe", kv_cache_dtype=kv_cache_dtype), role="prefill",
                          device="cpu", num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, enable_prefix_cache=False)
    engine = Engine(config, tp=tp)
    cache = engine.kv_cache
    if tp is not None:
        group = TPGroup(tp)
        cache, layout = group.stage_kv(engine)
        assert layout.num_kv_heads == engine.args.num_kv_heads != engine.layout.num_kv_heads
        engine.runner.on_batch = group.follow  # (both ranks schedule alike here: no broadcast needed)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    blocks = [b for i in range(len(PROMPTS)) for b in engine.seqs[f"r{i}"].block_ids]
    return (None if cache is None else cache[:, :, blocks].float()), blocks


def _stage_rank(tp: TensorParallel, dtypes: list[str]) -> list:
    out = []
    for dtype in dtypes:
        kv, blocks = staged_kv(dtype, tp)
        out.append((None if kv is None else kv.tolist(), blocks))
    return out


def test_a_tp2_prefill_stages_every_head_on_rank_0(tmp_path):
    dtypes = ["auto", "fp8_e4m3"]
    ranks = run_ranks(_stage_rank, dtypes)
    for j, dtype in enumerate(dtypes):
        ref, blocks = staged_kv(dtype, None)
        staged, rank_blocks = torch.tensor(ranks[0][j][0]), ranks[0][j][1]
        assert rank_blocks == blocks and ranks[1][j][0] is None  # only rank 0 stages
        # float32: the all-reduces' order only; FP8: a value on a rounding boundary may take the next step.
        tol = (1e-4 if dtype == "auto" else 0.15) * ref.abs().max().item()
        err = (staged - ref).abs().max().item()
        assert err <= tol, f"{dtype}: max abs error {err:.3g}"


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    paths = {family: str(checkpoint_path(family, root)) for family in FAMILIES}
    # One KV head for two ranks: each rank holds a copy of it.
    paths["llama_kv1"] = str(checkpoint_path("llama", root, num_key_value_heads=1))
    # `pdserve write-checkpoint`'s files (a preset's dummy weights, Hub names), read by the streaming
    # loader: small chunks would not change what a rank reads, so the defaults.
    paths["written"] = str(root / "written")
    write_checkpoint("tiny-moe", root / "written", torch.float32, 4 * 10**6, seed=5, num_layers=2)
    return paths


def test_tp2_equals_tp1_every_family(paths):
    # Checkpoints for every family and one written by `pdserve write-checkpoint` (tensors sliced as
    # read), and dummy weights for two (drawn whole, then sliced): one spawn of two ranks does them all.
    # DeepSeek with its shared experts folded into the routed ones too (each rank folds its share).
    jobs = [(paths[f], "auto", True, False) for f in [*FAMILIES, "llama_kv1", "written"]] + \
        [(paths[f], "dummy", False, False) for f in ("qwen2_moe", "deepseek_v3")] + \
        [(paths[f], "auto", False, True) for f in ("deepseek_v2", "deepseek_v3")]
    ranks = run_ranks(_rank, jobs)
    for j, (path, fmt, gen, _) in enumerate(jobs):
        ref, weights = prompt_logits(path, fmt, None)
        for r, out in enumerate(ranks):
            logits, rank_weights, tokens = torch.tensor(out[j][0]), out[j][1], out[j][2]
            assert rank_weights < weights, f"{path}: rank {r} holds the whole model"
            err = (logits - ref).abs().max().item()
            assert err <= 1e-4 * ref.abs().max().item(), f"{path} {fmt} rank {r}: max abs error {err:.3g}"
            if gen:
                assert tokens == greedy(path, None), f"{path} rank {r}"


@pytest.mark.parametrize("size,match", [(3, "tp_size 3 must divide the model's num_attention_heads"),
                                        (0, "tp_size must be >= 1")])
def test_tp_size_refused_by_name(paths, size, match):
    from pdserve.models import resolve_model_args

    with pytest.raises(ValueError, match=match):
        check_tp_size(resolve_model_args(paths["llama"]), size)


def test_colocated_tp2_replica_serves_what_tp1_generates(tmp_path):
    """`pdserve up` with one colocated replica of 2 tensor-parallel ranks (2 Ray actors, gloo): over
    HTTP, greedy text equal to one unsharded engine's."""
    _serves_one_engines_text(tmp_path, 1, colocated={"replicas": 1, "tp_size": 2, "num_kv_blocks": 512})


def _serves_one_engines_text(tmp_path, replicas: int, reuse: bool = False, **sections) -> None:
    """`pdserve up` with `sections` answers four prompts (openai client, greedy) with the text of one
    unsharded tiny-moe engine, and its `replicas` replicas end with no KV block in use. The last
    prompt begins with the second: `reuse`, its decode replica (one rank) holds that prefix's
    blocks already, so only the rest's KV moves (an EP replica reserves on the rank with the most
    free blocks, which need not be the one holding them)."""
    import openai
    from prometheus_client.parser import text_string_to_metric_families

    from pdserve.engine.engine import Engine
    from serving_cluster import Cluster, until

    reference = Engine(EngineConfig(model=ModelConfig(path="tiny-moe"), num_kv_blocks=512))
    c = Cluster(tmp_path, **sections)
    fox = "The quick brown fox jumps over the lazy dog. " * 3
    try:
        c.wait_ready()
        oa = openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        for prompt in ["Once upon a time", fox, "x", fox + "And then?"]:
            r = oa.completions.create(model="tiny-moe", prompt=prompt, max_tokens=12, temperature=0)
            want = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0].text
            assert r.choices[0].text == want, prompt
        stats = c.wait_idle()
        assert len(stats) == replicas and all(s["used"] == 0 for s in stats.values()), stats
        if reuse:  # (the router's stats of the decode replica may predate the last request: polled)
            def reused() -> float:
                return sum(s.value for f in text_string_to_metric_families(c.metrics())
                           for s in f.samples if s.name == "pdserve_kv_blocks_reused_total")

            # The fox prompt's 8 full blocks (of its 135 byte tokens) were the decode side's already.
            assert until(reused, 10, "the decode replica's reused blocks counted") == 8
    finally:
        assert c.stop() == 0, c.output()


def test_tp_size_config_errors_name_the_key(tmp_path):
    from pdserve.config import ClusterConfig, ConfigError
    from pdserve.control.model_fit import check_model_fit
    from pdserve.models import resolve_model_args

    args = resolve_model_args("tiny-moe")
    with pytest.raises(ConfigError, match="colocated.tp_size 3 must divide the model's num_attention_heads"):
        check_model_fit(ClusterConfig(colocated={"replicas": 1, "tp_size": 3}), args)
    check_model_fit(ClusterConfig(colocated={"replicas": 1, "tp_size": 2}), args)
    with pytest.raises(ConfigError, match="prefill.tp_size 3 must divide the model's num_attention_heads"):
        check_model_fit(ClusterConfig(prefill={"tp_size": 3}), args)
    # GPUs: one a rank, NCCL between them (tests/test_tensor_parallel_gpu.py).
    check_model_fit(ClusterConfig(colocated={"replicas": 1, "tp_size": 2, "gpus": 1}), args)
    check_model_fit(ClusterConfig(prefill={"tp_size": 2, "gpus": 1}), args)


@pytest.mark.parametrize("decode", [{}, {"ep_size": 2}], ids=["decode-tp1", "decode-ep2"])
def test_tp2_prefill_feeds_any_decode_replica(tmp_path, decode):
    """A TP = 2 prefill replica (its KV staged whole on rank 0) hands requests to a one-rank decode
    replica and to an expert-parallel one over NIXL: greedy text equal to one colocated engine's,
    every block back on every side; a prompt whose prefix the one-rank decode replica holds moves
    only the rest's KV from rank 0's staging cache."""
    # Every prompt prefilled on the TP replica (adaptive would compute the cached one on its decode
    # replica, where no KV moves: the reuse under test).
    _serves_one_engines_text(tmp_path, 2, reuse=not decode, prefill={"replicas": 1, "tp_size": 2},
                             decode={"replicas": 1, **decode}, router={"prefill_site": "remote"})


def test_the_control_channel_carries_typed_messages_never_a_pickle():
    import pickle

    from pdserve.worker.tp_group import StepBatch, pack_control, unpack_control

    step = StepBatch(b"\x01" * 16, b"\x02" * 16, b"", [0, 2], [2])
    for msg in (None, "stop", step, ("engine", "{}", 3)):
        assert unpack_control(pack_control(msg)) == msg
    for data in (pickle.dumps(step), pickle.dumps(None), b"\xc1", pack_control(("x",))[:-1]):
        with pytest.raises(ValueError, match="none of rank 0's"):
            unpack_control(data)


def test_a_rank_without_the_cluster_token_is_refused_by_the_group():
    """Two ranks that reach one rendezvous: where both hold the token they talk; where one does not
    (a stranger at the store), both refuse, naming it."""
    from pdserve.worker.rank_processes import run_rank_processes
    from tp_ranks import join_main

    assert run_rank_processes(join_main, [("t",), ("t",)], timeout=180) == {0: "hello", 1: "hello"}
    out = run_rank_processes(join_main, [("t",), ("not-the-token",)], timeout=180)
    assert all(v.startswith("PermissionError") and "rank(s) [1] do not hold the cluster's token" in out[0]
               for v in out.values()), out
