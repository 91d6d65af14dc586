"""N-gram drafter: prompt lookup decoding.

The drafts are the tokens that followed the most recent earlier occurrence of the sequence's last n tokens in its
own prompt and output (the longest n in min_n..max_n that occurs). Costs no model: it pays off where outputs copy
their input (code edits, summaries, retrieval answers, repetition). Source: A. Saxena, "Prompt Lookup Decoding"
(2023, github.com/apoorvumang/prompt-lookup-decoding); vLLM's `ngram` speculative method is the same idea.
"""

from __future__ import annotations

import weakref

import numpy as np

MAX_NGRAM = 64  # longest suffix matched (EngineConfig.ngram_max's bound)


def lookup(context: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `context` ([L] int
    array) of min_n..max_n tokens; [] when none occurred. One pass over the context for the last token, then
    the candidates alone for longer suffixes."""
    length = len(context)
    if k < 1 or length <= min_n:
        return []
    # positions p < L - 1 where the last token occurred: candidates for a match ending at p
    cand = np.flatnonzero(context[:-1] == context[-1])
    best, n = None, 1
    while len(cand):
        if n >= min_n:
            best = cand
        if n == max_n:
            break
        cand = cand[cand >= n]  # room for one more token before the match
        cand = cand[context[cand - n] == context[length - 1 - n]]
        n += 1
    if best is None:
        return []
    start = int(best[-1]) + 1  # the most recent occurrence of the longest suffix
    return context[start:start + k].tolist()


class NgramDrafter:
    """Proposes up to k tokens per sequence by matching its last n tokens earlier in its context.

    Keeps each sequence's tokens in a numpy array that grows with its output (no per-step conversion of the
    whole context); arrays go with their sequences (weak references).

    Args:
        num_drafts: the most tokens proposed at once (k).
        min_n / max_n: the shortest and longest suffix matched.
        max_lookback: only the last this many tokens are searched (bounds the host's time per step).
    Raises:
        ValueError: num_drafts < 1, not 1 <= min_n <= max_n <= MAX_NGRAM, or max_lookback <= max_n.
    """

    def __init__(self, num_drafts: int, min_n: int = 2, max_n: int = 4, max_lookback: int = 4096):
        if num_drafts < 1 or not 1 <= min_n <= max_n <= MAX_NGRAM or max_lookback <= max_n:
            raise ValueError(f"bad n-gram drafter settings: num_drafts {num_drafts}, n {min_n}..{max_n}, "
                             f"lookback {max_lookback}")
        self.num_drafts = num_drafts
        self.min_n = min_n
        self.max_n = max_n
        self.max_lookback = max_lookback
        self._tokens: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> [buffer, length]

    def propose(self, seq, k: int) -> list[int]:
        """Up to k (<= num_drafts) draft tokens to follow `seq` (a `voltserve.sequence.Sequence`: its prompt then
        output ids); [] when no suffix of min_n..max_n tokens occurred before."""
        k = min(k, self.num_drafts)
        if k < 1:
            return []
        return lookup(self._context(seq), k, self.min_n, self.max_n)

    def _context(self, seq) -> np.ndarray:
        """The last max_lookback tokens of seq, from its cached array (extended by the new output ids)."""
        total = seq.num_tokens
        entry = self._tokens.get(seq)
        if entry is None or entry[1] > total:  # new, or shorter than cached (never in practice): rebuild
            buf = np.empty(max(64, 2 * total), dtype=np.int64)
            buf[:total] = seq.token_ids()
            entry = self._tokens[seq] = [buf, total]
        buf, have = entry
        if have < total:
            if total > len(buf):
                buf = np.concatenate([buf[:have], np.empty(total, dtype=np.int64)])
                entry[0] = buf
            out = seq.output_ids
            buf[have:total] = out[len(out) - (total - have):]
            entry[1] = total
        return buf[max(0, total - self.max_lookback):total]
