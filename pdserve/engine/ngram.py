"""N-gram drafting (prompt lookup, vLLM's `ngram` method): a sequence's next tokens guessed from its
own past — the tokens that followed the latest earlier occurrence of its last n tokens, n from
prompt_lookup_max down to prompt_lookup_min (the longest n that occurs wins: a longer match is the
better predictor). Free to compute (no model), and right often where an answer quotes its prompt
(code edits, retrieval, summaries) or repeats itself."""

import numpy as np


class NgramDrafter:
    """Proposes drafts per sequence. Each sequence's tokens are kept in a numpy buffer that grows by
    the tokens added since its last proposal: converting the whole list every step cost more than
    the search itself (~1 ms a step for 4k tokens)."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._buffers: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the last n of `token_ids`
        (a sequence's tokens only ever grow); [] when none occurs."""
        if k <= 0 or len(token_ids) < self.n_min + 1:
            return []
        ids = self._tokens(request_id, token_ids)
        end = len(ids)
        # Positions i < end - 1 ending an occurrence of the last 1, 2, ... tokens, narrowed one
        # token further back each round; the latest of each round's survivors is that n's match.
        at = np.flatnonzero(ids[:end - 1] == ids[end - 1])
        latest = {1: at[-1]} if at.size else {}
        for j in range(1, min(self.n_max, end - 1)):
            at = at[at >= j]
            at = at[ids[at - j] == ids[end - 1 - j]]
            if not at.size:
                break
            latest[j + 1] = at[-1]
        for n in range(self.n_max, self.n_min - 1, -1):
            if n in latest:
                start = int(latest[n]) + 1
                return ids[start:start + k].tolist()
        return []

    def forget(self, request_id: str) -> None:
        self._buffers.pop(request_id, None)

    def _tokens(self, request_id: str, token_ids: list[int]) -> np.ndarray:
        """The sequence's tokens as a view of its buffer, the new ones copied in."""
        buf, n = self._buffers.get(request_id, (None, 0))
        end = len(token_ids)
        if buf is None or end > len(buf):
            grown = np.empty(max(2 * end, 64), dtype=np.int64)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = grown
        if end > n:
            buf[n:end] = token_ids[n:end]
        self._buffers[request_id] = (buf, end)
        return buf[:end]


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Drafts for one list of tokens, with no state kept (tests, one-off callers)."""
    return NgramDrafter(n_min, n_max).propose("", token_ids, k)
