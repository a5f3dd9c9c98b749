"""Turns the logits of the sequences that reached their last token into next tokens."""

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from pdserve.engine.grammar import Grammars
from pdserve.engine.host_lists import on_device
from pdserve.engine.logits_processors import LogitBiases, TokenCounts, hold_off_stops, min_p_mask
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import Drafts, rejection_sample
from pdserve.protocol import SamplingParams, TokenLogprob


_INDEX_STRIDE = 1_000_003  # seed x this + a token's index: distinct streams for distinct (seed, index) pairs


class Sampler:
    """Logit bias, min_tokens and penalties (logits_processors.py), grammar masks (grammar.py), then
    greedy, or temperature, min-p, top-k, top-p; a per-request generator makes seeded requests
    reproducible."""

    def __init__(self, device: torch.device, eos_token_ids: frozenset[int] | set[int] = frozenset()):
        self.device = device
        self.eos_token_ids = eos_token_ids  # what min_tokens holds off besides a request's stop_token_ids
        self._generators: dict[str, torch.Generator] = {}
        self._counts: TokenCounts | None = None  # made by the first penalized request (its size is the vocab's)
        self._biases = LogitBiases(device)
        self.grammars: Grammars | None = None  # set by the engine, which knows the tokenizer

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._biases.forget(request_id)
        if self.grammars is not None:
            self.grammars.forget(request_id)
        if self._counts is not None:
            self._counts.forget(request_id)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits [N, vocab] float32 -> one token id (and its logprob if asked) per row."""
        return self.launch(logits, seqs).result()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence], drafts: Drafts | None = None
               ) -> "Sampled | SampledLater":
        """Sample on the device without waiting for it: the tokens stay on the device (the next step
        reads them there) and start their copy to the host; Sampled.result() waits for that copy.
        Logprobs are the model's, before any processing (vLLM's default, raw_logprobs).
        `drafts`: a verify step's (engine/spec_decode.py), whose rows are `seqs` (PositionViews).
        A step with rows under a grammar starts filling their masks and returns a SampledLater: its
        sampling is queued when first needed, so the fill overlaps the forward and the host's work on
        the step before (grammar.py)."""
        raw = logits.float()
        params = [s.params for s in seqs]
        logits, penalized = self._process(raw, seqs, params, drafts)
        constrained = [i for i, p in enumerate(params) if p.grammar is not None]
        if not constrained:
            return self._draw(raw, logits, seqs, params, drafts, penalized)
        if logits is raw and any(p.logprobs is not None for p in params):
            logits = raw.clone()  # the raw logits stay for logprobs
        filled = self.grammars.begin_mask([seqs[i] for i in constrained], logits.device)
        later = SampledLater(lambda: self._draw(raw, logits, seqs, params, drafts, penalized, (constrained, filled)))
        return later if drafts is None else later.now()  # (a verify step is never overlapped)

    def _draw(self, raw: torch.Tensor, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams],
              drafts: Drafts | None, penalized, masks: tuple[list[int], Future] | None = None) -> "Sampled":
        """The tokens from the processed logits (after the grammar masks, where `masks` has them)."""
        if masks is not None:
            constrained, filled = masks
            self.grammars.apply_mask(logits, constrained, filled)
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            draft = [drafts.host[i] for i in rows] if drafts is not None else None
            tokens[rows] = self._sample_random(logits[rows], [seqs[i] for i in rows], [params[i] for i in rows], draft)
        emitted = drafts.settle(tokens) if drafts is not None else None
        if penalized is not None:
            at, counts_rows = penalized
            self._counts.count(counts_rows, tokens[at], None if emitted is None else emitted[at])
        if masks is not None:  # consumed by the next step's mask, or when the engine reads this step
            self.grammars.defer([seqs[i] for i in masks[0]], tokens[masks[0]])
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        lp = None
        if wanted:
            k = max(max(params[i].logprobs for i in wanted), 1)
            logp = torch.log_softmax(raw[wanted], dim=-1)
            top_lp, top_ids = logp.topk(k, dim=-1)
            chosen = logp.gather(1, tokens[wanted, None])[:, 0]
            lp = (wanted, _to_host(top_ids), _to_host(top_lp), _to_host(chosen))
        return Sampled(tokens, _to_host(tokens), lp, [p.logprobs for p in params], _event(tokens),
                       None if emitted is None else _to_host(emitted))

    def _process(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams],
                 drafts: Drafts | None = None):
        """The logits after logit_bias, min_tokens and the penalties (vLLM's order), and the penalized
        rows (their batch rows, their TokenCounts rows) for counting the tokens sampled. A step
        where no request asks for any of them returns `logits` itself."""
        rows = [i for i, p in enumerate(params) if p.processed]
        if not rows:
            return logits, None
        bias = [i for i in rows if params[i].logit_bias]
        held = [i for i in rows if seqs[i].num_output_tokens < params[i].min_tokens]
        pen = [i for i in rows if params[i].penalized]
        if not (bias or held or pen):
            return logits, None
        logits = logits.clone()  # the raw logits stay for logprobs
        if bias:
            self._biases.add(logits, bias, [seqs[i] for i in bias])
        if held:
            hold_off_stops(logits, held, [self._stop_ids(params[i]) for i in held])
        if not pen:
            return logits, None
        if self._counts is None:
            self._counts = TokenCounts(logits.shape[-1], logits.device)
        rows = self._counts.rows_of([seqs[i] for i in pen])
        at = on_device(pen, logits.device)
        extra = drafts.prefix_counts(pen, logits.shape[-1]) if drafts is not None else None
        logits[at] = self._counts.apply(logits[at], rows, extra)
        return logits, (at, rows)

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_token_ids))

    def _sample_random(self, logits, seqs: list[Sequence], params, draft: list[int] | None = None) -> torch.Tensor:
        temps = on_device([p.temperature for p in params], logits.device)
        logits = logits / temps[:, None]
        if any(p.min_p > 0 for p in params):
            logits = min_p_mask(logits, on_device([p.min_p for p in params], logits.device))
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            logits = self._top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        if draft is not None:  # a verify step: each row's draft token accepted or replaced
            return rejection_sample(probs, draft, lambda i: self._generator(seqs[i], params[i].seed))
        # argmax(p / q) with q ~ Exp(1) draws from p; it lets each row use its own generator. Rows
        # without a seed draw together in one op (a launch per row cost ~9 us each on a GPU: 2 ms a
        # step at 256); a seeded row draws again from its own generator.
        q = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            q.exponential_()
        for i in seeded:
            q[i].exponential_(generator=self._generator(seqs[i], params[i].seed))
        return (probs / q).argmax(dim=-1)

    def _generator(self, seq: Sequence, seed: int | None) -> torch.Generator | None:
        """A seeded request's draw for its next token comes from (seed, that token's index in the
        output) alone, not from a stream this engine kept: so the same seeded request gives the same
        tokens wherever each was sampled — its first on a prefill replica or on its decode replica
        (router.prefill_site picks per attempt), the rest after a hand-off or a migration (resumed
        with its output_ids), or all in one colocated engine."""
        if seed is None:
            return None
        g = self._generators.get(seq.request_id)
        if g is None:
            g = self._generators[seq.request_id] = torch.Generator(device=self.device)
        # The index counts tokens still being sampled by an overlapped step before this one (PENDING).
        return g.manual_seed((seed * _INDEX_STRIDE + seq.num_output_tokens) % (1 << 63))

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = on_device([p.top_k if p.top_k > 0 else vocab for p in params], logits.device)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= ks[:, None]
        ps = on_device([p.top_p for p in params], logits.device)
        probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
        drop |= (probs.cumsum(dim=-1) - probs) >= ps[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)



def _to_host(t: torch.Tensor) -> torch.Tensor:
    """Start copying a device tensor to (pinned) host memory; read it only after the step's event."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _event(t: torch.Tensor):
    if t.device.type == "cpu":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    return ev


class SampledLater:
    """A step's sampling held back until its grammar masks are filled (on the fill thread): queued on
    the device when first needed — by the next step's batch (its `tokens`) or by the step's result."""

    def __init__(self, draw: Callable[[], "Sampled"]):
        self._draw: Callable[[], Sampled] | None = draw
        self._sampled: Sampled | None = None

    def now(self) -> "Sampled":
        if self._sampled is None:
            with torch.inference_mode():  # (the result may be asked for outside the step's)
                self._sampled = self._draw()
            self._draw = None
        return self._sampled

    @property
    def tokens(self) -> torch.Tensor:
        return self.now().tokens

    @property
    def emitted(self) -> torch.Tensor | None:
        return self.now().emitted

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        return self.now().result()


@dataclass
class Sampled:
    """One step's sampled tokens: on the device now, on the host once `done` has fired."""

    tokens: torch.Tensor  # [N] int64 on the step's device
    host: torch.Tensor  # [N] int64, being copied
    logprobs: tuple | None  # (rows that asked, top ids, top logprobs, chosen token's logprob), on the host
    wanted: list[int | None]  # per row: how many alternatives it asked for (None: no logprobs)
    done: object = None  # CUDA event after the copies; None on the CPU
    emitted: torch.Tensor | None = None  # [N] bool, being copied: a verify step's rows that count (Drafts.settle)

    def result(self) -> tuple[list[int], list[TokenLogprob | None]]:
        if self.done is not None:
            self.done.synchronize()
        tokens = self.host.tolist()
        out: list[TokenLogprob | None] = [None] * len(tokens)
        if self.logprobs is not None:
            rows, top_ids, top_lp, chosen = self.logprobs
            top_ids, top_lp, chosen = top_ids.tolist(), top_lp.tolist(), chosen.tolist()
            for r, i in enumerate(rows):
                n = self.wanted[i]
                out[i] = TokenLogprob(tokens[i], chosen[r], list(zip(top_ids[r][:n], top_lp[r][:n])))
        return tokens, out
