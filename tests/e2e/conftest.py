"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from tools.make_synthetic_checkpoint import save_hf_dir, synthetic_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A Hugging Face directory (config.json, safetensors, tokenizer.json) of the "tiny" random-weight Llama
    (seed 3: vocabulary 320, 2 layers); tests only read it."""
    out = tmp_path_factory.mktemp("tiny")
    save_hf_dir(synthetic_model("tiny", seed=3), out)
    return out
