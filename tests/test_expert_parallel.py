"""Expert parallelism: placement, each rank's weights, and N = 2 ranks in processes of
their own (gloo) generating exactly what one rank generates, on both exchange paths."""

import errno
import socket
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch

from pdserve.worker.rendezvous import rendezvous_store
from ep_ranks import Request, Run, engine_config, run_ranks
from hf_checkpoints import build_checkpoint, write_tokenizer
from pdserve.config import ClusterConfig, ConfigError
from pdserve.control.model_fit import check_model_fit
from pdserve.engine.engine import Engine
from pdserve.protocol import SamplingParams
from pdserve.messages import ReplicaStats
from pdserve.models import resolve_model_args
from pdserve.models.decoder import WeightPlacer
from pdserve.models.loader import load_model
from pdserve.ops.ep_exchange import EPExchange
from pdserve.ops.moe import TorchMoE, route
from pdserve.ops.expert_placement import ExpertPlacement
from pdserve.router.decode_replica import DecodeReplica

ALL_GATHER, ALL_TO_ALL, MIXED = 10**9, 0, 12  # thresholds; MIXED switches path from step to step


def test_placement_shards_experts_and_replicates_hot_ones():
    p = [ExpertPlacement(8, 2, r, replicated=(1, 6)) for r in range(2)]
    assert p[0].local_experts == [0, 1, 2, 3, 6] and p[1].local_experts == [4, 5, 6, 7, 1]
    table = p[0].serving_rank()
    assert table[0].tolist() == [0, 0, 0, 0, 1, 1, 0, 1]  # a replicated expert serves its own rank's tokens
    assert table[1].tolist() == [0, 1, 0, 0, 1, 1, 1, 1]
    assert p[1].local_slot().tolist() == [-1, 4, -1, -1, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="ep_size 3 does not divide the model's 8 experts; allowed: 1, 2, 4, 8"):
        ExpertPlacement(8, 3, 0)
    with pytest.raises(ValueError, match="replicated"):
        ExpertPlacement(8, 2, 0, replicated=(8,))


def test_cluster_yaml_ep_size_must_fit_the_model():
    args = resolve_model_args("tiny-moe")  # 8 experts
    check_model_fit(ClusterConfig.model_validate({"decode": {"ep_size": 4}}), args)
    with pytest.raises(ConfigError) as e:
        check_model_fit(ClusterConfig.model_validate({"decode": {"ep_size": 3}}), args)
    assert "decode.ep_size" in str(e.value) and "3" in str(e.value) and "1, 2, 4, 8" in str(e.value)
    with pytest.raises(ConfigError, match="decode.ep_replicated_experts"):
        check_model_fit(ClusterConfig.model_validate({"decode": {"ep_size": 2, "ep_replicated_experts": [9]}}),
                        args)


def test_the_router_sees_one_replica_with_the_capacity_of_its_ranks():
    ranks = [ReplicaStats(f"d-rank{r}", "decode", r, 0, free, 10, r, expert_tokens=[1, r], expert_tokens_step=[0, r],
                          refusals={"router_channel": {"malformed": 1 + r}, **({"kv_tcp": {"not_a_peer": 4}} if r else {})})
             for r, free in enumerate([3, 7])]
    replica = DecodeReplica("d", {"d-rank0": None, "d-rank1": None}, {s.name: s for s in ranks})
    assert replica.rank_order() == ["d-rank1", "d-rank0"]  # reserve where the most KV blocks are free
    s = ReplicaStats.combine("d", ranks)
    assert (s.name, s.running, s.free_blocks, s.total_blocks, s.aborted, s.ranks) == ("d", 1, 10, 20, 1, 2)
    assert s.expert_tokens == [2, 1] and s.expert_tokens_step == [0, 1]
    assert s.refusals == {"router_channel": {"malformed": 3}, "kv_tcp": {"not_a_peer": 4}}  # every rank's endpoints


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for family in ("qwen3_moe", "mixtral", "deepseek_v2"):
        ck = build_checkpoint(family, root)
        write_tokenizer(ck.path, ck.hf_model.config.vocab_size)
        paths[family] = ck.path
    return paths


@pytest.mark.parametrize("model", ["tiny-moe", "qwen3_moe", "mixtral"])
def test_each_rank_holds_its_slice_of_the_single_rank_model(model, checkpoints):
    path = str(checkpoints.get(model, model))
    full, args = load_model(path, torch.float32, "cpu")
    placements = [ExpertPlacement(args.num_experts, 2, r, replicated=(1,)) for r in range(2)]
    ranks = [load_model(path, torch.float32, "cpu", ep=EPExchange(p, torch.device("cpu"), 1))[0] for p in placements]
    for placement, model_r in zip(placements, ranks):
        theirs = dict(model_r.named_parameters())
        for name, p in full.named_parameters():
            expected = p[placement.local_experts] if name.endswith((".w13", ".w2")) else p
            assert torch.equal(theirs[name], expected), name
        assert all(moe.exchange is not None for moe in model_r.moe_layers())
    # A rank does not even read the other rank's experts from the checkpoint.
    if model == "qwen3_moe":
        def read(rank: int, expert: int) -> bool:
            name, shape = f"model.layers.0.mlp.experts.{expert}.up_proj.weight", (args.moe_intermediate_size, args.hidden_size)
            return WeightPlacer(ranks[rank]).place(name, shape) is not None

        assert not read(0, 5) and read(0, 1) and read(1, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_all_gather_path_packs_routing_beside_the_tokens(dtype):
    """One rank of one (gloo, in this process): the all-gather path ships each token with its
    routing in one collective (float32 weights and ids reinterpreted in the token dtype) and skips
    the padding; its output is the plain MoE's, bit for bit."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(5)
        experts, k, h, i = 8, 2, 16, 8
        ex = EPExchange(ExpertPlacement(experts, 1, 0), torch.device("cpu"), threshold=10**9)
        x = torch.randn(5, h, generator=g).to(dtype)
        w13 = torch.randn(experts, 2 * i, h, generator=g).to(dtype)
        w2 = torch.randn(experts, h, i, generator=g).to(dtype)
        weights, ids = route(torch.randn(5, experts, generator=g), k, True)
        ex.begin_step(7)  # another rank has 7 tokens: 2 padding rows here
        out = ex.forward(x, w13, w2, weights, ids, TorchMoE())
        assert torch.equal(out, TorchMoE().forward(x, w13, w2, weights, ids))
        assert ex.expert_load()[1] == torch.bincount(ids.flatten(), minlength=experts).tolist()
        # As in a replayed CUDA graph: the last 2 of the 5 rows are the bucket's padding.
        ex.begin_step(5)
        ex.row_valid = torch.tensor([1, 1, 1, 0, 0], dtype=torch.int32)
        out = ex.forward(x, w13, w2, weights, ids, TorchMoE())
        assert torch.equal(out[:3], TorchMoE().forward(x[:3], w13, w2, weights[:3], ids[:3]))
        assert not out[3:].any()
        assert ex.expert_load()[1] == torch.bincount(ids[:3].flatten(), minlength=experts).tolist()
    finally:
        dist.destroy_process_group()


def _requests(vocab: int, seed: int) -> list[list[Request]]:
    """Rank 0: four requests from the start. Rank 1: none for 3 steps, then two short ones, so it
    also idles while rank 0 is still going."""
    g = torch.Generator().manual_seed(seed)

    def prompt(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    return [[Request(prompt(3), 14), Request(prompt(21), 10), Request(prompt(9), 16), Request(prompt(1), 6)],
            [Request(prompt(13), 4, at_step=3), Request(prompt(30), 3, at_step=3)]]


def _single_rank(model: str, requests: list[list[Request]]) -> list[list[int]]:
    engine = Engine(engine_config(model))
    flat = [r for rank in requests for r in rank]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0, ignore_eos=True) for r in flat]
    return [c.token_ids for c in engine.generate([r.prompt for r in flat], params)]


@dataclass
class EPRuns:
    path: str
    requests: list[list[Request]]
    expected: list[list[int]]  # the single-rank run's tokens, rank 0's requests first
    by_threshold: dict[int, tuple[dict, dict]]  # threshold -> each rank's result
    overlapped: tuple[dict, dict]  # each rank's result on the MIXED paths with overlap scheduling
    replicated: list[list[dict]]  # each rank's result with hot experts replicated


@pytest.fixture(scope="module")
def ep_runs(checkpoints) -> dict[str, EPRuns]:
    """Each model generated by 2 ranks on each path; all runs share one pair of processes per model."""
    out = {}
    for family in ("qwen3_moe", "mixtral"):
        path = str(checkpoints[family])
        requests = _requests(resolve_model_args(path).vocab_size, seed=len(family))
        thresholds = (ALL_GATHER, ALL_TO_ALL, MIXED)
        ranks = run_ranks(path, [Run(requests, t) for t in thresholds] + [Run(requests, MIXED, overlap=True)])
        replicated = run_ranks(path, [Run(requests, MIXED)], replicated=(0, 5))
        by_threshold = dict(zip(thresholds, zip(*[r[:3] for r in ranks])))
        out[family] = EPRuns(path, requests, _single_rank(path, requests), by_threshold,
                             (ranks[0][3], ranks[1][3]), replicated)
    return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("path", [ALL_GATHER, ALL_TO_ALL, MIXED], ids=["all_gather", "all_to_all", "mixed"])
def test_two_ranks_generate_what_one_rank_generates(ep_runs, family, path):
    runs = ep_runs[family]
    ranks = runs.by_threshold[path]
    assert ranks[0]["tokens"] + ranks[1]["tokens"] == runs.expected
    # Expert load: every forwarded token counted once per MoE layer and top-k choice.
    args = resolve_model_args(runs.path)
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.num_layers))
    forwarded = sum(len(r.prompt) + r.max_tokens - 1 for rank in runs.requests for r in rank)
    load = [a + b for a, b in zip(ranks[0]["load"], ranks[1]["load"])]
    assert sum(load) == forwarded * moe_layers * args.num_experts_per_tok


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_replaying_graphs_generate_what_one_rank_generates(checkpoints):
    """NCCL, CUDA graphs of the decode step with the all-gather exchange inside (every rank replays
    the agreed bucket; an idle rank replays padding), eager prompt steps; the MIXED run also
    switches to the all-to-all path (eager) whenever a rank's batch reaches the threshold."""
    path = str(checkpoints["qwen3_moe"])
    requests = _requests(resolve_model_args(path).vocab_size, seed=3)
    ranks = run_ranks(path, [Run(requests, ALL_GATHER), Run(requests, MIXED)], gpus=True)
    expected = _single_rank(path, requests)
    args = resolve_model_args(path)
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.num_layers))
    forwarded = sum(len(r.prompt) + r.max_tokens - 1 for rank in requests for r in rank)
    for run in range(2):
        assert ranks[0][run]["tokens"] + ranks[1][run]["tokens"] == expected, run
        # Padding rows of a replayed bucket are not counted as expert load.
        load = [a + b for a, b in zip(ranks[0][run]["load"], ranks[1][run]["load"])]
        assert sum(load) == forwarded * moe_layers * args.num_experts_per_tok, run


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_overlapped_ranks_generate_what_one_rank_generates(ep_runs, family):
    """Each rank queues its step N+1 (and the group's agreement on it) before handing out step N."""
    runs = ep_runs[family]
    assert runs.overlapped[0]["tokens"] + runs.overlapped[1]["tokens"] == runs.expected
    assert runs.overlapped[0]["load"] == runs.by_threshold[MIXED][0]["load"]


def test_deepseek_ranks_with_folded_shared_experts_generate_what_one_rank_generates(checkpoints):
    """DeepSeek-V2 (group-limited routing, 2 shared experts) with its shared experts folded into
    the routed experts' call (the GPU path's fold, here on the CPU ranks): every rank appends the
    shared slots to its own experts and computes them for its own tokens, inside the exchange, on
    both paths; the tokens are the single-rank reference's (shared MLP apart), the expert load
    counts routed experts only."""
    path = str(checkpoints["deepseek_v2"])
    args = resolve_model_args(path)
    requests = _requests(args.vocab_size, seed=5)
    ranks = run_ranks(path, [Run(requests, ALL_GATHER), Run(requests, ALL_TO_ALL)], fold_shared=True)
    expected = _single_rank(path, requests)
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.num_layers))
    forwarded = sum(len(r.prompt) + r.max_tokens - 1 for rank in requests for r in rank)
    for run in range(2):
        assert ranks[0][run]["tokens"] + ranks[1][run]["tokens"] == expected, run
        load = [a + b for a, b in zip(ranks[0][run]["load"], ranks[1][run]["load"])]
        assert len(load) == args.num_experts and sum(load) == forwarded * moe_layers * args.num_experts_per_tok


def test_hot_experts_copied_to_every_rank_change_no_token(ep_runs):
    for family, runs in ep_runs.items():
        assert runs.replicated[0][0]["tokens"] + runs.replicated[1][0]["tokens"] == runs.expected, family


def _take(host: str, port: int) -> socket.socket | None:
    """What another process after a free port does (a rank 0 serving a rendezvous, a server): bind it
    and listen. None if the port is taken (EADDRINUSE), else the socket, now holding the port."""
    s = socket.socket()
    try:
        s.bind((host, port))
        s.listen()
        return s
    except OSError as e:
        s.close()
        if e.errno != errno.EADDRINUSE:
            raise
        return None


def test_the_rendezvous_store_holds_its_port_from_the_start():
    """Nothing picks a free port and lets it go: the store is bound (port 0) and listening as soon as
    it exists, so no one else can take its port before the ranks join it."""
    import torch.distributed as dist

    store = rendezvous_store("127.0.0.1")
    assert store.port > 0 and store.host == "127.0.0.1"
    assert _take("127.0.0.1", store.port) is None
    joined = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=30))
    joined.set("rank0", "here")
    assert store.get("rank0") == b"here"


def test_nothing_takes_the_rendezvous_port_before_the_ranks_join():
    """The flaky `pytest -n 2` run: run_ranks picked a free port, closed it, and the ranks bound it
    later, when another test's process could have it (EADDRINUSE). Here another process tries to take
    the port just before the ranks start (where the port used to be free, and whoever took it would
    have kept it): it must be taken already, and the ranks still meet and generate."""
    attempts = []

    def thief(host: str, port: int) -> None:
        attempts.append(_take(host, port))  # held (if it got the port) until the ranks are done

    requests = _requests(resolve_model_args("tiny-moe").vocab_size, seed=1)
    try:
        ranks = run_ranks("tiny-moe", [Run(requests, ALL_GATHER)], before_start=thief)
    finally:
        taken = [s for s in attempts if s is not None]
        for s in taken:
            s.close()
    assert len(attempts) == 1 and not taken, "the rendezvous port was free before the ranks joined"
    assert [len(t) for t in ranks[0][0]["tokens"] + ranks[1][0]["tokens"]] == [
        r.max_tokens for rank in requests for r in rank]
