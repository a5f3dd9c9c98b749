"""How many KV blocks an engine's cache gets: the configured count, or as many as its memory budget
holds (kv_cache_gb, or on a GPU what the weights left free less 1 - gpu_memory_utilization of the card)."""

import torch

from pdserve.config import EngineConfig
from pdserve.engine.logits_processors import TokenCounts
from pdserve.forward.kv_cache import num_blocks_for


def kv_cache_blocks(config: EngineConfig, args, device: torch.device, tp, dtype: torch.dtype,
                    extra_layers: int = 0) -> int:
    """Blocks of `config.block_size` tokens for a model of `args` (ModelArgs) stored as `dtype`;
    `tp`: the TensorParallel of a tensor-parallel rank (its share of the KV heads), else None;
    `extra_layers`: layers cached beside the model's (an MTP drafter's), in every block."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    gb = config.kv_cache_gb
    if gb is None and device.type == "cuda":
        # What is free less 1 - gpu_memory_utilization of the card (0.9: a tenth): left for the
        # largest step's activations, the graphs' pools, and the CUDA contexts that peers open
        # on this GPU later (a cuda_ipc decode replica maps a prefill GPU's KV: ~0.5 GiB each).
        # 90 % of the free memory left too little on a card nearly filled by its weights
        # (docs/benchmarks-history.md, routing by cached prefix, 2026-11-27: an OOM on four H100s).
        free, total = torch.cuda.mem_get_info(device)
        reserve = 1.0 - config.gpu_memory_utilization
        # Penalized requests' token counts live beside the cache, grown as they come: room for a
        # full batch of them (~0.2 GB at 256 sequences of a 152k vocabulary), as vLLM's profiling
        # run samples with every penalty on.
        penalties = TokenCounts.most_bytes(config.max_num_seqs, args.vocab_size)
        budget = int(free - reserve * total - penalties)
        if budget <= 0:
            raise RuntimeError(
                f"no GPU memory left for the KV cache on {device}: {free / 2**30:.1f} GiB free of "
                f"{total / 2**30:.1f} after the weights, and {reserve:.0%} of the card stays free for activations "
                f"(gpu_memory_utilization {config.gpu_memory_utilization:g}); raise it, set kv_cache_gb or "
                "num_kv_blocks, or give the replica more GPUs")
    else:
        budget = int((gb or 0.25) * 2**30)
    kind, planes, heads, dim = args.kv_cache_entry()
    if tp is not None and kind == "kv":
        heads = len(tp.kv_heads(args.num_heads, heads))
    n = num_blocks_for(budget, args.num_layers + extra_layers, config.block_size, heads, dim, dtype, planes)
    if tp is not None and config.kv_cache_gb is None and device.type == "cuda":
        # Sized from each GPU's free memory, which differs between ranks; rank 0's block ids
        # address every rank's cache, so all take the smallest.
        n = tp.agree_min(n, device)
    return n
