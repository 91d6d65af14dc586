"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tools.make_synthetic_checkpoint import save_hf_dir, synthetic_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A Hugging Face directory (config.json, safetensors, tokenizer.json) of the "tiny" random-weight Llama
    (seed 3: vocabulary 320, 2 layers); tests only read it."""
    out = tmp_path_factory.mktemp("tiny")
    save_hf_dir(synthetic_model("tiny", seed=3), out)
    return out


@pytest.fixture
def sock_path():
    """A short socket path (a Unix socket's path has at most ~100 bytes; pytest's tmp_path can be longer)."""
    folder = tempfile.mkdtemp(prefix="vs-")
    yield os.path.join(folder, "engine.sock")
    shutil.rmtree(folder, ignore_errors=True)
