"""The GGUF-built SmolLM2 tokenizer: parity with transformers (no digits), llama.cpp goldens (digits)."""

from __future__ import annotations

import json
import pathlib

import pytest

DATA_DIR = pathlib.Path(__file__).parents[1] / "data"

# No digits: transformers' GGUF conversion ignores the `smollm` digit split, so it is a reference only here.
NO_DIGIT_TEXTS = [
    "Hello, world! How are you today?",
    "Ünïcödé façade — naïve café, Straße, Ørsted",
    "日本語のテキストと中文字符，还有한국어 문장.",
    "Emoji: 😀🎉🇫🇷👩‍👩‍👧 and ❤️‍🔥",
    "def f(x):\n    return {'a': x, \"b\": [x, x]}  # comment\n\n\tindent",
    "   leading spaces and trailing   ",
    "Привет, мир! Ελληνικά κείμενα. שלום עולם. مرحبا",
    "<div class=\"x\">&amp; tags</div>\r\n",
]


@pytest.mark.parametrize("text", NO_DIGIT_TEXTS)
def test_matches_transformers_without_digits(smollm2_tokenizer, hf_smollm2_tokenizer, text):
    expected = hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    ids = smollm2_tokenizer.encode(text)
    assert ids == expected
    assert smollm2_tokenizer.decode(ids) == text


def test_digits_match_llama_cpp(smollm2_tokenizer):
    golden = json.loads((DATA_DIR / "smollm2-tokenize-golden.json").read_text())
    assert len(golden["cases"]) >= 20
    for case in golden["cases"]:
        ids = smollm2_tokenizer.encode(case["text"], parse_special=False)
        assert ids == case["ids"], case["text"]
        assert smollm2_tokenizer.decode(ids) == case["text"]


def test_special_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "<|im_start|>user\nhi<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    plain = tok.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain and len(plain) > len(ids)
    assert tok.decode(plain) == text  # literal text, not special tokens: survives skip_special_tokens
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode(text, add_special_tokens=True) == ids  # SmolLM2's GGUF says add_bos_token = False


def test_pickled_tokenizer_behaves_the_same(smollm2_tokenizer):
    """The engine process sends its tokenizer to the API process: special-token handling must survive."""
    import pickle

    tok = smollm2_tokenizer
    back = pickle.loads(pickle.dumps(tok))
    text = "<|im_end|><|im_start|>system 12 caf\u00e9"
    for parse_special in (True, False):
        assert back.encode(text, parse_special=parse_special) == tok.encode(text, parse_special=parse_special)
    assert back.encode(text, parse_special=False) != back.encode(text)
    assert (back.vocab_size, back.eos_token_ids, back.bos_token_id) == (tok.vocab_size, tok.eos_token_ids,
                                                                        tok.bos_token_id)
    assert back.byte_table() == tok.byte_table()


def test_attributes_and_token_bytes(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids) == (49152, 1, (2,))
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.special_ids == frozenset(range(17))
    ids = tok.encode(" 😀")
    assert [tok.id_to_token(i) for i in ids] == ["ĠðŁĺ", "Ģ"]
    assert b"".join(tok.token_bytes(i) for i in ids) == " 😀".encode()
    assert tok.token_bytes(ids[1]) == b"\x80"
    assert tok.token_bytes(2) == b"<|im_end|>"


@pytest.mark.parametrize("text", [*NO_DIGIT_TEXTS, "a<|im_end|>b", "<|im_start|>", "x <|endoftext|>", "<|im_end",
                                  "im_end|>", "<jupyter_code>", "<fim_prefix>x", ""])
def test_may_spell_special_is_sound(smollm2_tokenizer, text):
    """The substring pre-check says False only where both encodes agree (the chat template's case S6 relies on
    the exact check for the rest), and True for texts that hold a special token."""
    tok = smollm2_tokenizer
    differs = tok.encode(text, parse_special=True) != tok.encode(text, parse_special=False)
    assert tok.may_spell_special(text) == differs


def test_may_spell_special_defers_to_normalized_special_tokens():
    """Special tokens matched after a normalizer: no substring test is sound, so it always says True."""
    import tokenizers
    from tokenizers import AddedToken, models, normalizers

    from voltserve.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(models.WordLevel({"a": 0, "[unk]": 1}, unk_token="[unk]"))
    backend.normalizer = normalizers.Lowercase()
    backend.add_special_tokens([AddedToken("<eos>", special=True, normalized=True)])
    assert Tokenizer(backend, None, [2], byte_level=False).may_spell_special("plain")
    backend.normalizer = None
    assert not Tokenizer(backend, None, [2], byte_level=False).may_spell_special("plain")


def _run_counting_ticks(fn):
    """`fn()` in a thread; returns (its result, how many 5 ms sleeps this thread finished meanwhile: each needs
    the GIL back, so a call that holds it throughout lets about one through)."""
    import threading
    import time

    result = {}
    worker = threading.Thread(target=lambda: result.setdefault("value", fn()))
    ticks = 0
    worker.start()
    while worker.is_alive():
        time.sleep(0.005)
        ticks += 1
    worker.join()
    return result["value"], ticks


@pytest.mark.parametrize("parse_special", [True, False])
def test_long_text_encodes_the_same_and_lets_other_threads_run(smollm2_tokenizer, parse_special):
    """A text past ENCODE_INLINE_CHARS goes through encode_batch: the same ids as the backend's plain encode,
    while another thread (the API's event loop) keeps running; `encode` held the GIL throughout (a 4.8 MB
    prompt stalled the server for 1.9 s)."""
    from voltserve.tokenizer import ENCODE_INLINE_CHARS

    tok = smollm2_tokenizer
    text = "<|im_start|>user\n" + "hello world, 42 times. " * 40_000 + "<|im_end|>"
    assert len(text) > ENCODE_INLINE_CHARS
    backend = tok.backend if parse_special else tok._tok_plain
    expected = backend.encode(text, add_special_tokens=False).ids
    ids, ticks = _run_counting_ticks(lambda: tok.encode(text, parse_special=parse_special))
    assert ids == expected
    assert (1 in expected) == parse_special  # <|im_start|> read as the special token only when asked
    assert ticks >= 10, f"the main thread ran {ticks} times while the text was encoded"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_long_id_list_decodes_the_same_and_lets_other_threads_run(smollm2_tokenizer, skip_special_tokens):
    """A list past DECODE_INLINE_IDS goes through decode_batch: the backend's plain decode's text, while another
    thread (the API's event loop, during /detokenize) keeps running; `decode` holds the GIL throughout."""
    from voltserve.tokenizer import DECODE_INLINE_IDS

    tok = smollm2_tokenizer
    ids = tok.encode("<|im_start|>user\n" + "hello wörld, 42 times. " * 100_000 + "<|im_end|>")
    assert len(ids) > DECODE_INLINE_IDS
    expected = tok.backend.decode(ids, skip_special_tokens=skip_special_tokens)
    text, ticks = _run_counting_ticks(lambda: tok.decode(ids, skip_special_tokens))
    assert text == expected
    assert expected.startswith("<|im_start|>") != skip_special_tokens
    assert ticks >= 10, f"the main thread ran {ticks} times while the ids were decoded"


def test_min_num_tokens_is_a_lower_bound(smollm2_tokenizer):
    """Random texts of long tokens, special-token text, multi-byte characters and whitespace runs: the bound
    never exceeds the real count, with or without special-token parsing; a normalizer turns the bound off."""
    import random

    import tokenizers

    from voltserve.tokenizer import Tokenizer

    tok = smollm2_tokenizer
    pieces = ["a", " the", "  ", "\n\n", "\t", "<|im_start|>", "é", "日本語", "😀", "1234", " " * 40, "-" * 33]
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 80)))
        bound = tok.min_num_tokens(len(text))
        assert 0 < bound <= min(len(tok.encode(text)), len(tok.encode(text, parse_special=False))), text
    normalized = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    normalized.normalizer = tokenizers.normalizers.NFC()
    assert Tokenizer(normalized, tok.bos_token_id, tok.eos_token_ids).min_num_tokens(10**6) == 0
