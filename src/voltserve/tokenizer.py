"""`Tokenizer`: the engine's view of a `tokenizers.Tokenizer` plus the model's special tokens.

Loaders build the wrapped `tokenizers.Tokenizer` (from GGUF metadata or tokenizer.json); this class only adds
the small API the engine and the HTTP layer need (encode with/without special-token parsing, decode,
per-token bytes for logprobs).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders

# Special tokens kept in the text all the same: the markup the tool-call parser reads (voltserve.parsers.hermes).
KEPT_MARKERS = frozenset({"<tool_call>", "</tool_call>"})
# Longer texts are encoded through `encode_batch`, which releases the GIL while it works (`encode` holds it: a
# 4.8 MB prompt stalled every other request of the API process for 1.9 s, though it ran in a thread); shorter
# ones through `encode`, the same ids without the batch's thread hand-off.
ENCODE_INLINE_CHARS = 4096
# Likewise for decoding: longer id lists go through `decode_batch`, which releases the GIL (`decode` holds it:
# ~0.1 s a million ids).
DECODE_INLINE_IDS = 1024


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table (printable stand-in char -> byte).

    Source: openai/gpt-2 encoder.py `bytes_to_unicode`.
    """
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class Tokenizer:
    """Byte-level BPE (or any `tokenizers` model) with the model's special tokens.

    Args:
        backend: the built `tokenizers.Tokenizer`; special tokens must be registered as special AddedTokens.
        bos_token_id: id prepended by `encode(..., add_special_tokens=True)` when `add_bos` is set; None if none.
        eos_token_ids: ids that end generation (first one is `eos_token`).
        add_bos: whether `add_special_tokens=True` prepends BOS (the model's own choice).
        byte_level: tokens use GPT-2's byte-to-unicode alphabet (affects `token_bytes`).
        vocab_size: rows of the embedding (>= the number of tokens the tokenizer knows).

    Raises:
        ValueError: an eos/bos id is outside the vocabulary.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        bos_token_id: int | None,
        eos_token_ids: Iterable[int],
        add_bos: bool = False,
        byte_level: bool = True,
        vocab_size: int | None = None,
    ):
        self._tok = backend
        # A second copy with special-token parsing off: a per-call toggle on one shared object would race
        # between threads (encode runs in `asyncio.to_thread`).
        self._tok_plain = tokenizers.Tokenizer.from_str(backend.to_str())
        self._tok_plain.encode_special_tokens = True
        self.vocab_size: int = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.add_bos = add_bos
        self.byte_level = byte_level
        for i in (*self.eos_token_ids, *(() if bos_token_id is None else (bos_token_id,))):
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"special token id {i} is outside the vocabulary of {self.vocab_size}")
        added = backend.get_added_tokens_decoder()
        self._added_ids = frozenset(added)
        self.special_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._kept_markers = {i: t.content for i, t in added.items() if t.special and t.content in KEPT_MARKERS}
        # the ids `decode(..., skip_special_tokens=True)` leaves out of the text
        self.skipped_ids: frozenset[int] = self.special_ids - frozenset(self._kept_markers)
        specials = [t for t in added.values() if t.special and t.content]
        # special tokens match raw text unless `normalized` (then after the normalizer): a substring test of
        # their contents is a sound first check only in the first case
        raw_match = backend.normalizer is None or not any(t.normalized for t in specials)
        self._special_texts: tuple[str, ...] | None = tuple(t.content for t in specials) if raw_match else None
        self.bos_token: str = "" if bos_token_id is None else self.id_to_token(bos_token_id)
        self.eos_token: str = self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        self._byte_tables: dict[bool, tuple[bytes, ...] | None] = {}  # skip_special_tokens -> byte_table()
        self._max_token_chars: int | None = None  # min_num_tokens' divisor, 0: no bound (built on first use)

    def __reduce__(self):
        # pickled as its constructor's arguments: `tokenizers` does not pickle `encode_special_tokens`, and the
        # byte tables are rebuilt on demand (the engine process sends its tokenizer to the API process)
        return type(self), (self._tok, self.bos_token_id, self.eos_token_ids, self.add_bos, self.byte_level,
                            self.vocab_size)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Text -> token ids.

        Args:
            text: any string.
            add_special_tokens: prepend BOS when the model asks for it (`add_bos`).
            parse_special: treat the literal text of special tokens (e.g. `<|im_end|>`) as those tokens;
                False tokenizes it as plain text (for untrusted user content).

        Returns:
            [num_tokens] ids.
        """
        tok = self._tok if parse_special else self._tok_plain
        if len(text) > ENCODE_INLINE_CHARS:  # encode_batch releases the GIL (the event loop keeps serving)
            ids = tok.encode_batch([text], add_special_tokens=False)[0].ids
        else:
            ids = tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound on `len(encode(text))` (either `parse_special`) for any text of `num_chars` characters,
        so that a prompt far past the context is refused before its seconds of encoding: ceil(num_chars / M), M
        the most bytes one token spells. Sound where every token spells its own bytes of the text: a ByteLevel
        decoder, no normalizer, no added token that strips the whitespace beside it; else 0 (no bound).
        """
        if self._max_token_chars is None:
            self._max_token_chars = self._token_span_limit()
        m = self._max_token_chars
        return -(-num_chars // m) if m else 0

    def _token_span_limit(self) -> int:
        """The most bytes (hence characters) of a text one token covers, or 0 where that is not bounded."""
        added = self._tok.get_added_tokens_decoder().values()
        if self._tok.normalizer is not None or any(t.lstrip or t.rstrip for t in added):
            return 0
        table = self.byte_table(skip_special_tokens=False)  # None unless the decoder is ByteLevel
        return max(map(len, table), default=0) if table is not None else 0

    def may_spell_special(self, text: str) -> bool:
        """False when `text` cannot hold the text of a special token (none occurs in it), so that encoding it with
        and without special-token parsing gives the same ids; True when it may (always, for tokenizers whose
        special tokens match after normalization). A cheap test to run before comparing two encodes."""
        texts = self._special_texts
        return texts is None or any(t in text for t in texts)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text; incomplete UTF-8 sequences become U+FFFD.

        Args:
            ids: token ids.
            skip_special_tokens: drop special (control) tokens from the text, but for KEPT_MARKERS.
        """
        ids = list(ids)
        if not (skip_special_tokens and self._kept_markers and any(i in self._kept_markers for i in ids)):
            return self._decode(ids, skip_special_tokens)
        # decoded around the markers (a whole token each: no UTF-8 character spans one)
        parts, start = [], 0
        for k, i in enumerate(ids):
            if i in self._kept_markers:
                parts += [self._decode(ids[start:k], True), self._kept_markers[i]]
                start = k + 1
        parts.append(self._decode(ids[start:], True))
        return "".join(parts)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        """The backend's decode of `ids`, without the GIL for a long list."""
        if len(ids) > DECODE_INLINE_IDS:  # decode_batch releases the GIL (the event loop keeps serving)
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The raw token string (byte-level alphabet for BPE tokens); '' for an id the tokenizer lacks."""
        tok = self._tok.id_to_token(int(i))
        return "" if tok is None else tok

    def token_bytes(self, i: int) -> bytes:
        """The bytes a token stands for (a BPE token may be part of a UTF-8 character). Used for logprob `bytes`.

        Byte-level BPE tokens map through GPT-2's byte alphabet. SentencePiece-style pieces (not byte-level):
        a byte-fallback piece `<0xNN>` is that one byte and U+2581 (the Metaspace word marker) is a space, as
        their decoders (ByteFallback, Metaspace / Replace) read them; added tokens are their UTF-8 text."""
        tok = self.id_to_token(i)
        if int(i) in self._added_ids:
            return tok.encode("utf-8")
        if not self.byte_level:
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                try:
                    return bytes([int(tok[3:5], 16)])
                except ValueError:
                    pass
            return tok.replace("\u2581", " ").encode("utf-8")
        table = _byte_decoder()
        try:
            return bytes(table[c] for c in tok)
        except KeyError:
            return tok.encode("utf-8")

    def byte_table(self, skip_special_tokens: bool = True) -> tuple[bytes, ...] | None:
        """Bytes of every token id as `decode` joins them, for incremental detokenization by table lookup.

        With a ByteLevel decoder, `decode(ids)` is `b"".join(table[i] for i in ids)` read as UTF-8 (U+FFFD for
        invalid bytes); other decoders (e.g. Metaspace with byte fallback, which turns an invalid run of byte
        tokens into one U+FFFD per token) return None. Built on the first call (~60 ms for SmolLM2's 49k tokens),
        then cached.

        Args:
            skip_special_tokens: special tokens map to b"" (as `decode` drops them) instead of their content, but
                for KEPT_MARKERS: some models mark `<tool_call>` special, and the tool-call parser reads it.

        Returns:
            [max(vocab_size, highest known id + 1)] bytes, b"" for ids the tokenizer does not know; or None.
        """
        if skip_special_tokens not in self._byte_tables:
            self._byte_tables[skip_special_tokens] = self._build_byte_table(skip_special_tokens)
        return self._byte_tables[skip_special_tokens]

    def _build_byte_table(self, skip_special_tokens: bool) -> tuple[bytes, ...] | None:
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        # `tokenizers` looks an id up in the added tokens first, then in the model, and skips a token whose *text*
        # is a special token's; its ByteLevel decoder maps a token through the byte alphabet if every character is
        # in it, else keeps the token's UTF-8 (added tokens included).
        id_to_text = {i: t for t, i in self._tok.get_vocab(with_added_tokens=False).items()}
        added = self._tok.get_added_tokens_decoder()
        id_to_text.update((i, t.content) for i, t in added.items())
        special = {t.content for t in added.values() if t.special} - KEPT_MARKERS if skip_special_tokens else set()
        alphabet = _byte_decoder()
        table = [b""] * max(self.vocab_size, max(id_to_text, default=-1) + 1)
        for i, text in id_to_text.items():
            if text in special:
                continue
            try:
                table[i] = bytes(map(alphabet.__getitem__, text))
            except KeyError:
                table[i] = text.encode("utf-8")
        return tuple(table)

    def __len__(self) -> int:
        return self.vocab_size
