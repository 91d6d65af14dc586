"""Model loaders: resolve a spec to a local file or directory, then read it into a `LoadedModel`.

Light to import (no torch): `voltserve serve` checks the model spec (`loaders.sources`) before anything loads.
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING

from loaders.sources import ALIASES, cached_alias_file, check_model_spec, default_cache_dir, resolve_model
from voltserve.errors import LoaderError

if TYPE_CHECKING:
    from loaders.gguf_header import GGUFHeader
    from loaders.model import LoadedModel
    from voltserve.config import ModelConfig


def load_model(spec: str, cache_dir: str | os.PathLike | None = None, progress: bool = True,
               gguf_convert: bool = True) -> LoadedModel:
    """Resolve `spec` and load it.

    Args:
        spec: a `.gguf` path, a Hugging Face directory (config.json + safetensors + tokenizer.json) or a
            built-in alias such as `smollm2-135m-instruct`.
        cache_dir: alias cache directory; None = `$VOLTSERVE_CACHE_DIR` or `~/.cache/voltserve`.
        progress: show a progress bar while fetching an alias.
        gguf_convert: a GGUF's K-quant, Q5 and i-quant weights load as packed Q4_1 / Q8_0 blocks
            (`loaders.gguf_convert`; EngineConfig.gguf_convert "auto"); False: as their exact values in floats.

    Returns:
        The LoadedModel (fp32 CPU weights, tokenizer, chat template).

    Raises:
        LoaderError: the spec cannot be resolved or read.
        UnsupportedModelError: the architecture, a tensor type or the tokenizer is not supported.
    """
    path = resolve_model(spec, cache_dir=cache_dir, progress=progress)
    if path.is_dir():
        from loaders.hf import load_hf_dir

        return load_hf_dir(path)
    from loaders.gguf import load_gguf

    return load_gguf(pathlib.Path(path), convert=gguf_convert)


def peek_model_config(spec: str) -> ModelConfig | None:
    """The hyper-parameters of the model `spec` names, read as `load_model` reads them but without loading it
    (no torch, no weights): a GGUF file's header (checked whole: `loaders.gguf_header`), a Hugging Face
    directory's config.json, or the cached file of a built-in alias.

    Returns:
        the ModelConfig; None for a built-in alias not fetched yet (or whose cached copy is damaged: the loader
        fetches it again).

    Raises:
        LoaderError: the spec is no alias, file or directory, or the file is empty, truncated or corrupt.
        UnsupportedModelError: an architecture (or rope scaling) the loader does not support.
    """
    from loaders.gguf_header import read_gguf_header
    from loaders.hf_config import config_from_hf

    path = check_model_spec(spec)
    if path is not None:
        return config_from_hf(path) if path.is_dir() else read_gguf_header(path).model_config()
    header = _cached_alias_header(spec)
    return header.model_config() if header is not None else None


def _cached_alias_header(spec: str) -> GGUFHeader | None:
    """The GGUF header of built-in alias `spec`'s cached file; None when it
    is not fetched yet or its copy is damaged (the loader then fetches it again)."""
    from loaders.gguf_header import read_gguf_header

    cached = cached_alias_file(ALIASES[spec.strip().lower()], default_cache_dir())
    if cached is None:
        return None
    try:
        return read_gguf_header(cached)
    except LoaderError:
        return None


def peek_packed_weights(spec: str, gguf_convert: bool = True) -> dict[str, tuple[str, int]]:
    """The weights the model `spec` names that the loader keeps block-quantized (`loaders.gguf_names.PACKED_TYPES`,
    and with `gguf_convert` the types `loaders.gguf_convert` converts into them: their blocks run along the input
    features), read from a GGUF file's header without loading it.

    Returns:
        HF name -> (the packed type it loads as, in_features) of every such 2-D weight; {} for a Hugging Face
        directory (its weights load as floats) and for a built-in alias not fetched yet.

    Raises:
        LoaderError: as `peek_model_config`.
    """
    from loaders.gguf_convert import packed_type
    from loaders.gguf_header import read_gguf_header
    from loaders.gguf_names import PACKED_TYPES, hf_name

    path = check_model_spec(spec)
    if path is not None and path.is_dir():
        return {}
    header = read_gguf_header(path) if path is not None else _cached_alias_header(spec)
    if header is None:
        return {}
    packed = {}
    for name, qtype in header.tensor_types.items():
        dims = header.tensor_shapes[name]  # innermost first: (in_features, out_features)
        kept = packed_type(qtype, PACKED_TYPES, gguf_convert)
        if kept is not None and len(dims) == 2 and int(dims[0]) % 32 == 0 and (hf := hf_name(name)) is not None:
            packed[hf] = (kept, int(dims[0]))
    return packed


__all__ = ["load_model", "peek_model_config", "peek_packed_weights", "resolve_model"]
