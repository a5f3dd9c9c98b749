"""N-gram drafting (prompt lookup, vLLM's `ngram` method): a sequence's next tokens guessed from its
own past — the tokens that followed the latest earlier occurrence of its last n tokens. Free to
compute (no model), and right often where an answer quotes its prompt (code edits, retrieval,
summaries) or repeats itself."""

import numpy as np


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to `k` draft tokens: for n from n_max down to n_min, the tokens after the latest earlier
    occurrence of the last n tokens of `token_ids` (the longest n that occurs wins: a longer
    match is the better predictor); [] when none occurs."""
    if k <= 0 or len(token_ids) < n_min + 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    end = len(ids)
    for n in range(min(n_max, end - 1), n_min - 1, -1):
        # Windows starting before the suffix itself: ids[i:i+n] for i in [0, end - n - 1].
        windows = np.lib.stride_tricks.sliding_window_view(ids[:end - 1], n)
        hits = np.flatnonzero((windows == ids[end - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start:start + k].tolist()
    return []
