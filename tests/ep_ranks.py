"""The ranks of an expert-parallel group in processes of their own (gloo), each generating greedily
for its own requests in lockstep with the others; the parent collects every rank's tokens.

A request is (prompt ids, max_tokens, the step at which its rank adds it): a rank may have no
request for a while, or be done while the others go on, and it still joins every exchange.
"""

import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.messages import Request as EngineRequest
from pdserve.config import EngineConfig, ModelConfig
from pdserve.protocol import SamplingParams


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    at_step: int = 0


@dataclass
class Run:
    """One generation on every rank: requests per rank, and the exchange threshold to use."""

    requests: list[list[Request]]
    threshold: int  # 0: always all-to-all; huge: always all-gather
    overlap: bool = False  # the engines' overlap scheduling (step N+1 queued before N is handed out)


def engine_config(model: str, device: str = "cpu") -> EngineConfig:
    # Small chunks: prompts take several steps, so ranks compute different numbers of tokens.
    # float32 on GPUs too: the single-rank CPU run is the oracle, token for token.
    return EngineConfig(model=ModelConfig(path=model, dtype="float32"), device=device, num_kv_blocks=64,
                        block_size=4, chunk_size=8, max_num_batched_tokens=16, enable_prefix_cache=False,
                        max_num_seqs=16)


def run_ranks(model: str, runs: list[Run], size: int = 2, replicated: tuple[int, ...] = (),
              timeout: float = 240, gpus: bool = False,
              before_start: Callable[[str, int], None] | None = None,
              fold_shared: bool = False) -> list[list[dict]]:
    """For each rank, for each run: {"tokens": [ids per request], "load": tokens per expert}.
    `gpus`: rank r on cuda:r over NCCL (CUDA graphs of the decode step on), else CPU over gloo.
    `fold_shared`: the CPU ranks fold DeepSeek's shared experts into the routed ones, as the GPU
    path does (TorchMoE.fold_shared_experts turned on in the rank's process).
    The rendezvous store lives here, bound to port 0 and held until every rank is done;
    `before_start(host, port)` is called with its address before the ranks start."""
    from pdserve.worker.rank_processes import run_rank_processes

    out = run_rank_processes(_rank_main, [(model, runs, list(replicated), gpus, fold_shared)] * size, timeout,
                             before_start=before_start)
    return [out[r] for r in range(size)]


def _rank_main(rank: int, size: int, store_port: int, model: str, runs: list[Run], replicated: list[int],
               gpus: bool, fold_shared: bool, results) -> None:
    torch.set_num_threads(1)  # two ranks share the test machine's cores
    try:
        from pdserve.decode.ep_group import EPGroup, EPRank
        from pdserve.engine.engine import Engine
        from pdserve.models import resolve_model_args
        from pdserve.ops.moe import TorchMoE

        TorchMoE.fold_shared_experts = fold_shared  # (this process only)

        device = torch.device(f"cuda:{rank}" if gpus else "cpu")
        if gpus:
            torch.cuda.set_device(device)
        # Graphs are captured below the threshold the group starts with: the largest of the runs'.
        me = EPRank(rank, size, "127.0.0.1", store_port, max(r.threshold for r in runs), replicated=replicated)
        group = EPGroup(me, resolve_model_args(model).num_experts, device)
        engine = Engine(engine_config(model, str(device)), ep=group.exchange)
        out = []
        for i, run in enumerate(runs):
            group.exchange.threshold = run.threshold
            engine.overlap = run.overlap  # (between runs: no step is in flight)
            before = group.exchange.expert_load()[0]
            tokens = _generate(group, engine, run.requests[rank], f"run{i}")
            load = [a - b for a, b in zip(group.exchange.expert_load()[0], before)]
            out.append({"tokens": tokens, "load": load})
        group.close()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _generate(group, engine, requests: list[Request], tag: str) -> list[list[int]]:
    from pdserve.decode.ep_group import IDLE, RUNNING

    tokens: dict[str, list[int]] = {}
    step = 0
    while True:
        for j, r in enumerate(requests):
            if r.at_step == step:
                engine.add_request(f"{tag}-{j}", r.prompt, SamplingParams(max_tokens=r.max_tokens, temperature=0,
                                                                          ignore_eos=True))
                tokens[f"{tag}-{j}"] = []
        # Requests still to come keep the group stepping, as reservations waiting for KV do.
        pending = any(r.at_step > step for r in requests)
        outputs, group_busy = group.step(engine, RUNNING if pending or engine.has_unfinished() else IDLE)
        for o in outputs:
            tokens[o.request_id] += o.token_ids
        step += 1
        if group_busy == IDLE:
            return [tokens[f"{tag}-{j}"] for j in range(len(requests))]


def run_disaggregated(model: str, firsts: list[list[int]], news: list[list[int]], params: dict,
                      timeout: float = 240) -> list[dict]:
    """An expert-parallel decode replica fed by prefill engines: rank r (a process, gloo) serves
    the conversation of firsts[r]: turn 1 that prompt, turn 2 it + turn 1's answer + news[r], each
    reserved on the rank's own decode engine and prefilled by a prefill engine of its process through
    the real connectors (loopback: kv_pair.py). Per rank: {"tokens": [turn 1's, turn 2's],
    "cached_blocks": per turn, "blocks_reused", "free_blocks", "num_blocks"} (blocks at the end)."""
    from pdserve.worker.rank_processes import run_rank_processes

    size = len(firsts)
    out = run_rank_processes(_disaggregated_rank, [(model, firsts[r], news[r], params) for r in range(size)],
                             timeout)
    return [out[r] for r in range(size)]


def _disaggregated_rank(rank: int, size: int, store_port: int, model: str, first: list[int], new: list[int],
                        params: dict, results) -> None:
    torch.set_num_threads(1)
    try:
        from kv_pair import loopback_pair
        from pdserve.decode.ep_group import IDLE, RUNNING, EPGroup, EPRank
        from pdserve.engine.engine import Engine
        from pdserve.models import resolve_model_args

        group = EPGroup(EPRank(rank, size, "127.0.0.1", store_port), resolve_model_args(model).num_experts,
                        torch.device("cpu"))
        config = EngineConfig(model=ModelConfig(path=model, dtype="float32"), num_kv_blocks=64)
        decode = Engine(config.model_copy(update={"role": "decode"}), ep=group.exchange)
        prefill = Engine(config.model_copy(update={"role": "prefill"}))
        streamer, intake = loopback_pair(prefill, decode)
        sampling = SamplingParams(**params)
        tokens: list[list[int]] = []
        cached: list[int] = []
        prompt: list[int] | None = first
        while True:  # every rank steps until the whole group is idle
            if prompt is not None:
                rid = f"turn{len(tokens)}"
                handle = intake.reserve(EngineRequest(rid, prompt, sampling))
                cached.append(handle.cached_blocks)
                streamer.add(EngineRequest(rid, prompt, sampling), handle)
                tokens.append([])
                prompt = None
            streamer.step()
            assert intake.poll() == []
            busy = RUNNING if streamer.busy() or intake.busy() or decode.has_unfinished() else IDLE
            outputs, group_busy = group.step(decode, busy)
            for o in outputs:
                tokens[-1] += o.token_ids
                if o.finished and len(tokens) == 1:  # the next turn: prompt + answer + new text
                    prompt = first + tokens[0] + new
            if group_busy == IDLE and prompt is None:
                break
        streamer.connector.close()
        intake.connector.close()
        group.close()
        results.put((rank, True, {"tokens": tokens, "cached_blocks": cached, "blocks_reused": intake.blocks_reused,
                                  "free_blocks": decode.pool.num_free_blocks, "num_blocks": decode.pool.num_blocks}))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
