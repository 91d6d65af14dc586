"""Model loaders: resolve a spec to a local file or directory, then read it into a `LoadedModel`.

Light to import (no torch): `voltserve serve` checks the model spec (`loaders.sources`) before anything loads.
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING

from loaders.sources import resolve_model

if TYPE_CHECKING:
    from loaders.model import LoadedModel


def load_model(spec: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> LoadedModel:
    """Resolve `spec` and load it.

    Args:
        spec: a `.gguf` path, a Hugging Face directory (config.json + safetensors + tokenizer.json) or a
            built-in alias such as `smollm2-135m-instruct`.
        cache_dir: alias cache directory; None = `$VOLTSERVE_CACHE_DIR` or `~/.cache/voltserve`.
        progress: show a progress bar while fetching an alias.

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

    return load_gguf(pathlib.Path(path))


__all__ = ["load_model", "resolve_model"]
