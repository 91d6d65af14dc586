"""Shared test fixtures: the `gpu` skip rule, the default model (fetched once through our own loader), and the
VOLTSERVE_* environment restored after every test (the CLI exports its flags there)."""

from __future__ import annotations

import functools
import os
import pathlib

import pytest

DATA_DIR = pathlib.Path(__file__).parent / "data"
SMOLLM2_ALIAS = "smollm2-135m-instruct"


@functools.cache
def gpu_available() -> bool:
    """True when torch sees a CUDA device and cuda-python's bindings import."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cuda.bindings.driver  # noqa: F401
    except Exception:
        return False
    return True


@pytest.fixture(autouse=True)
def _restore_voltserve_env():
    """`voltserve.cli` exports flags as VOLTSERVE_* variables of this process: undo what a test left behind."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("VOLTSERVE_")}
    yield
    for k in [k for k in os.environ if k.startswith("VOLTSERVE_") and k not in saved]:
        del os.environ[k]
    os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and cuda-python (cuda.bindings)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_gguf() -> pathlib.Path:
    """Path of the default GGUF, resolved through `loaders.resolve_model` into the default cache dir
    (downloaded once per machine, then reused)."""
    from loaders import resolve_model

    return resolve_model(SMOLLM2_ALIAS, progress=False)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """The default model as a `LoadedModel`, loaded once per session (~6 s); treat it as read-only."""
    from loaders.gguf import load_gguf

    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2):
    """The default model's `voltserve.tokenizer.Tokenizer`."""
    return smollm2.tokenizer


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' own model loaded from the same GGUF in fp32 (slow: only tests that ask pay for it)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """transformers' tokenizer converted from the same GGUF (ignores the `smollm` digit split)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
