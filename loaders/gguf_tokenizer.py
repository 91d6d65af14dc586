"""Build a `voltserve.tokenizer.Tokenizer` from GGUF metadata (`tokenizer.ggml.*` keys).

Source: GGUF spec (ggml docs/gguf.md, "Tokenizer") and llama.cpp's llama-vocab.cpp for the pre-tokenizer
types. Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`) is supported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from voltserve.errors import UnsupportedModelError
from voltserve.tokenizer import Tokenizer

# llama.cpp token types (llama_token_type / gguf.TokenType)
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes of the tokenizer.json files these pre-tokenizer types come from.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def pre_tokenizer_for(pre: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer for a GGUF `tokenizer.ggml.pre` value.

    Raises:
        UnsupportedModelError: an unknown pre-tokenizer type.
    """
    if pre == "smollm":
        # SmolLM's tokenizer.json: every digit alone, then the GPT-2 split.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()])
    if pre in ("default", "gpt-2", "gpt2", "starcoder", "refact"):
        return _byte_level()
    if pre in ("llama-bpe", "llama3", "falcon3", "dbrx", "smaug-bpe"):
        return _regex_then_bytes(_LLAMA3_SPLIT)
    if pre in ("qwen2", "deepseek-r1-qwen"):
        return _regex_then_bytes(_QWEN2_SPLIT)
    raise UnsupportedModelError(f"unsupported GGUF pre-tokenizer type tokenizer.ggml.pre={pre!r}")


def build_tokenizer(meta: Mapping[str, object]) -> Tokenizer:
    """GGUF tokenizer metadata -> Tokenizer.

    Args:
        meta: GGUF key -> decoded value; uses `tokenizer.ggml.model`, `.pre`, `.tokens`, `.merges`,
            `.token_type`, `.bos_token_id`, `.eos_token_id`, `.eot_token_id`, `.add_bos_token`.

    Returns:
        The Tokenizer; control tokens are special AddedTokens, user-defined tokens plain AddedTokens.

    Raises:
        UnsupportedModelError: a tokenizer model other than `gpt2`, an unknown pre-tokenizer, or no token list.
    """
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedModelError(f"unsupported GGUF tokenizer model tokenizer.ggml.model={model!r} (only gpt2 BPE)")
    tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise UnsupportedModelError("the GGUF has no tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizer_for(str(meta.get("tokenizer.ggml.pre", "default")))
    backend.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types)
                if t == _TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types)
            if t == _TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens(specials)
    if user:
        backend.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return Tokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[int(i) for i in eos_ids],
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        byte_level=True,
        vocab_size=len(tokens),
    )
