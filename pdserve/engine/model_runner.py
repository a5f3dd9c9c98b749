"""Builds a step's batch from the scheduler's choice, runs the model, samples.

`launch` queues a step (its ForwardBatch, the forward, the sampling, the tokens' copy to pinned host
memory) without waiting for the device and returns a `Launched`; the engine reads its tokens later.
A sequence sampled in a step not yet read carries a PENDING token, which the next step's batch
takes from that step's sampled ids on the device (overlap scheduling). The layer hook (`layer_done`)
lets a prefill engine stream each layer's KV as soon as it is written; CUDA graphs replace the
forward where a captured bucket holds the step."""

from array import array
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.forward.forward_batch import ForwardBatch
from pdserve.engine.sampler import Sampled, SampledLater, Sampler
from pdserve.protocol import TokenLogprob
from pdserve.engine.scheduler import ScheduledSeq
from pdserve.engine.sequence import PENDING, Sequence
from pdserve.engine.spec_decode import Drafts


def _host(xs: list[int], code: str) -> torch.Tensor:
    """A host tensor of ints ("q": int64, "i": int32), faster than torch.tensor(list)."""
    if not xs:
        return torch.empty(0, dtype=torch.long if code == "q" else torch.int32)
    return torch.frombuffer(array(code, xs), dtype=torch.long if code == "q" else torch.int32)


@dataclass
class Launched:
    """A step whose forward and sampling are queued on the device."""

    scheduled: list[ScheduledSeq]
    sampling: list[Sequence]  # the sequences that get a token, in the rows of `sampled` (a row each)
    sampled: Sampled | SampledLater | None  # (SampledLater: a step under a grammar, queued when needed)
    rows: dict[str, int]  # request id -> row of `sampled`: where the next step finds its input
    # A verify step's draft tokens per sampling sequence (speculative decoding): each has
    # 1 + len(draft) rows of `sampled`, and `rows` is empty (no step overlaps a verify step).
    drafts: list[list[int]] | None = None
    # The step's batch and hidden states, kept where a drafter reads them after the step (the MTP
    # layer: pdserve/engine/mtp_drafter.py); None else.
    batch: ForwardBatch | None = None
    hidden: torch.Tensor | None = None

    def result(self) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
        """Waits for the step; the tokens (and logprobs) of each sampling sequence: one, or in a
        verify step its accepted drafts and the target's token after them."""
        if self.sampled is None:
            return [], []
        tokens, logprobs = self.sampled.result()
        if self.drafts is None:
            return [[t] for t in tokens], [[lp] for lp in logprobs]
        emitted = self.sampled.emitted.tolist()
        out_t, out_lp, row = [], [], 0
        for d in self.drafts:
            n = sum(emitted[row:row + len(d) + 1])
            out_t.append(tokens[row:row + n])
            out_lp.append(logprobs[row:row + n])
            row += len(d) + 1
        return out_t, out_lp


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
                 device: torch.device, kv_scales: tuple[tuple[float, ...], ...] = ()):
        self.model = model
        self.kv_cache = kv_cache
        self.kv_scales = kv_scales  # an FP8 cache's per-layer plane scales (KVLayout.scales)
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(device)
        self.graphs = None  # DecodeGraphs, when the engine captured the decode step (CUDA)
        # PrefillGraphs, when the engine captured steps of fresh prompts (CUDA); tests put a
        # PaddedPrefill here to run the same padding eagerly on the CPU.
        self.prefill_graphs = None
        # Called with each step's batch before its forward: rank 0 of a tensor-parallel replica
        # hands it to the other ranks (pdserve/worker/tp_group.py), which run the same forward.
        self.on_batch: Callable[[ForwardBatch], None] | None = None
        self.keep_hidden = False  # each Launched keeps its batch and hidden states (an MTP drafter's)

    def prepare(self, scheduled: list[ScheduledSeq], prev: Launched | None = None) -> ForwardBatch:
        """The step's batch; a sequence whose last token is PENDING takes it from `prev`'s sampled
        tokens on the device (the step before, still running when this one is queued)."""
        ids, positions, slots, starts, ctx_lens, logit_rows = [], [], [], [0], [], []
        pending_at, pending_rows = [], []
        bs = self.block_size
        width = max(len(s.seq.block_ids) for s in scheduled)
        table: list[int] = []  # [num_seqs * width], rows padded with 0: one tensor built at the end
        for s in scheduled:
            seq, lo, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            hi = lo + n
            blocks = seq.block_ids
            if s.draft:
                # A verify row: its last token and each draft token as a decode row of its own (the
                # same blocks, one more token of context each), so that a verify step is a decode
                # step of B * (k + 1) rows, which the decode graphs hold. Each row's KV is written
                # before the layer's attention reads it, so row j sees the drafts before it.
                for j, tok in enumerate([seq.token_ids[lo], *s.draft]):
                    p = lo + j
                    ids.append(tok)
                    positions.append(p)
                    slots.append(blocks[p // bs] * bs + p % bs)
                    starts.append(starts[-1] + 1)
                    ctx_lens.append(p + 1)
                    table += blocks
                    table += [0] * (width - len(blocks))
                if s.samples:
                    logit_rows += range(starts[-1] - 1 - len(s.draft), starts[-1])
                continue
            if n == 1:  # a decode row: no per-token lists
                ids.append(seq.token_ids[lo])
                positions.append(lo)
                slots.append(blocks[lo // bs] * bs + lo % bs)
            else:
                ids += seq.token_ids[lo:hi]
                positions += range(lo, hi)
                for j in range(lo // bs, (hi - 1) // bs + 1):  # block by block: a 4k chunk is 256 ranges
                    slots += range(blocks[j] * bs + max(lo - j * bs, 0), blocks[j] * bs + min(hi - j * bs, bs))
            if ids[-1] == PENDING:  # only ever a sequence's newest token
                pending_at.append(len(ids) - 1)
                pending_rows.append(prev.rows[seq.request_id])
            starts.append(starts[-1] + n)
            ctx_lens.append(hi)
            table += blocks
            table += [0] * (width - len(blocks))
            if s.samples:
                logit_rows.append(starts[-1] - 1)
        table_t = _host(table, "q").view(len(ctx_lens), width)

        def dev(x):
            return (_host(x, "q") if isinstance(x, list) else x).to(self.device, non_blocking=True)

        input_ids = dev(ids)
        if pending_at:
            input_ids[dev(pending_at)] = prev.sampled.tokens[dev(pending_rows)]
        # One copy for both int32 lists the GPU kernels read.
        lens = _host(ctx_lens + starts, "i").to(self.device, non_blocking=True)
        host = _host(positions, "q"), _host(slots, "q"), table_t
        return ForwardBatch(
            input_ids=input_ids, positions=dev(host[0]), slot_mapping=dev(host[1]),
            block_tables=dev(table_t), query_start=starts,
            context_lens=ctx_lens, logits_indices=dev(logit_rows), kv_cache=self.kv_cache,
            context_lens_t=lens[: len(ctx_lens)], query_start_t=lens[len(ctx_lens):], kv_scales=self.kv_scales,
            host=host)

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], prev: Launched | None = None,
               layer_done: Callable[[int], None] | None = None) -> Launched:
        """Queue one step (forward and sampling) without waiting for the device."""
        if self.device.index is not None:
            # The step may run on any thread (a worker's engine loop), and a thread starts on GPU 0:
            # Triton launches on the current device, whatever device the tensors are on.
            torch.cuda.set_device(self.device)
        batch = self.prepare(scheduled, prev)
        batch.layer_done = layer_done
        if self.on_batch is not None:
            self.on_batch(batch)
        hidden = self.forward(batch)
        kept = (batch, hidden) if self.keep_hidden else (None, None)
        sampling = [s.seq for s in scheduled if s.samples]
        if not sampling:
            return Launched(scheduled, [], None, {}, None, *kept)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if any(s.draft for s in scheduled):
            drafts = [s.draft for s in scheduled if s.samples]
            rows = Drafts.of(drafts, logits.device)
            sampled = self.sampler.launch(logits, Drafts.views(sampling, drafts), rows)
            return Launched(scheduled, sampling, sampled, {}, drafts, *kept)
        sampled = self.sampler.launch(logits, sampling)
        return Launched(scheduled, sampling, sampled, {q.request_id: i for i, q in enumerate(sampling)}, None, *kept)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's hidden states: a decode graph's replay where one holds the batch, a prefill
        graph's where one takes it, else the model eagerly. A tensor-parallel follower calls it with
        rank 0's batch, so both take the same path and their collectives pair up."""
        layer_done = batch.layer_done
        if self.graphs is not None and layer_done is None and self.graphs.fits(batch):
            return self.graphs.run(batch)
        if self.prefill_graphs is not None and (choice := self.prefill_graphs.choose(batch)) is not None:
            hidden = self.prefill_graphs.run(batch, choice)
            if layer_done is not None:
                # Every layer's KV is written by work queued before this point: a hook that records a
                # CUDA event now (the KV connector's) sees it whole, later than layer by layer.
                for layer in range(self.model.args.num_layers):
                    layer_done(layer)
            return hidden
        return self.model(batch)

    def execute(self, scheduled: list[ScheduledSeq],
                layer_done: Callable[[int], None] | None = None
                ) -> tuple[list[list[int]], list[list[TokenLogprob | None]]]:
        """Run one step; returns the tokens (and logprobs) of each sequence whose `samples` is true."""
        return self.launch(scheduled, None, layer_done).result()
