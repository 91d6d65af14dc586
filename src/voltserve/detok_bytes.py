"""Incremental detokenization by table lookup, for tokenizers whose decode is "concatenate bytes, then UTF-8".

Byte-level BPE (GPT-2's ByteLevel decoder: SmolLM2, Llama-3, Qwen) decodes a list of ids as the concatenation of
each token's bytes read as UTF-8 with U+FFFD for invalid bytes. So a stream of ids can be decoded with one table
lookup per token and an incremental UTF-8 decoder, instead of decoding a window of tokens twice per step through
`tokenizers` (what `detok.IncrementalDetokenizer` does for any other decoder). The emitted text is the same, delta
by delta, as the windowed path's (see `ByteStreamDecoder.push`).
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

_REPLACEMENT = "\ufffd"


class ByteStreamDecoder:
    """One sequence's token ids -> text, never ending inside a UTF-8 character.

    Args:
        table: [table_size] bytes of each token id (b"" for ids the tokenizer drops, such as skipped special
            tokens); ids >= table_size decode to b"", as `tokenizers` drops ids it does not know.
    """

    def __init__(self, table: Sequence[bytes]):
        self._table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        # Decoded text not released yet: it ends with U+FFFD (an invalid byte, or a literal U+FFFD), which the
        # windowed path cannot tell from a character still being completed, so it holds it back too.
        self._unreleased = ""

    def push(self, token_ids: Sequence[int]) -> str:
        """Text of the new tokens (plus any held back before), or "" while it would end inside a character.

        Matches the windowed path: text is held while the decoded tail ends with U+FFFD or the decoder holds the
        first bytes of a character; every release point is a character boundary, so decoding on from there
        gives what decoding the window would.

        Raises:
            ValueError: a negative id.
        """
        table = self._table
        if len(token_ids) == 1 and 0 <= token_ids[0] < len(table):  # the per-token case
            data = table[token_ids[0]]
        else:
            data = b"".join([self._lookup(i) for i in token_ids])
        text = self._unreleased + self._utf8.decode(data)
        if (text and text[-1] == _REPLACEMENT) or self._utf8.getstate()[0]:
            self._unreleased = text
            return ""
        self._unreleased = ""
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` decodes to (b"" for an id the table drops or does not have).

        Raises:
            ValueError: a negative id.
        """
        return self._lookup(token_id)

    def flush(self) -> str:
        """Everything not released, with an incomplete or invalid UTF-8 tail dropped (never a trailing U+FFFD)."""
        text = (self._unreleased + self._utf8.decode(b"", final=True)).rstrip(_REPLACEMENT)
        self._unreleased = ""
        self._utf8.reset()
        return text

    def _lookup(self, token_id: int) -> bytes:
        if token_id < 0:
            raise ValueError(f"token id {token_id} is negative")
        return self._table[token_id] if token_id < len(self._table) else b""
