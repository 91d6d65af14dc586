"""The table-lookup detokenizer (`detok_bytes`) against the windowed one and against `decode` of all ids.

Random id sequences (multi-byte and emoji text, raw byte tokens that make invalid UTF-8, special tokens) are
pushed in random chunk sizes, with and without stop strings; every delta, the stop reason and the flush must be
the same as the windowed path's, which is what `IncrementalDetokenizer` does for a tokenizer without
`byte_table`.
"""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from tests.api.fake_engine import ByteTokenizer
from tools.make_synthetic_checkpoint import byte_tokenizer
from voltserve.detok import IncrementalDetokenizer
from voltserve.detok_bytes import ByteStreamDecoder
from voltserve.tokenizer import Tokenizer, _byte_decoder

PIECES = ["Hello", " world", "😀", " 你好世界", "naïve café", "🇫🇷", "\u2028", " STOP", "ST", "OP", "\n", "🦀🥨",
          "<|im_end|>", "<|endoftext|>", "<|bos|>", "<|eos|>", "<x y>", "a\u0120b", "日本語", "\ufffd"]
STOPS = [[], ["STOP"], ["好世"], ["OP\n", "ST"], ["😀"], ["<|im_end|>"], ["a b", "🦀"]]


class WindowedOnly:
    """The tokenizer without `byte_table`: `IncrementalDetokenizer` takes the windowed path."""

    def __init__(self, tok):
        self.decode = tok.decode


def _odd_tokenizer() -> Tokenizer:
    """Byte-level BPE with added tokens that test the decoder's rules: a special token whose characters are all
    in the byte alphabet (`Ġ` decodes to a space) and a plain added token with a character outside it (kept as
    UTF-8)."""
    alphabet = sorted(_byte_decoder(), key=_byte_decoder().get)
    backend = tokenizers.Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)} | {"ĠĠ": 256}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<xĠy>", special=True), AddedToken("<|eos|>", special=True)])
    backend.add_tokens([AddedToken("a b", special=False), AddedToken("aĠb", special=False)])
    return Tokenizer(backend, bos_token_id=None, eos_token_ids=[258], vocab_size=300)


def _random_ids(rng: random.Random, tok, vocab_size: int, special_ids: list[int]) -> list[int]:
    ids: list[int] = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.random()
        if kind < 0.6:
            ids += tok.encode(rng.choice(PIECES))
        elif kind < 0.85:
            ids += [rng.randrange(vocab_size) for _ in range(rng.randint(1, 3))]  # often invalid UTF-8
        else:
            ids.append(rng.choice(special_ids))
    return ids


def _run(tok, ids, chunks, count_text_tokens=True, **kwargs):
    """(each push's (text, stop, num_text_tokens after it), flush's text, stop reason, num_text_tokens at the end,
    the ids the detokenizer took); with count_text_tokens=False, None for each num_text_tokens."""
    detok = IncrementalDetokenizer(tok, count_text_tokens=count_text_tokens, **kwargs)

    def count():
        return detok.num_text_tokens if count_text_tokens else None

    deltas = []
    start = 0
    for size in chunks:
        deltas.append((*detok.push(ids[start:start + size]), count()))
        start += size
    flushed = detok.flush()
    return deltas, flushed, detok.stop_reason, count(), detok.token_ids


def _common_prefix_len(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _without_counts(run):
    """(the whole text, the stop reason, the ids taken) of a `_run`."""
    deltas, flushed, stop, _, taken = run
    return "".join(text for text, _, _ in deltas) + flushed, stop, taken


def _tokenizers() -> dict:
    return {"synthetic": byte_tokenizer(320), "fake_engine": ByteTokenizer(), "odd": _odd_tokenizer()}


@pytest.mark.parametrize("name", ["smollm2", "synthetic", "fake_engine", "odd"])
def test_same_deltas_as_windowed_and_decode(name, request):
    tok = request.getfixturevalue("smollm2_tokenizer") if name == "smollm2" else _tokenizers()[name]
    vocab_size = tok.vocab_size
    special_ids = sorted(getattr(tok, "special_ids", None) or range(3))
    assert tok.byte_table(True) is not None
    rng = random.Random(1234)
    sequences = 300 if name == "smollm2" else 600
    for _ in range(sequences):
        ids = _random_ids(rng, tok, vocab_size, special_ids)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.choice([1, 1, 1, 2, 3, 5]))
        kwargs = dict(stop=rng.choice(STOPS), include_stop_str_in_output=rng.random() < 0.5,
                      skip_special_tokens=rng.random() < 0.7)
        fast = _run(tok, ids, chunks, **kwargs)
        assert fast == _run(WindowedOnly(tok), ids, chunks, **kwargs), (ids, chunks, kwargs)
        # without the count (no logprobs), a push of several tokens is decoded at once: the same text (a character
        # completed inside a push may wait for the push's end), stop and ids
        uncounted = _without_counts(fast)
        assert _without_counts(_run(tok, ids, chunks, count_text_tokens=False, **kwargs)) == uncounted, (ids, chunks)
        assert _without_counts(_run(WindowedOnly(tok), ids, chunks, count_text_tokens=False, **kwargs)) == uncounted
        deltas, flushed, stop, num_text_tokens, taken = fast
        text = "".join(d for d, _, _ in deltas) + flushed
        skip = kwargs["skip_special_tokens"]
        if stop is None:  # everything, less an incomplete (or invalid) UTF-8 tail
            assert text == tok.decode(ids, skip_special_tokens=skip).rstrip("\ufffd")
        # logprobs' rule: a token counts iff the text goes on past the text of the tokens before it, as far as the
        # whole sequence's text has it (a U+FFFD for bytes a later token completes is not in it; a literal one is)
        whole = tok.decode(taken, skip_special_tokens=skip)
        starts = [_common_prefix_len(tok.decode(taken[:i], skip_special_tokens=skip), whole) for i in range(len(taken))]
        assert num_text_tokens == sum(start < len(text) for start in starts), (ids, chunks, kwargs)


def test_table_matches_decode_token_by_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for skip in (True, False):
        table = tok.byte_table(skip)
        assert len(table) == tok.vocab_size == 49152
        for i in range(0, len(table), 7):  # one token alone: its bytes read as UTF-8 is what decode gives
            assert table[i].decode("utf-8", errors="replace") == tok.decode([i], skip_special_tokens=skip), i
    assert tok.byte_table(True)[2] == b"" and tok.byte_table(False)[2] == b"<|im_end|>"
    assert tok.byte_table(True) is tok.byte_table(True)  # built once


def test_added_token_rules():
    tok = _odd_tokenizer()
    table = tok.byte_table(False)
    assert table[256] == b"  "  # a model token "ĠĠ"
    assert table[257] == b"<x y>" and tok.byte_table(True)[257] == b""  # special, in the byte alphabet
    assert table[259] == b"a b"  # outside the alphabet (a space): its UTF-8 as is
    assert table[260] == b"a b"  # "aĠb": every character in the alphabet
    assert table[299] == b""  # beyond the known ids, inside vocab_size
    assert [tok.decode([i], skip_special_tokens=False) for i in (256, 257, 259, 260)] == ["  ", "<x y>", "a b", "a b"]


def test_tool_call_markers_stay_in_the_text_when_special():
    """Some models mark `<tool_call>` special: the text keeps it anyway (the tool-call parser reads it), by table
    and by `decode`, while other special tokens are skipped."""
    backend = _odd_tokenizer()._tok
    backend.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=[258], vocab_size=300)
    opened, closed = (backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>"))
    ids = [opened] + tok.encode("{}", add_special_tokens=False) + [closed, 257, 258] + tok.encode("ok")
    assert tok.decode(ids) == "<tool_call>{}</tool_call>ok"
    assert b"".join(tok.byte_table(True)[i] for i in ids) == b"<tool_call>{}</tool_call>ok"
    assert tok.decode(ids, skip_special_tokens=False) == "<tool_call>{}</tool_call><x y><|eos|>ok"
    assert {opened, closed, 257, 258} & tok.special_ids == {opened, closed, 257, 258}
    assert {opened, closed, 257, 258} & tok.skipped_ids == {257, 258}  # what decode leaves out of the text


def test_other_decoders_have_no_table():
    backend = tokenizers.Tokenizer(models.BPE(vocab={"a": 0, "▁": 1}, merges=[]))
    backend.decoder = decoders.Metaspace()
    assert Tokenizer(backend, bos_token_id=None, eos_token_ids=[0]).byte_table() is None


def test_stream_decoder_hold_back_and_flush():
    table = [b"A", "é".encode()[:1], "é".encode()[1:], b"\xff", "\ufffd".encode(), b""]
    dec = ByteStreamDecoder(table)
    assert [dec.push([i]) for i in (0, 1, 2, 3, 0, 4, 1)] == ["A", "", "é", "", "\ufffdA", "", ""]
    assert dec.flush() == ""  # held U+FFFD and the incomplete "é" are both dropped
    assert dec.push([0, 5, 99, 1]) == "" and dec.push([2]) == "Aé"  # ids past the table decode to b""
    with pytest.raises(ValueError, match="negative"):
        dec.push([-1])


def test_token_bytes_of_sentencepiece_pieces():
    """Logprob `bytes` of a SentencePiece-style vocabulary (not byte-level): a byte-fallback piece `<0xNN>` is its
    one byte (two of them spell "é"), U+2581 is a space, other pieces and added tokens their UTF-8 text."""
    vocab = {"<unk>": 0, "▁Hello": 1, "<0xC3>": 2, "<0xA9>": 3, "é": 4, "<0xZZ>": 5, "lo": 6}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens(["</s>"])
    tok = Tokenizer(backend, bos_token_id=None, eos_token_ids=[7], byte_level=False)
    assert [tok.token_bytes(i) for i in range(8)] == [b"<unk>", b" Hello", b"\xc3", b"\xa9", "é".encode(),
                                                      b"<0xZZ>", b"lo", b"</s>"]
    assert tok.token_bytes(2) + tok.token_bytes(3) == tok.decode([2, 3]).encode()
