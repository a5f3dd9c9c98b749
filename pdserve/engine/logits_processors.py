"""vLLM's logits processors as batched tensor ops: logit_bias, min_tokens, and the presence, frequency
and repetition penalties (before temperature, as vLLM and HF apply them); min_p is the sampler's, after
temperature. Each runs only on the rows that ask for it, and not at all in a step where none does.

The penalties need each request's token counts. They live here, on the device, one row per request
(`TokenCounts`): a row is built from the sequence's tokens the first time the request is sampled on
this engine — the prompt and whatever was generated before (on a decode replica: the first token the
prefill replica sampled, and a moved request's tokens so far), so nothing extra crosses the prefill →
decode hand-off — and every token sampled after is counted on the device, in stream order. Counting
on the device keeps it right under overlap scheduling, where step N+1 is sampled before the host has
seen step N's token."""

import torch

from pdserve.engine.host_lists import on_device
from pdserve.engine.sequence import PENDING, Sequence


class TokenCounts:
    """Per request with a penalty: output-token counts [rows, vocab] int32, the prompt's tokens as a
    mask [rows, vocab] bool, and its penalties [rows] (set once, read by row each step)."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.rows: dict[str, int] = {}  # request id -> its row
        self._free: list[int] = []
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.penalties = torch.zeros(0, 3, device=device)  # (repetition, frequency, presence) per row

    def rows_of(self, seqs: list[Sequence]) -> torch.Tensor:
        """The rows of these sequences [M] int64, each built the first time it is asked for."""
        rows = [self.rows.get(s.request_id) for s in seqs]
        for k, r in enumerate(rows):
            if r is None:  # (several rows of one request in a verify step: built once)
                rows[k] = self.rows.get(seqs[k].request_id)
                if rows[k] is None:
                    rows[k] = self._add(seqs[k])
        return on_device(rows, self.device)

    def _add(self, seq: Sequence) -> int:
        if not self._free:
            self._grow()
        r = self._free.pop()
        self.rows[seq.request_id] = r
        n = seq.num_prompt_tokens
        # Tokens still PENDING are not counted: their step's count() counts them. (A request's
        # first sampling sees none: its row is built before any token of its own is queued.)
        output = [t for t in seq.token_ids[n:] if t != PENDING]
        self.counts[r].zero_()
        self.prompt[r].zero_()
        self.prompt[r, torch.tensor(seq.token_ids[:n], device=self.device)] = True
        if output:
            ids = torch.tensor(output, device=self.device)
            self.counts[r].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        p = seq.params
        self.penalties[r] = torch.tensor([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
        return r

    @staticmethod
    def most_bytes(max_seqs: int, vocab: int) -> int:
        """Memory the rows can reach with `max_seqs` sequences sampled at once, every one penalized:
        rows double from 8 (`_grow`); a row is its counts (int32), its prompt mask (bool) and its
        three penalties (float32)."""
        rows = 8
        while rows < max_seqs:
            rows *= 2
        return rows * (vocab * 5 + 12)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        for name in ("counts", "prompt", "penalties"):
            t = getattr(self, name)
            grown = t.new_zeros((new, *t.shape[1:]))
            grown[:old] = t
            setattr(self, name, grown)
        self._free += range(new - 1, old - 1, -1)

    def forget(self, request_id: str) -> None:
        r = self.rows.pop(request_id, None)
        if r is not None:
            self._free.append(r)

    def count(self, rows: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """The tokens just sampled for these rows [M], on the device; `kept` [M] bool: only those
        (a verify step's rows past a rejected draft are not the request's tokens)."""
        ones = torch.ones_like(tokens, dtype=torch.int32) if kept is None else kept.to(torch.int32)
        self.counts.index_put_((rows, tokens), ones, accumulate=True)

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        """Penalized logits [M, vocab] of the rows' logits [M, vocab] (vLLM's order: repetition, then
        frequency and presence); `extra` [M, vocab] int32: output tokens not counted yet (a verify
        row's preceding drafts)."""
        counts = self.counts[rows] if extra is None else self.counts[rows] + extra
        rep, freq, pres = self.penalties[rows].unbind(-1)
        output_seen = counts > 0
        seen = output_seen | self.prompt[rows]
        rep = rep[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - freq[:, None] * counts - pres[:, None] * output_seen


class LogitBiases:
    """Each request's logit_bias as device tensors (token ids, biases), made the first time it is
    sampled: a step's work is then one scatter, whatever the size of the maps."""

    def __init__(self, device: torch.device):
        self.device = device
        self._of: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """In place: logits [N, vocab] += the bias of each listed row's request (seqs[k] is rows[k]'s)."""
        ids, vals, sizes = [], [], []
        for s in seqs:
            t = self._of.get(s.request_id)
            if t is None:
                bias = s.params.logit_bias
                t = self._of[s.request_id] = (torch.tensor(list(bias), device=self.device),
                                              torch.tensor(list(bias.values()), device=self.device))
            ids.append(t[0])
            vals.append(t[1])
            sizes.append(len(t[0]))
        r = torch.tensor(rows, device=self.device).repeat_interleave(torch.tensor(sizes, device=self.device))
        logits.index_put_((r, torch.cat(ids)), torch.cat(vals).to(logits.dtype), accumulate=True)

    def forget(self, request_id: str) -> None:
        self._of.pop(request_id, None)


def hold_off_stops(logits: torch.Tensor, rows: list[int], stop_ids: list[list[int]]) -> None:
    """In place: the stop tokens of each listed row (a request short of its min_tokens) can not be sampled."""
    r = [row for row, ids in zip(rows, stop_ids) for _ in ids]
    ids = [t for s in stop_ids for t in s]
    dev = logits.device
    logits[torch.tensor(r, device=dev, dtype=torch.long), torch.tensor(ids, device=dev, dtype=torch.long)] = float("-inf")


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [N, vocab] with every token less likely than min_p [N] times the row's most likely at -inf."""
    probs = torch.softmax(logits, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < floor, float("-inf"))
