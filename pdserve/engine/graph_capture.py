"""Which CUDA graphs an engine captures — of fresh-prompt steps (prefill_graphs.py), of decode steps
(cuda_graphs.py), both or none — and capturing them into its model runner, in one memory pool."""

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.config import EngineConfig

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine


def capture_graphs(engine: "Engine", attn_backend, moe_backend, ep, log: Callable[[str], None] | None) -> float | None:
    """CUDA graphs of fresh-prompt steps and of decode steps, in one memory pool: a step replays one
    graph at a time, and the largest activations (the prefill graphs') are captured first, so the
    decode graphs fit in memory they reserved. Returns the seconds it took; None: no graphs here."""
    c = engine.config
    prefill_tokens = prefill_graph_tokens(c, engine.device, engine.tp, attn_backend, moe_backend, ep)
    decode = wants_decode_graphs(c, engine.device, attn_backend, ep)
    if not (prefill_tokens or decode):
        return None
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    runner, layout = engine.runner, engine.layout
    if prefill_tokens:
        from pdserve.engine.prefill_graphs import PrefillGraphs, prefill_buckets
        # MLA has no varlen kernel for fresh prompts: its graphs hold one prompt each.
        seqs = 1 if engine.args.is_mla else min(c.max_num_seqs, c.prefill_graph_max_seqs)
        runner.prefill_graphs = PrefillGraphs(engine.model, engine.kv_cache, layout.scales,
                                              prefill_buckets(prefill_tokens), seqs, engine.device, log, pool,
                                              max_blocks=-(-engine.max_model_len // c.block_size))
    if decode:
        from pdserve.engine.cuda_graphs import DecodeGraphs
        # A verify step is a decode step of a row per token checked (model_runner.prepare): with
        # speculation on, the buckets reach every sequence's 1 + k rows (within the same cap).
        rows = c.max_num_seqs * (1 + c.speculative.num_tokens if engine.speculative else 1)
        runner.graphs = DecodeGraphs(
            engine.model, engine.kv_cache, attn_backend, min(rows, c.cuda_graph_max_batch),
            -(-engine.max_model_len // c.block_size), engine.max_model_len, engine.device, log, exchange=ep,
            kv_scales=layout.scales, pool=pool)
    seconds = time.perf_counter() - t0
    if prefill_tokens and decode:  # fresh prompts and decoders then step apart, each in its graphs
        engine.scheduler.graph_limits(prefill_tokens, seqs, min(c.max_num_seqs, runner.graphs.buckets[-1]))
    if log:
        log(f"CUDA graphs captured in {seconds:.2f} s")
    return seconds


def prefill_graph_tokens(c: EngineConfig, device: torch.device, tp, attn_backend, moe_backend, ep) -> int:
    """The largest prefill step replayed from a CUDA graph (engine/prefill_graphs.py); 0: none.
    Every role (a decode replica computes the prompts routed to it whole: adaptive local prefill, a
    prefill pool down), on a GPU with the Triton kernels (the torch reference reads host-side
    lengths and syncs), not expert- or tensor-parallel ranks (their steps stay eager). Never more
    than one step's token budget."""
    from pdserve.engine.prefill_graphs import DEFAULT_MAX_TOKENS

    want = c.prefill_graph_max_tokens
    if want == 0 or not c.cuda_graphs or ep is not None or tp is not None:
        return 0
    if not _triton_backends(attn_backend, moe_backend):
        if want is not None:
            raise ValueError(f"prefill_graph_max_tokens={want} needs the Triton kernels on a GPU (CUDA graphs); "
                             f"attention_backend={c.attention_backend!r}, moe_backend={c.moe_backend!r} "
                             f"on {str(device)!r}: set both 'auto' or 'triton', or set 0")
        return 0
    most = min(DEFAULT_MAX_TOKENS if want is None else want, c.max_num_batched_tokens)
    return most if most >= 2 else 0  # (a step of one token is decode-shaped)


def wants_decode_graphs(c: EngineConfig, device: torch.device, attn_backend, ep) -> bool:
    """Decode steps replay CUDA graphs on a GPU with the Triton kernels (the torch reference
    reads host-side lengths); not for prefill-only engines, nor for expert-parallel ranks whose
    every step exchanges by all-to-all (threshold 1 or less: no static shapes)."""
    from pdserve.ops.attention import TorchAttention

    return (c.cuda_graphs and device.type == "cuda" and c.role != "prefill"
            and (ep is None or ep.threshold > 1) and not isinstance(attn_backend, TorchAttention))


def _triton_backends(attn_backend, moe_backend) -> bool:
    from pdserve.ops.attention import TorchAttention
    from pdserve.ops.moe import TorchMoE

    return not isinstance(attn_backend, TorchAttention) and not isinstance(moe_backend, TorchMoE)
