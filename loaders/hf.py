"""A local Hugging Face model directory -> `LoadedModel`.

Reads config.json (loaders/hf_config.py), the safetensors weights (single file or sharded with
model.safetensors.index.json), tokenizer.json, and the chat template from tokenizer_config.json or
chat_template.jinja (where transformers >= 4.50 saves it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import time

import tokenizers
import torch

from loaders.hf_config import config_from_hf, read_json
from loaders.model import LoadedModel
from voltserve.config import ModelConfig
from voltserve.errors import LoaderError
from voltserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def _weight_files(model_dir: pathlib.Path) -> list[pathlib.Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(read_json(index).get("weight_map", {}).values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoaderError(f"{model_dir} has no .safetensors weights (pytorch_model.bin is not supported)")
    return files


def load_safetensors(model_dir: pathlib.Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """All decoder weights as fp32 CPU tensors under their HF names.

    Raises:
        LoaderError: a shard is missing/unreadable, or lm_head is missing from an untied model.
    """
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        try:
            shard = load_file(str(path), device="cpu")
        except (OSError, ValueError, RuntimeError) as exc:
            raise LoaderError(f"cannot read {path}: {exc}") from exc
        for name, t in shard.items():
            if name.startswith(("model.", "lm_head.")):
                tensors[name] = t.to(torch.float32).contiguous()
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    elif "lm_head.weight" not in tensors:
        raise LoaderError(f"{model_dir} lacks lm_head.weight and tie_word_embeddings is false")
    if "model.embed_tokens.weight" not in tensors:
        raise LoaderError(f"{model_dir} lacks model.embed_tokens.weight")
    return tensors


def _token_str(value) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def chat_template_from_dir(model_dir: pathlib.Path, tok_cfg: dict) -> str | None:
    """The default chat template: chat_template.jinja, else tokenizer_config.json `chat_template` (a string,
    or a list of {name, template} where the one named "default" wins)."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template


def load_tokenizer(model_dir: pathlib.Path, config: ModelConfig) -> tuple[Tokenizer, dict]:
    """tokenizer.json (+ tokenizer_config.json) -> (Tokenizer, tokenizer_config dict).

    Raises:
        LoaderError: tokenizer.json is missing or unreadable.
    """
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise LoaderError(f"{model_dir} has no tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exception subclasses from Rust
        raise LoaderError(f"cannot read {path}: {exc}") from exc
    tok_cfg = read_json(model_dir / "tokenizer_config.json")
    eos = list(config.eos_token_ids)
    eos_str = _token_str(tok_cfg.get("eos_token"))
    if not eos and eos_str is not None and backend.token_to_id(eos_str) is not None:
        eos = [backend.token_to_id(eos_str)]
    bos = config.bos_token_id
    bos_str = _token_str(tok_cfg.get("bos_token"))
    if bos is None and bos_str is not None:
        bos = backend.token_to_id(bos_str)
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    byte_level = "ByteLevel" in json.dumps(decoder)
    tokenizer = Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=eos,
        add_bos=bool(tok_cfg.get("add_bos_token", False)),
        byte_level=byte_level,
        vocab_size=max(config.vocab_size, backend.get_vocab_size(with_added_tokens=True)),
    )
    return tokenizer, tok_cfg


def load_hf_dir(model_dir: str | pathlib.Path) -> LoadedModel:
    """Load a local Hugging Face model directory.

    Args:
        model_dir: directory with config.json, *.safetensors, tokenizer.json (tokenizer_config.json,
            generation_config.json and chat_template.jinja are optional).

    Returns:
        LoadedModel with fp32 tensors under HF names, no `quantized` entries.

    Raises:
        LoaderError: a required file is missing or unreadable.
        UnsupportedModelError: the architecture or rope scaling is not supported.
    """
    t0 = time.perf_counter()
    model_dir = pathlib.Path(model_dir)
    config = config_from_hf(model_dir)
    tokenizer, tok_cfg = load_tokenizer(model_dir, config)
    if not config.eos_token_ids or config.bos_token_id is None:
        # Older checkpoints name their special tokens only in tokenizer_config.json.
        config = dataclasses.replace(
            config,
            eos_token_ids=config.eos_token_ids or tokenizer.eos_token_ids,
            bos_token_id=config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id,
        )
    tensors = load_safetensors(model_dir, config)
    logger.info("loaded %s in %.1f s: %s", model_dir, time.perf_counter() - t0, config)
    return LoadedModel(
        config=config,
        tensors=tensors,
        tokenizer=tokenizer,
        chat_template=chat_template_from_dir(model_dir, tok_cfg),
        source=str(model_dir),
    )
