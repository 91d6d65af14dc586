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
        min_tokens: a stop-string match ending within the text of the first `min_tokens` tokens is ignored (that
            text is emitted); one ending past it counts, even if it begins there.

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
        self._num_decoded = 0  # characters the decoding layer released (emitted, pending or cut by a stop)
        self._num_chars = 0  # whole characters the pushed tokens decode to (held ones of a split character too)
        self._token_starts: list[int] = []  # [num_tokens] whole characters decoded before each token
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
        if len(token_ids) > 1:  # token by token: each token's text position (`num_text_tokens`)
            text = ""
            for token_id in token_ids:
                piece, stop = self.push((token_id,))
                text += piece
                if stop is not None:
                    return text, stop
            return text, None
        token_id = int(token_ids[0])
        self._token_starts.append(self._num_chars)
        self.token_ids.append(token_id)
        if self._bytes is not None:
            new = self._bytes.push((token_id,))
            held = self._bytes.num_held_chars if not new else 0
        else:
            new, held = self._decode_new()
        self._num_decoded += len(new)
        self._num_chars = self._num_decoded + held
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

        Rule: a token counts once the emitted text goes on past the whole characters that the tokens before it
        decode to, i.e. once some of its own text is out. So the count ends at the shortest run of leading tokens
        whose text covers the output: a token from a matched stop string's start on (unless the stop string is
        kept in the output), an EOS or other skipped special token at the end, or the bytes of a character cut off
        by the end of the sequence never count; a token whose text is held back (it could begin a stop string,
        or ends inside a UTF-8 character) counts only once that text is emitted. A token that carries only
        bytes of a split character counts with the character, when it is emitted. Once the sequence is over
        (a stop string matched, or `flush`), the count is final.
        """
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
        out = self._pending + tail.rstrip(_REPLACEMENT)
        self._pending = ""
        self._num_emitted += len(out)
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self.finished = True
        return out

    def _window_text(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self._tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self._skip_special)

    def _decode_new(self) -> tuple[str, int]:
        """(text of the tokens after the read offset, or "" while it ends inside a UTF-8 character; the whole
        characters held back meanwhile, as `ByteStreamDecoder.num_held_chars` counts them)."""
        prefix = self._window_text(self._prefix_offset, self._read_offset)
        full = self._window_text(self._prefix_offset, len(self.token_ids))
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return "", len(full[len(prefix):].rstrip(_REPLACEMENT))
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return full[len(prefix):], 0

    def _min_tokens_end(self) -> int | None:
        """Where the text of the first `min_tokens` tokens ends, as an index into the pending text (a match must
        end after it); None while every pushed token is one of them (no match counts yet)."""
        if len(self.token_ids) <= self._min_tokens:
            return None
        end = self._token_starts[self._min_tokens] - self._num_emitted
        if end <= 0:  # the pending text, now and from now on, lies past it
            self._min_tokens = 0
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
