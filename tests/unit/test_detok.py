"""IncrementalDetokenizer on the real SmolLM2 tokenizer: UTF-8 hold-back and stop strings."""

from __future__ import annotations

import pytest

from voltserve.detok import IncrementalDetokenizer

SPLIT_TEXTS = ["Smile 😀 and 你好世界, naïve café 🎉🎉!", "日本語のテキスト 🇫🇷 ok", "emoji at the end 🦀🥨"]


def _stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    deltas, stop = [], None
    for i in ids:
        delta, stop = detok.push([i])
        deltas.append(delta)
        if stop is not None:
            break
    return detok, deltas, stop


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_split_characters_never_emit_replacement(smollm2_tokenizer, text):
    tok = smollm2_tokenizer
    ids = tok.encode(text)
    # The case is only meaningful if some token ends inside a UTF-8 character.
    assert any(b"\xef\xbf\xbd" in tok.decode([i]).encode() for i in ids)
    detok, deltas, stop = _stream(tok, ids)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # something was held back mid-character
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text


def test_batched_push_equals_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode(SPLIT_TEXTS[0])
    detok = IncrementalDetokenizer(tok)
    out = "".join(detok.push(ids[i:i + 3])[0] for i in range(0, len(ids), 3))
    assert out + detok.flush() == SPLIT_TEXTS[0]


def test_special_tokens_skipped_or_kept(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hi<|im_end|>")
    assert ids[-1] == 2
    detok, deltas, _ = _stream(tok, ids)
    assert "".join(deltas) + detok.flush() == "Hi"
    detok, deltas, _ = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + detok.flush() == "Hi<|im_end|>"


def test_stop_string_across_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "The answer is STOPWORD and more text after it"
    ids = tok.encode(text)
    detok, deltas, stop = _stream(tok, ids, stop=["STOPWORD"])
    assert stop == "STOPWORD" and detok.stop_reason == "STOPWORD"
    assert "".join(deltas) == "The answer is "
    assert all("S" not in d for d in deltas)  # no delta carries any part of the stop string
    assert detok.flush() == ""
    assert detok.push(tok.encode(" more")) == ("", None)


def test_stop_string_included_when_asked(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("one two three four")
    detok, deltas, stop = _stream(tok, ids, stop=["three", "two three"], include_stop_str_in_output=True)
    assert stop == "two three"  # earliest match wins
    assert "".join(deltas) == "one two three"


def test_incomplete_stop_prefix_is_released(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("a STOP b STO")
    detok, deltas, stop = _stream(tok, ids, stop=["STOPX"])
    assert stop is None
    assert "".join(deltas) == "a STOP b "  # "STOP" released once " b" shows it did not complete
    assert detok.flush() == "STO"


def test_flush_drops_incomplete_utf8_tail(smollm2_tokenizer):
    """A sequence cut off (max_tokens) inside a character ends with the whole characters only, never U+FFFD."""
    tok = smollm2_tokenizer
    ids = tok.encode("x 😀")
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ids[:1]) == ("x", None)
    assert detok.push(ids[1:-1]) == ("", None)  # the emoji's last byte is missing
    assert tok.decode(ids[:-1])[len("x"):] == " \ufffd"
    assert detok.flush() == " "
    assert detok.flush() == ""


def test_num_text_tokens_follows_the_emitted_text(smollm2_tokenizer):
    """Logprobs' rule: the tokens counted are the shortest leading run whose text covers the emitted text."""
    tok = smollm2_tokenizer
    ids = tok.encode("The capital of France is Paris.")  # The| capital| of| France| is| Paris|.
    assert len(ids) == 7
    detok, deltas, stop = _stream(tok, ids, stop=[" is Paris"])
    assert (stop, "".join(deltas)) == (" is Paris", "The capital of France")
    assert detok.num_text_tokens == 4  # " is" (held back, then cut) and " Paris" do not count
    detok, deltas, stop = _stream(tok, ids, stop=["ital of"])
    assert ("".join(deltas), detok.num_text_tokens) == ("The cap", 2)  # " capital" has "cap" in the text
    detok, deltas, stop = _stream(tok, ids, stop=[" France is"], include_stop_str_in_output=True)
    assert ("".join(deltas), detok.num_text_tokens) == ("The capital of France is", 5)
    detok = IncrementalDetokenizer(tok, stop=[" is Lyon"])
    counts = [(detok.push([i]), detok.num_text_tokens)[1] for i in ids[:5]]
    assert counts == [1, 2, 3, 4, 4]  # " is" is held back: it counts once its text is out
    detok.push([tok.encode("<|im_end|>")[0]])  # EOS: skipped special token, no text
    assert (detok.flush(), detok.num_text_tokens) == (" is", 5)


def test_num_text_tokens_leaves_out_a_cut_off_character(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("x 😀😀")
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push([i])[0] for i in ids[:-1]) + detok.flush()  # the last emoji lacks its last byte
    assert text == "x 😀"
    assert len(ids) - 1 > detok.num_text_tokens == len(tok.encode("x 😀"))


def test_without_counting_text_tokens(smollm2_tokenizer):
    """A request without logprobs keeps no per-token positions: a verify step's tokens are decoded at once, and
    `num_text_tokens` is refused rather than wrong."""
    tok = smollm2_tokenizer
    ids = tok.encode("The capital of France is Paris.")
    detok = IncrementalDetokenizer(tok, count_text_tokens=False)
    assert detok.push(ids[:4]) == ("The capital of France", None)
    assert detok.push(ids[4:]) == (" is Paris.", None)
    assert (detok.token_ids, detok._token_starts) == (ids, None)
    with pytest.raises(RuntimeError, match="count_text_tokens"):
        detok.num_text_tokens


class _TableTokenizer:
    """Ids 0-4: a literal U+FFFD, " is", " Paris", "The", the invalid byte 0xff."""

    table = ("\ufffd".encode(), b" is", b" Paris", b"The", b"\xff")

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")


class _BytesTableTokenizer(_TableTokenizer):
    def byte_table(self, skip_special_tokens=True):
        return self.table


@pytest.mark.parametrize("tok", [_TableTokenizer(), _BytesTableTokenizer()], ids=["windowed", "bytes"])
@pytest.mark.parametrize("replacement", [0, 4], ids=["literal", "invalid_byte"])
def test_num_text_tokens_after_a_replacement_character(tok, replacement):
    """A U+FFFD that stays in the text (a literal one, or invalid bytes) is text: the token after it counts only
    once its own text is out, not with the U+FFFD (it once counted from the U+FFFD's release on, so a stop string
    that then cut its text left it a logprob entry)."""
    detok = IncrementalDetokenizer(tok, stop=[" is Paris"])
    counts = [(detok.push([i]), detok.num_text_tokens) for i in (3, replacement, 1, 2)]
    assert counts == [(("The", None), 1), (("", None), 1), (("\ufffd", None), 2), (("", " is Paris"), 2)]


@pytest.mark.parametrize("stop, min_tokens, text, stop_reason", [
    ([" of"], 3, "The capital of France is Paris.", None),  # ends in token 3's text: ignored
    ([" of"], 2, "The capital", " of"),  # ends in token 3's text, past the first 2: counts
    (["of France"], 3, "The capital ", "of France"),  # begins in the first 3 tokens' text, ends past it: counts
    ([" capital", " is"], 3, "The capital of France", " is"),  # " capital" ignored, the later " is" stops
    (["The"], 7, "The capital of France is Paris.", None),  # every token is one of the first 7
])
@pytest.mark.parametrize("count", [True, False], ids=["logprobs", "no_logprobs"])
def test_min_tokens_ignores_stop_strings_that_end_in_their_text(smollm2_tokenizer, stop, min_tokens, text,
                                                                 stop_reason, count):
    """vLLM's rule (its test_min_tokens_with_stop): a stop string does not count until min_tokens tokens are out;
    here, a match whose end lies in the text of the first min_tokens tokens is emitted as text. Pushed one token
    at a time or all at once, the same text; logprobs' count follows it."""
    tok = smollm2_tokenizer
    ids = tok.encode("The capital of France is Paris.")  # The| capital| of| France| is| Paris|.
    detok, deltas, matched = _stream(tok, ids, stop=stop, min_tokens=min_tokens, count_text_tokens=count)
    assert ("".join(deltas) + detok.flush(), matched) == (text, stop_reason)
    if count:
        assert detok.num_text_tokens == len(tok.encode(text))
    whole = IncrementalDetokenizer(tok, stop=stop, min_tokens=min_tokens, count_text_tokens=count)
    out, matched = whole.push(ids)
    assert (out + whole.flush(), matched) == (text, stop_reason)


def test_min_tokens_keeps_positions_without_logprobs_only_while_it_needs_them(smollm2_tokenizer):
    """Without logprobs, the token positions min_tokens reads are dropped once the emitted text is past the first
    min_tokens tokens' text: the rest of the output takes the per-token path of a request without min_tokens."""
    tok = smollm2_tokenizer
    ids = tok.encode("The capital of France is Paris.")  # The| capital| of| France| is| Paris|.
    detok = IncrementalDetokenizer(tok, stop=["Lyon"], min_tokens=2, count_text_tokens=False)
    held = [(detok.push([i])[0], detok._token_starts is not None) for i in ids[:4]]
    assert held == [("The", True), (" capital", True), (" of", False), (" France", False)]
    assert detok.push(ids[4:]) == (" is Paris.", None)
    with pytest.raises(RuntimeError, match="count_text_tokens"):
        detok.num_text_tokens


def test_min_tokens_finds_the_next_occurrence_of_an_ignored_stop_string(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("one, two, three, four.")  # one|,| two|,| three|,| four|.
    for min_tokens, text in ((0, "one"), (2, "one, two"), (3, "one, two"), (4, "one, two, three")):
        detok, deltas, matched = _stream(tok, ids, stop=[","], min_tokens=min_tokens)
        assert ("".join(deltas), matched) == (text, ","), min_tokens
    # a stop string spanning an ignored occurrence and the text after it: "aa" in "aaaa| a|aa|a"
    ids = tok.encode("aaaa aaaa")
    detok, deltas, matched = _stream(tok, ids, stop=["aa"], min_tokens=1)
    assert ("".join(deltas), matched) == ("aaaa ", "aa")
    detok, deltas, matched = _stream(tok, ids, stop=["a a"], min_tokens=1)
    assert ("".join(deltas), matched) == ("aaa", "a a")  # begins in token 1, ends in token 2
