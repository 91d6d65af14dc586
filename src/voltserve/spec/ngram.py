"""N-gram drafter: prompt lookup decoding.

The drafts are the tokens that followed the most recent earlier occurrence of the sequence's last n tokens in its
own prompt and output (longest n first). Costs no model: it pays off where outputs copy their input (code
edits, summaries, retrieval answers, repetition). Source: A. Saxena, "Prompt Lookup Decoding" (2023,
github.com/apoorvumang/prompt-lookup-decoding); vLLM's `ngram` speculative method is the same idea.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    """Proposes up to k tokens per sequence by matching its last n tokens earlier in its context.

    Args:
        num_drafts: the most tokens proposed at once (k).
        min_n / max_n: the shortest and longest suffix matched (max_n tried first).
        max_lookback: only the last this many tokens are searched (bounds the host's time per step).
    Raises:
        ValueError: num_drafts < 1, min_n < 1, max_n < min_n or max_lookback <= max_n.
    """

    def __init__(self, num_drafts: int, min_n: int = 2, max_n: int = 4, max_lookback: int = 4096):
        if num_drafts < 1 or min_n < 1 or max_n < min_n or max_lookback <= max_n:
            raise ValueError(f"bad n-gram drafter settings: num_drafts {num_drafts}, n {min_n}..{max_n}, "
                             f"lookback {max_lookback}")
        self.num_drafts = num_drafts
        self.min_n = min_n
        self.max_n = max_n
        self.max_lookback = max_lookback

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k (<= num_drafts) draft tokens that would follow `tokens` (the sequence's prompt then output
        ids); [] when no suffix of min_n..max_n tokens occurred before."""
        k = min(k, self.num_drafts)
        if k < 1 or len(tokens) <= self.min_n:
            return []
        context = np.asarray(tokens[-self.max_lookback:], dtype=np.int64)
        length = len(context)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # windows that end before the last token: the suffix's own position never matches itself
            windows = sliding_window_view(context[:-1], n)
            hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the most recent occurrence
                return context[start:start + k].tolist()
        return []
