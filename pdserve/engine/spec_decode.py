"""Speculative decoding's verification: a step's draft tokens checked against the target model's own
choice, lossless.

A sequence with k draft tokens gets k + 1 rows of logits in its step (after its last token and after
each draft token). Row j is sampled as the sequence's token j would be were drafts 0..j-1 accepted
(its output index, min_tokens, seed and penalty counts advanced by j: `PositionView`, `Drafts`), so
that every sampling parameter keeps its meaning. Row j's token is then:
- greedy: the target's argmax; the draft is accepted when they agree;
- sampled: the draft x itself with probability p(x) (the target's processed distribution; an n-gram
  draft is a point mass, so min(1, p/q) is p), else a draw from p with x removed (the residual
  max(0, p - q), renormalised) — Leviathan et al.'s rejection sampling, whose output is distributed
  as p exactly.
Either way the draft is accepted exactly when row j's token equals it. A sequence keeps rows 0..a,
a the first rejected row (or k: every draft accepted and one more token, the bonus), all on the
device (`Drafts.settle`)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.engine.sequence import Sequence
from pdserve.protocol import SamplingParams


class PositionView:
    """A sequence as its row `offset` of a verify step samples it: `offset` draft tokens further on.
    Carries what the sampler reads of a Sequence (ids, params, the output index)."""

    __slots__ = ("seq", "offset")

    def __init__(self, seq: Sequence, offset: int):
        self.seq, self.offset = seq, offset

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def token_ids(self) -> list[int]:  # the accepted tokens (a penalty row is built from them)
        return self.seq.token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.offset


@dataclass
class Drafts:
    """A verify step's rows: per row the draft token it checks (-1: a sequence's last row, which
    checks none), the draft tokens before it in its sequence, and its sequence's first row."""

    tokens: torch.Tensor  # [rows] int64 on the device
    host: list[int]  # the same, on the host
    prefixes: list[list[int]]  # per row
    first_row: torch.Tensor  # [rows] int64 on the device

    @classmethod
    def of(cls, drafts: list[list[int]], device: torch.device) -> "Drafts":
        tokens, prefixes, first = [], [], []
        for d in drafts:
            start = len(tokens)
            tokens += d + [-1]
            prefixes += [d[:j] for j in range(len(d) + 1)]
            first += [start] * (len(d) + 1)
        return cls(torch.tensor(tokens, device=device), tokens, prefixes, torch.tensor(first, device=device))

    @staticmethod
    def views(seqs: list[Sequence], drafts: list[list[int]]) -> list[PositionView]:
        """The rows' sequences, in row order."""
        return [PositionView(s, j) for s, d in zip(seqs, drafts) for j in range(len(d) + 1)]

    def prefix_counts(self, rows: list[int], vocab: int) -> torch.Tensor:
        """[len(rows), vocab] int32: how often each token occurs among each row's preceding drafts
        (a penalty counts them as generated: they are, where the row is used)."""
        out = torch.zeros(len(rows), vocab, dtype=torch.int32, device=self.tokens.device)
        at = [(k, t) for k, r in enumerate(rows) for t in self.prefixes[r]]
        if at:
            idx = torch.tensor(at, device=out.device)
            out.index_put_((idx[:, 0], idx[:, 1]), torch.ones(len(at), dtype=torch.int32, device=out.device),
                           accumulate=True)
        return out

    def settle(self, tokens: torch.Tensor) -> torch.Tensor:
        """[rows] bool: the rows whose token is emitted — those before which every draft of their
        sequence was accepted (a row's draft is accepted when its token equals it)."""
        missed = (tokens != self.tokens).long()
        before = missed.cumsum(0) - missed  # misses in the rows before each, over the whole batch
        return before == before[self.first_row]


def rejection_sample(probs: torch.Tensor, draft: list[int],
                     generator: Callable[[int], torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [M, vocab] (the target's processed distribution): the row's draft
    token (-1: none, a plain draw) with probability p(draft), else a draw from p with the
    draft removed. Row i draws from generator(i) (None: the global one), taken just before its
    draws: rows of one request share a generator object, reseeded for each row's output index.
    Only the draws are per row; the choice is batched, with no wait for the device."""
    u = torch.ones(probs.shape[0], device=probs.device)  # 1: never below p(draft) (a row with no draft)
    q = torch.empty_like(probs)
    for i, d in enumerate(draft):
        g = generator(i)
        if d >= 0:
            u[i:i + 1].uniform_(generator=g)
        q[i].exponential_(generator=g)  # (a row with no draft draws exactly as the plain sampler's)
    d = torch.tensor(draft, device=probs.device)
    has = d >= 0
    d = d.clamp(min=0)
    accept = has & (u < probs.gather(1, d[:, None])[:, 0])
    residual = probs.clone()
    residual[has, d[has]] = 0
    # p(draft) = 1 up to rounding and yet rejected: nothing else has mass; keep the target's choice.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, probs)
    # argmax(p / q), q ~ Exp(1): a draw from p (normalising is not needed).
    return torch.where(accept, d, (residual / q).argmax(-1))
