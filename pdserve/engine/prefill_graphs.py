"""Prefill steps padded to a token-count bucket, replayed from CUDA graphs.

A prefill step of up to ~4k tokens is host-bound: ~50 kernel launches per layer cost more than the
GPU's work (docs/benchmarks-history.md, light load and first requests). A captured graph launches
the whole forward at once. A step is graphed when its tokens fit a bucket, its sequences a graph's
slots, and it is not decode-shaped (one token per sequence: the decode graphs' steps). A step of
*fresh* prompts (each from position 0, nothing cached) needs nothing but its own K/V; any other
step — a prompt whose prefix is cached, a later chunk, a decoding row beside a prompt — reads keys
through the block tables (`varlen`). Such a step ran eagerly before: a 128-token prompt whose
first 112 tokens were cached took 55 ms to its first token on an H200, against 13 ms uncached
(the eager launch of 48 layers, ~40 ms of host time; docs/benchmarks.md, cached prefixes).

The padded step. The real tokens take rows [0, N) of the bucket's B rows, as they do in the eager
batch, so the hidden states of their last tokens (the logits' rows) sit at the same indices; rows
[N, B) are padding: token 0 at position 0 with slot -1, which every KV write skips. Two layouts:

- `single` (one prompt): the prompt and its padding are one causal sequence of B rows. The prompt's
  rows attend to keys at or before them, never to the padding after them, so they are exact; this
  is the eager path for fresh prompts (SDPA over the step's own K/V at lengths padded to 128 rows,
  or MLA's expanded latents), with B in place of the prompt's length.
- `varlen` (up to max_seqs sequences, K/V caches only: several fresh prompts, or any step with a
  cached prefix, a later chunk or a decoding row): per-sequence attention must then follow device
  data, so the graph runs the paged varlen prefill kernel (pdserve.ops.prefill_attention) over the
  cache the step has just written, reading each sequence's bounds from `query_start_t` and
  `context_lens_t` and its blocks from the block table, which reaches the model's whole context.
  The batch has max_seqs + 1 sequence slots: the sequences, empty slots (no rows), and last the
  padding rows as a sequence of their own with no context (they attend to nothing: zeros, no key
  read). MLA has no varlen kernel for fresh latents: its graphs hold one fresh prompt, and its
  other prefill steps stay eager.

Buckets (`prefill_buckets`): 128-token steps up to 512, then 256 up to 4096, then 512. Up to ~2k
tokens the GPU's time is mostly the experts' weights, read once whatever the token count (all 128
of Qwen3-30B-A3B's experts are hit from ~256 tokens on), so padding a 600-token step to 768 costs
little, while every bucket costs a capture at start, its share of graph memory and a warm-up step.
Padded lengths stay multiples of 128, the lengths whose SDPA plans the warm-up builds anyway.

`PaddedPrefill` is the padding logic with an eager forward over the padded batch (on the CPU it is
how tests check the padding: same logits, same cache, as the unpadded step); `PrefillGraphs`
captures and replays it.
"""

from array import array
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace

import torch

from pdserve.engine.cuda_graphs import CAPTURE_MODE
from pdserve.forward.forward_batch import ForwardBatch
from pdserve.models.layers import SparseMoE

SINGLE, VARLEN = "single", "varlen"
DEFAULT_MAX_TOKENS = 4096  # EngineConfig.prefill_graph_max_tokens on a GPU


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts captured, ascending, the last `max_tokens`: 128 apart up to 512, 256 up to 4096,
    512 beyond."""
    assert max_tokens >= 2, "a fresh prompt step has at least 2 tokens"
    out, b = [], 0
    while True:
        b += 128 if b < 512 else 256 if b < 4096 else 512
        if b >= max_tokens:
            return out + [max_tokens]
        out.append(b)


def _int32(xs: list[int]) -> torch.Tensor:
    return torch.frombuffer(array("i", xs), dtype=torch.int32)


class PaddedPrefill:
    """Pads a prefill step to its bucket in static buffers and runs the model on them."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, kv_scales: tuple[tuple[float, ...], ...],
                 buckets: list[int], max_seqs: int, device: torch.device, max_blocks: int = 0):
        """`max_seqs`: prompts a step may have (1: `single` steps only); `max_blocks`: the blocks of
        the longest context (the model's), which a `varlen` step's block table must reach."""
        assert buckets == sorted(buckets) and buckets[0] >= 2 and max_seqs >= 1
        self.model, self.kv_cache, self.kv_scales = model, kv_cache, kv_scales
        self.buckets, self.max_seqs, self.device = list(buckets), max_seqs, device
        n, s = buckets[-1], max_seqs
        self.page = kv_cache.shape[3]
        # Blocks a sequence's table holds: a prompt of the largest bucket, or a whole context.
        self.width = max(-(-n // self.page), max_blocks)
        z = dict(device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, **z)
        self.row_valid = torch.zeros(n, dtype=torch.int32, **z)  # rows that hold tokens: 1; padding: 0
        self.moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
        self.positions = torch.zeros(n, dtype=torch.long, **z)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, **z)
        self.block_tables = torch.zeros(s + 1, self.width, dtype=torch.long, **z)
        # query_start [s + 2] then context_lens [s + 1]: one copy from the host fills both.
        self.meta = torch.zeros(2 * s + 3, dtype=torch.int32, **z)
        self.query_start, self.context_lens = self.meta[:s + 2], self.meta[s + 2:]
        self.replays: Counter[tuple[int, str]] = Counter()  # (bucket, layout) -> steps run padded

    def shape(self, tokens: int, seqs: int, fresh: bool = True) -> tuple[int, str] | None:
        """(bucket, layout) of a step of `seqs` sequences, `tokens` in all; None: run it unpadded.
        `fresh`: every sequence is a whole prompt from position 0 (one alone: `single`); otherwise
        (a cached prefix, a later chunk, a decoding row beside a prompt) `varlen`, whose attention
        reads every key through the block tables. A step of one token per sequence is decode-shaped
        (the decode kernel, DecodeGraphs) and left out."""
        if tokens <= seqs or tokens > self.buckets[-1] or seqs > self.max_seqs:
            return None
        bucket = next(b for b in self.buckets if b >= tokens)
        if fresh and seqs == 1:
            return bucket, SINGLE
        return (bucket, VARLEN) if self.max_seqs > 1 else None

    def choose(self, batch: ForwardBatch) -> tuple[int, str] | None:
        """The step's (bucket, layout) if it fits a padded step, else None."""
        fresh = batch.query_lens == batch.context_lens
        choice = self.shape(batch.query_start[-1], batch.num_seqs, fresh)  # (the cheap tests first)
        if choice is None or (not fresh and max(batch.context_lens) > self.width * self.page):
            return None
        return choice

    def run(self, batch: ForwardBatch, choice: tuple[int, str]) -> torch.Tensor:
        """Hidden states [bucket, hidden] of the padded step (rows [0, N) are the batch's)."""
        bucket, layout = choice
        query_start, context_lens = self._fill(batch, bucket, varlen=True)
        self.replays[choice] += 1
        # Eagerly the attention reads the host lists: the step's own layout, not the placeholders.
        padded = replace(self.batch(bucket, VARLEN), query_start=query_start, context_lens=context_lens,
                         varlen_rows=None)
        with self.padding(bucket):
            return self.model(padded)

    @contextmanager
    def padding(self, bucket: int):
        """The experts skip the bucket's padding rows while the step runs (or is captured)."""
        for m in self.moes:
            m.row_valid = self.row_valid[:bucket]
        try:
            yield
        finally:
            for m in self.moes:
                m.row_valid = None

    def _fill(self, batch: ForwardBatch, bucket: int, varlen: bool) -> tuple[list[int], list[int]]:
        """Copy the step into the static buffers, padded to `bucket`; with `varlen`, the sequence
        slots too. Returns the varlen layout's host lists (query_start, context_lens)."""
        n, m, s = batch.query_start[-1], batch.num_seqs, self.max_seqs
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.slot_mapping[n:bucket].fill_(-1)  # padding writes no KV (ids and positions: any valid value)
        self.row_valid[:n].fill_(1)
        self.row_valid[n:bucket].zero_()
        # The prompts, then empty slots, then the padding rows as a sequence with no context.
        query_start = batch.query_start + [n] * (s - m) + [bucket]
        context_lens = batch.context_lens + [0] * (s + 1 - m)
        if varlen:
            self.meta.copy_(_int32(query_start + context_lens), non_blocking=True)
            w = min(batch.block_tables.shape[1], self.width)  # a prompt's first `width` blocks hold it whole
            self.block_tables[:m, :w].copy_(batch.block_tables[:, :w])
        return query_start, context_lens

    def batch(self, bucket: int, layout: str) -> ForwardBatch:
        """The static buffers as the batch a graph of (bucket, layout) was captured with. Its host
        lists are fixed at capture: `single`, one sequence of `bucket` rows; `varlen`, placeholders
        (every row in the padding slot) — its attention reads the device lists (`varlen_rows`)."""
        b, s = bucket, self.max_seqs
        rows = dict(input_ids=self.input_ids[:b], positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
                    logits_indices=self.input_ids[:0], kv_cache=self.kv_cache, kv_scales=self.kv_scales)
        if layout == SINGLE:
            return ForwardBatch(**rows, block_tables=self.block_tables[:1], query_start=[0, b], context_lens=[b],
                                context_lens_t=self.context_lens[:1], query_start_t=self.query_start[:2])
        return ForwardBatch(**rows, block_tables=self.block_tables, query_start=[0] * (s + 1) + [b],
                            context_lens=[0] * (s + 1), context_lens_t=self.context_lens,
                            query_start_t=self.query_start, varlen_rows=b)


class PrefillGraphs(PaddedPrefill):
    """The padded steps captured as CUDA graphs, one per (bucket, layout), replayed by `run`."""

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, kv_scales: tuple[tuple[float, ...], ...],
                 buckets: list[int], max_seqs: int, device: torch.device,
                 log: Callable[[str], None] | None = None, pool=None, max_blocks: int = 0):
        """`pool`: a graph memory pool shared with the decode graphs (one step replays at a time)."""
        super().__init__(model, kv_cache, kv_scales, buckets, max_seqs, device, max_blocks)
        # The single layout's attention reads the step's own K/V (the fresh-prompt path), not the cache.
        assert getattr(model.attn_backend, "fresh_sdpa", True), "single-prompt graphs need fresh_sdpa"
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, str], torch.Tensor] = {}
        self.failed: dict[tuple[int, str], str] = {}  # a capture that failed: its steps run eagerly
        with torch.cuda.device(device):  # Triton launches on the current device
            self._capture(log, pool if pool is not None else torch.cuda.graph_pool_handle())

    def layouts(self) -> list[str]:
        return [SINGLE, VARLEN] if self.max_seqs > 1 else [SINGLE]

    @torch.inference_mode()
    def _capture(self, log, pool) -> None:
        if log:
            log(f"capturing CUDA graphs of fresh-prompt steps for {self.buckets} tokens "
                f"({' and '.join(self.layouts())}, up to {self.max_seqs} prompts)")
        stream = torch.cuda.Stream(self.device)
        # Largest first: the smaller graphs then fit in the memory the largest reserved. The
        # buffers hold no step (slots -1, every sequence slot empty): capturing writes no KV.
        for b in reversed(self.buckets):
            for layout in self.layouts():
                batch = self.batch(b, layout)
                try:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(stream), self.padding(b):
                        for _ in range(2):  # every kernel compiled, SDPA's plan built, before capture
                            self.model(batch)
                    torch.cuda.current_stream(self.device).wait_stream(stream)
                    g = torch.cuda.CUDAGraph()
                    with (torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE),
                          self.padding(b)):
                        self.outputs[(b, layout)] = self.model(batch)
                    self.graphs[(b, layout)] = g
                except RuntimeError as e:  # the replica still serves: these steps run eagerly
                    self.failed[(b, layout)] = f"{type(e).__name__}: {e}"
                    if log:
                        log(f"CUDA graph of {layout} fresh-prompt steps of {b} tokens not captured, "
                            f"they run eagerly: {self.failed[(b, layout)]}")
        torch.cuda.synchronize(self.device)

    def shape(self, tokens: int, seqs: int, fresh: bool = True) -> tuple[int, str] | None:
        choice = super().shape(tokens, seqs, fresh)
        return choice if choice in self.graphs else None

    def run(self, batch: ForwardBatch, choice: tuple[int, str]) -> torch.Tensor:
        """Hidden states [bucket, hidden] of the padded step, replayed (rows [0, N) are the batch's)."""
        self._fill(batch, choice[0], varlen=choice[1] == VARLEN)
        self.graphs[choice].replay()
        self.replays[choice] += 1
        return self.outputs[choice]
