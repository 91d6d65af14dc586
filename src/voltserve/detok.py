"""Incremental detokenization: token-id deltas -> text deltas that are safe to stream.

Two rules make a streamed delta safe:
1. Never half a UTF-8 character. Byte-level BPE tokens can end inside a character. When the tokenizer offers a
   per-token byte table (`Tokenizer.byte_table`), tokens are looked up and fed to an incremental UTF-8 decoder
   (`detok_bytes.ByteStreamDecoder`); otherwise each step decodes a small window of tokens (prefix/read
   offsets, as vLLM's `detokenize_incrementally` does). Either way new text is held back while it ends with
   U+FFFD, and both give the same deltas.
2. Never part of a stop string. Text whose end could still grow into a stop string is held back; on a match
   the text before it (or through it, if asked) is emitted and everything after is dropped.
"""

from __future__ import annotations

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
    ):
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        # Longest stop-string prefix that may need holding back.
        self._max_hold = max((len(s) - 1 for s in self._stop), default=0)
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # window start: context so the first new token decodes as it would in place
        self._read_offset = 0  # tokens before this are already turned into text
        self._pending = ""  # decoded text not emitted yet (may still become a stop string)
        self.stop_reason: str | None = None
        self.finished = False
        byte_table = getattr(tokenizer, "byte_table", None)
        table = byte_table(skip_special_tokens) if byte_table is not None else None
        self._bytes = ByteStreamDecoder(table) if table is not None else None

    def push(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Add newly generated tokens.

        Args:
            token_ids: [num_new_tokens] ids, in generation order.

        Returns:
            (text safe to emit now, possibly ""; the stop string that matched, or None). After a match the
            caller should stop the sequence; further pushes return ("", None).
        """
        if self.finished or not token_ids:
            return "", None
        new_ids = list(map(int, token_ids))
        self.token_ids += new_ids
        new = self._bytes.push(new_ids) if self._bytes is not None else self._decode_new()
        if not self._stop:  # nothing to hold back: the per-token fast path
            return new, None
        self._pending += new
        hit = self._find_stop()
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self._include_stop else index
            out = self._pending[:end]
            self._pending = ""
            self.stop_reason = stop
            self.finished = True
            return out, stop
        hold = self._held_suffix_len()
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out):]
        return out, None

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
        out = self._pending + tail.rstrip(_REPLACEMENT)
        self._pending = ""
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

    def _find_stop(self) -> tuple[int, str] | None:
        """Earliest stop-string occurrence in the pending text (longest string wins a tie)."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._pending.find(stop)
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
