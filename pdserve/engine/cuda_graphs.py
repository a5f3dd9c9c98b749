"""CUDA graphs of the decode forward, one per batch-size bucket.

A decode step of a MoE model launches hundreds of small kernels (per layer: norms, projections,
RoPE, KV write, attention, routing, experts); at small batches launching them costs more than
running them. A captured graph replays the whole forward with one launch. What the graph reads
lives in static buffers: each step copies its batch into them (padded to the bucket: padded rows
write no KV (slot -1) and attend to nothing (context 0)), replays, and reads the bucket's output.

Captured with the GPU kernels only (TritonAttention reads device-side lengths, TritonMoE's
small-batch path sizes its grids from host-known shapes): nothing in the forward waits for the GPU.

An expert-parallel rank (`exchange` given) captures its MoE exchanges too, on the all-gather path
(static shapes, NCCL collectives inside the graph), for the buckets below the exchange threshold.
Every rank of the group must then replay the same bucket in the same step: the bucket follows the
batch the ranks agreed on (EPExchange.begin_step), not the rank's own, and a rank with nothing
scheduled replays it with padding only (`run_idle`), serving its experts to the others.

A tensor-parallel rank captures its layers' all-reduces (NCCL) in the graphs. Its ranks build their
engines together, so they capture the same buckets in the same order (the warm-up forwards'
collectives pair up); every step, a follower runs rank 0's batch through the same choice
(ModelRunner.forward), so both replay the same bucket.
"""

from collections.abc import Callable

import torch

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.ops.decode_attention import decode_num_splits
from pdserve.ops.mla_decode import mla_num_splits

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)

# Every capture is "thread_local": only the capturing thread's unsafe CUDA calls end it. In "global"
# mode any thread's call does, and a worker has others making CUDA calls at any time (NCCL's and
# torch's watchdog threads, the KV connector's, an engine being torn down beside it in tests): a
# decode capture then failed at random, and a prefill capture silently fell back to eager steps.
CAPTURE_MODE = "thread_local"


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, attention, max_batch: int,
                 max_blocks_per_seq: int, max_context: int, device: torch.device,
                 log: Callable[[str], None] | None = None, exchange=None,
                 kv_scales: tuple[tuple[float, ...], ...] = (), pool=None):
        """`kv_scales`: an FP8 cache's per-layer plane scales (KVLayout.scales), fixed for the
        cache's life, so a captured graph may hold them as kernel arguments. `pool`: a graph memory
        pool shared with the prefill graphs (engine/prefill_graphs.py; one step replays at a time)."""
        self.model, self.kv_cache, self.attention = model, kv_cache, attention
        self.kv_scales = kv_scales
        self.device = device
        self.exchange = exchange
        if exchange is not None:  # from the threshold on, steps exchange by all-to-all: eagerly
            max_batch = min(max_batch, exchange.threshold - 1)
        assert max_batch >= 1, "no batch size to capture"
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        n, w = self.buckets[-1], max_blocks_per_seq
        self.width = w
        z = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, **z)
        self.positions = torch.zeros(n, dtype=torch.long, **z)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, **z)
        self.block_tables = torch.zeros(n, w, dtype=torch.long, **z)
        self.context_lens = torch.zeros(n, dtype=torch.int32, **z)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, **z)
        self.row_valid = torch.zeros(n, dtype=torch.int32, **z)  # EP: padding is not computed nor counted
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # Capture on our GPU whichever is current: Triton launches on the current device.
        with torch.cuda.device(device):
            self._capture(max_context, log, pool if pool is not None else torch.cuda.graph_pool_handle())

    def _batch(self, b: int, max_context: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
            block_tables=self.block_tables[:b], query_start=list(range(b + 1)), context_lens=[max_context] * b,
            logits_indices=self.input_ids[:0], kv_cache=self.kv_cache,
            context_lens_t=self.context_lens[:b], query_start_t=self.query_start[:b + 1], kv_scales=self.kv_scales)

    @torch.inference_mode()
    def _capture(self, max_context: int, log, pool) -> None:
        if log:
            log(f"capturing CUDA graphs of the decode step for batch sizes {self.buckets}")
        fixed = getattr(self.attention, "decode_splits", None)
        stream = torch.cuda.Stream(self.device)
        try:
            # Largest first: the smaller graphs then fit in the memory pool the largest reserved.
            for b in reversed(self.buckets):
                batch = self._batch(b, max_context)
                # The split count is baked into the graph: size it for the longest context allowed.
                self.attention.decode_splits = self._splits(b, max_context)
                if self.exchange is not None:  # every rank captures this bucket now, all-gather path
                    self.exchange.max_tokens, self.exchange.graphed = b, True
                    self.exchange.row_valid = self.row_valid[:b]
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # compiles every kernel variant (and joins NCCL) before capture
                        self.model(batch)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
                    self.outputs[b] = self.model(batch)
                self.graphs[b] = g
        finally:
            self.attention.decode_splits = fixed
            if self.exchange is not None:
                self.exchange.graphed, self.exchange.row_valid = False, None
        torch.cuda.synchronize(self.device)
        if self.exchange is not None:
            self.exchange.graph_batch = self.buckets[-1]

    def _splits(self, batch_size: int, max_context: int) -> int:
        """The decode kernel's split count for a bucket: its programs per sequence are one per KV
        head (GQA), or one per block of query heads (MLA's latent cache has no heads)."""
        args = self.model.args
        if args.is_mla:  # this rank's query heads (a tensor-parallel rank holds its share)
            from pdserve.models.tensor_parallel import rank_heads

            return mla_num_splits(batch_size, rank_heads(args.num_heads, getattr(self.model, "tp", None)),
                                  max_context, self.device)
        return decode_num_splits(batch_size, self.kv_cache.shape[4], max_context, self.device)

    def fits(self, batch: ForwardBatch) -> bool:
        """A decode-only batch (one token per sequence, every sequence with a past) within the buckets;
        for an expert-parallel rank, whether the group agreed to replay this step."""
        n = batch.num_seqs
        fits = (0 < n <= self.buckets[-1] and batch.input_ids.shape[0] == n
                and batch.block_tables.shape[1] <= self.width and batch.context_lens_t is not None)
        if self.exchange is None:
            return fits
        # The agreement saw this rank's batch: a mismatch would leave the other ranks waiting.
        assert fits or not self.exchange.graphed, "the group agreed on graphs for a batch they do not hold"
        return self.exchange.graphed

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's hidden states [n, hidden], by replaying the smallest bucket that holds it
        (expert parallel: the bucket of the group's largest batch)."""
        n = batch.num_seqs
        w = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.block_tables[:n, :w].copy_(batch.block_tables)
        self.context_lens[:n].copy_(batch.context_lens_t)
        return self._replay(n)[:n]

    def run_idle(self) -> None:
        """Expert parallel, nothing scheduled here: replay the agreed bucket with padding only."""
        with torch.cuda.device(self.device):  # (called from the worker's loop thread, which starts on GPU 0)
            self._replay(0)

    def _replay(self, n: int) -> torch.Tensor:
        b = next(x for x in self.buckets if x >= max(n, self.exchange.max_tokens if self.exchange else 0))
        if b > n:  # padded rows: no KV written, nothing attended, no expert load counted
            self.slot_mapping[n:b].fill_(-1)
            self.context_lens[n:b].zero_()
        if self.exchange is not None:
            self.row_valid[:n].fill_(1)
            self.row_valid[n:b].zero_()
        self.graphs[b].replay()
        return self.outputs[b]
