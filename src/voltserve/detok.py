"""Incremental detokenization: token-id deltas -> text deltas that are safe to stream.

Two rules make a streamed delta safe:
1. Never half a UTF-8 character. Byte-level BPE tokens can end inside a character. When the tokenizer offers a
   per-token byte table (`Tokenizer.byte_table`), tokens are looked up and fed to an incremental UTF-8 decoder
   (`detok_bytes.ByteStreamDecoder`); otherwise each step decodes a small window of tokens (prefix/read
   offsets, as vLLM's `detokenize_incrementally` does). Either way new text is held back while it ends with
   U+FFFD, and both give the same deltas.
2. Never part of a stop string. Text whose end could still grow into a stop string is held back; on a match
   the text before it (or through it, if asked) is emitted and everything after is dropped. With `min_tokens`,
   a match that ends within the text of the first min_tokens tokens does not count (vLLM's rule: stop strings
   are ignored until min_tokens tokens are out, as EOS and stop ids are masked until then).

`num_text_tokens` says which tokens the emitted text covers, for logprobs (which OpenAI and vLLM give only for
the tokens of the returned text): see its docstring for the rule.
"""

from __future__ import annotations

import codecs
from bisect import bisect_left
from collections.abc import Sequence

from voltserve.detok_bytes import _REPLACEMENT, ByteStreamDecoder


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into streamable text.

    Args:
        tokenizer: a `voltserve.tokenizer.Tokenizer` (anything with `decode(ids, skip_special_tokens)`; an optional
            `byte_table(skip_special_tokens)` enables the table-lookup path).
        stop: stop strings; the first (earliest in the text) match ends the output.
        include_stop_str_in_output: keep the matched stop string in the emitted text.
        skip_special_tokens: drop special tokens from the text.
        count_text_tokens: keep `num_text_tokens` (a request that asked for logprobs). It costs a list entry per
            token and takes a push of several tokens (a verify step's) token by token; without it, such a push
            without stop strings is decoded at once.
        min_tokens: a stop-string match ending within the text of the first `min_tokens` tokens is ignored (that
            text is emitted); one ending past it counts, even if it begins there. Without `count_text_tokens`, the
            token positions it needs are kept only until the emitted text is past those tokens' text.

    Attributes:
        token_ids: every id pushed so far.
        stop_reason: the stop string that matched, or None.
        finished: a stop string matched; later pushes return nothing.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        count_text_tokens: bool = True,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._min_tokens = min_tokens if self._stop else 0  # cleared once no pending match can end before it
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        # Longest stop-string prefix that may need holding back.
        self._max_hold = max((len(s) - 1 for s in self._stop), default=0)
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: context so the first new token decodes as it would in place
        self._read_offset = 0  # tokens before this are already turned into text
        self._pending = ""  # decoded text not emitted yet (may still become a stop string)
        # with count_text_tokens or min_tokens only (else None, 0, 0): [num_tokens] characters of the text before
        # each token (`_place_run`); characters the decoding layer released (emitted, pending or cut by a stop);
        # the first token whose text it has not released yet
        self._count_text_tokens = count_text_tokens
        counted = count_text_tokens or self._min_tokens > 0
        self._token_starts: list[int] | None = [] if counted else None
        self._num_decoded = 0
        self._run_start = 0
        self._num_emitted = 0  # characters push and flush returned: the output text's length so far
        self.stop_reason: str | None = None
        self.finished = False
        byte_table = getattr(tokenizer, "byte_table", None)
        table = byte_table(skip_special_tokens) if byte_table is not None else None
        self._bytes = ByteStreamDecoder(table) if table is not None else None

    def push(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Add newly generated tokens.

        Args:
            token_ids: [num_new_tokens] ids, in generation order; taken one by one, as if pushed singly, so the
                tokens after the one that completes a stop string are not taken (nor in `token_ids`).

        Returns:
            (text safe to emit now, possibly ""; the stop string that matched, or None). After a match the
            caller should stop the sequence; further pushes return ("", None).
        """
        if self.finished or not token_ids:
            return "", None
        starts = self._token_starts
        if len(token_ids) > 1:
            if starts is not None or self._stop:  # token by token: each token's text position, the stop's token
                text = ""
                for token_id in token_ids:
                    piece, stop = self.push((token_id,))
                    text += piece
                    if stop is not None:
                        return text, stop
                return text, None
            new_ids = list(map(int, token_ids))  # nothing to count or hold back: the tokens at once
            self.token_ids += new_ids
            new = self._bytes.push(new_ids) if self._bytes is not None else self._decode_new()
        elif starts is None:
            token_id = int(token_ids[0])
            self.token_ids.append(token_id)
            new = self._bytes.push((token_id,)) if self._bytes is not None else self._decode_new()
        else:
            token_id = int(token_ids[0])
            starts.append(self._num_decoded)  # exact for the first token of a run; the others: `_place_run`
            self.token_ids.append(token_id)
            prefix_offset = self._prefix_offset
            new = self._bytes.push((token_id,)) if self._bytes is not None else self._decode_new()
            if new:
                self._place_run(new, prefix_offset)
                self._num_decoded += len(new)
        if not self._stop:  # nothing to hold back: the per-token fast path
            self._num_emitted += len(new)
            return new, None
        self._pending += new
        hit = self._find_stop(self._min_tokens_end() if self._min_tokens else 0)
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self._include_stop else index
            out = self._pending[:end]
            self._pending = ""
            self.stop_reason = stop
            self.finished = True
            self._num_emitted += len(out)
            return out, stop
        hold = self._held_suffix_len()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out):]
        self._num_emitted += len(out)
        return out, None

    @property
    def num_text_tokens(self) -> int:
        """How many of the pushed tokens (a leading run) have text in the output emitted so far.

        Rule: a token counts once the emitted text goes on past the text before it (the characters the tokens before
        it decode to that the output keeps as they are: not a U+FFFD standing for bytes of a character that later
        tokens complete; a literal U+FFFD, or one for invalid bytes, is text), i.e. once some of its own text is out.
        So the count ends at the shortest run of leading tokens whose text covers the output: a token from a matched
        stop string's start on (unless the stop string is kept in the output), an EOS or other skipped special token
        at the end, or the bytes of a character cut off by the end of the sequence never count; a token whose text is
        held back (it could begin a stop string, or ends inside a UTF-8 character) counts only once that text is
        emitted. A token that carries only bytes of a split character counts with the character, when it is emitted.
        Once the sequence is over (a stop string matched, or `flush`), the count is final.

        Raises:
            RuntimeError: the detokenizer was made with `count_text_tokens=False`.
        """
        if not self._count_text_tokens:
            raise RuntimeError("num_text_tokens: this detokenizer does not count them (count_text_tokens=False)")
        return bisect_left(self._token_starts, self._num_emitted)

    def flush(self) -> str:
        """Text still held back at the end of the sequence (a stop-string prefix that never completed, or an
        incomplete UTF-8 tail is dropped). Returns "" after a stop-string match."""
        if self.finished:
            return ""
        if self._bytes is not None:
            tail = self._bytes.flush()
        else:
            prefix = self._window_text(self._prefix_offset, self._read_offset)
            tail = self._window_text(self._prefix_offset, len(self.token_ids))[len(prefix):]
        # a sequence cut off inside a multi-byte character: drop the incomplete bytes, never send U+FFFD
        tail = tail.rstrip(_REPLACEMENT)
        if self._token_starts is not None and tail:
            self._place_run(tail, self._prefix_offset)
        out = self._pending + tail
        self._pending = ""
        self._num_emitted += len(out)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.finished = True
        return out

    def _window_text(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self._skip_special)

    def _decode_new(self) -> str:
        """Text of the tokens after the read offset, or "" while it ends inside a UTF-8 character."""
        prefix = self._window_text(self._prefix_offset, self._read_offset)
        full = self._window_text(self._prefix_offset, len(self.token_ids))
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full[len(prefix):]

    def _place_run(self, text: str, prefix_offset: int) -> None:
        """The decoding layer released `text`, the text of the run of tokens since its last release (several when
        it ended inside a character, with U+FFFD, or had no text): place each of the run's tokens after its first
        (which `push` placed) at the characters of `text` that the tokens before it in the run decode to as they
        are in `text` (up to where the two differ: a U+FFFD there stands for bytes of a character the next tokens
        complete, unless `text` has it too, a literal U+FFFD or invalid bytes). Linear in the run's bytes on the
        table path; the windowed path decodes each prefix of the run (after `prefix_offset`, its window start).
        """
        starts, start, end = self._token_starts, self._run_start, len(self.token_ids)
        self._run_start = end
        if end - start < 2:
            return
        base = starts[start]
        if self._bytes is not None:
            decoder = codecs.getincrementaldecoder("utf-8")("replace")
            stable = 0  # characters of the run's bytes so far that no later byte changes: a prefix of `text`
            for j in range(start + 1, end):
                stable += len(decoder.decode(self._bytes.token_bytes(self.token_ids[j - 1])))
                # the bytes of a character not complete yet decode to one U+FFFD: text only if `text` has it too
                incomplete = decoder.getstate()[0] != b""
                starts[j] = base + stable + int(incomplete and text[stable:stable + 1] == _REPLACEMENT)
        else:
            prefix_len = len(self._window_text(prefix_offset, start))
            for j in range(start + 1, end):
                starts[j] = base + _common_prefix_len(self._window_text(prefix_offset, j)[prefix_len:], text)

    def _min_tokens_end(self) -> int | None:
        """Where the text of the first `min_tokens` tokens ends, as an index into the pending text (a match must
        end after it); None while every pushed token is one of them (no match counts yet)."""
        if len(self.token_ids) <= self._min_tokens or self._min_tokens > self._run_start:
            return None  # (the latter: the token is inside a run not released yet, all pending text is before it)
        end = self._token_starts[self._min_tokens] - self._num_emitted
        if end <= 0:  # the pending text, now and from now on, lies past it
            self._min_tokens = 0
            if not self._count_text_tokens:  # the positions were kept for min_tokens only: the plain path from now on
                self._token_starts = None
            return 0
        return end

    def _find_stop(self, after: int | None = 0) -> tuple[int, str] | None:
        """Earliest stop-string occurrence in the pending text that ends past index `after` (longest string wins a
        tie); None when `after` is None."""
        if after is None:
            return None
        best: tuple[int, str] | None = None
        for stop in self._stop:
            # a match must start at or past after - len(stop) + 1 to end past `after`
            index = self._pending.find(stop, after - len(stop) + 1) if after >= len(stop) else self._pending.find(stop)
            if index >= 0 and (best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1]))):
                best = (index, stop)
        return best

    def _held_suffix_len(self) -> int:
        """Length of the longest pending suffix that is a proper prefix of some stop string."""
        text = self._pending
        for length in range(min(self._max_hold, len(text)), 0, -1):
            suffix = text[-length:]
            if any(s.startswith(suffix) for s in self._stop):
                return length
        return 0


def _common_prefix_len(before: str, text: str) -> int:
    """Length of the common prefix of `before` and `text`: `before` is `text`'s start but where trailing U+FFFDs
    may differ (a byte-level decoder's), in C where it is."""
    if text.startswith(before):
        return len(before)
    stem = before.rstrip(_REPLACEMENT)
    if text.startswith(stem):
        rest = text[len(stem):len(before)]
        return len(stem) + len(rest) - len(rest.lstrip(_REPLACEMENT))
    return next((i for i, (a, b) in enumerate(zip(before, text)) if a != b), min(len(before), len(text)))
