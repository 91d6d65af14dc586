"""`text_offset` of /v1/completions logprobs (api/openai/completions.py `_LogprobsBuilder`): where each token starts
in the returned text, in characters, across stream chunks; tokenizer doubles for the cases the default model's
byte-level tokenizer does not reach (tests/e2e/test_logprobs_text.py has its special-token case)."""

from __future__ import annotations

from api.openai.completions import _LogprobsBuilder
from voltserve.request import TokenLogprob


class _Tokens:
    """A tokenizer double: `pieces[i]` is token i's bytes; `table`: whether it has a byte-level `byte_table`
    (then the ids in `skipped` map to b"" there), else the builder reads `token_bytes` and `skipped_ids`."""

    def __init__(self, pieces: list[bytes], skipped: frozenset[int], table: bool):
        self.pieces, self.skipped_ids = pieces, skipped
        if table:
            self.byte_table = lambda skip_special_tokens: tuple(b"" if i in skipped else p
                                                                for i, p in enumerate(pieces))

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]


def _offsets(tokenizer, chunks: list[list[int]]) -> list[int]:
    builder = _LogprobsBuilder(tokenizer)
    return [o for ids in chunks for o in builder.build(0, [TokenLogprob(i, -1.0) for i in ids]).text_offset]


def test_an_invalid_byte_counts_before_the_next_token():
    """Text "Hi\ufffdé!" from "Hi", a lone C3 (invalid: its U+FFFD is written when C3 A9 arrives), C3 A9, "!": the
    offsets 0, 2, 3, 4 index each token's text, within one chunk or a token a chunk."""
    tok = _Tokens([b"Hi", b"\xc3", b"\xc3\xa9", b"!"], frozenset(), table=True)
    assert _offsets(tok, [[0, 1, 2, 3]]) == _offsets(tok, [[0], [1], [2], [3]]) == [0, 2, 3, 4]


def test_a_split_character_counts_once_whole():
    """👍 over two byte tokens (F0 9F, 91 8D) between "a" and "b": text "a👍b", offsets 0, 1, 1, 2."""
    tok = _Tokens([b"a", b"\xf0\x9f", b"\x91\x8d", b"b"], frozenset(), table=True)
    assert _offsets(tok, [[0, 1], [2, 3]]) == [0, 1, 1, 2]


def test_without_a_byte_table_skipped_ids_add_nothing_and_kept_markers_their_text():
    """A tokenizer without `byte_table`: a skipped special token (<|im_end|>) adds nothing, a special token the
    text keeps (<tool_call>, KEPT_MARKERS) its 11 characters: "Hello<tool_call>!"."""
    tok = _Tokens([b"Hello", b"<tool_call>", b"<|im_end|>", b"!"], frozenset({2}), table=False)
    assert _offsets(tok, [[0, 2, 1, 3]]) == [0, 5, 5, 16]
