"""Hugging Face `config.json` (+ `generation_config.json`) -> `ModelConfig`.

Source: transformers' LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config field names; transformers 5 moved
`rope_theta` / `rope_scaling` into `rope_parameters`, both spellings are read.
"""

from __future__ import annotations

import json
import pathlib

from voltserve.config import ModelConfig
from voltserve.errors import LoaderError, UnsupportedModelError

# HF architecture class -> ModelConfig.architecture (the decoder family the engine builds).
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# the config.json keys without which no ModelConfig can be built (the others have defaults)
REQUIRED_KEYS = ("architectures", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads")


def read_json(path: pathlib.Path) -> dict:
    """A JSON file as a dict; {} when the file does not exist.

    Raises:
        LoaderError: the file exists but is not valid JSON.
    """
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise LoaderError(f"cannot read {path}: {exc}") from exc


def _id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _rope(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def config_from_hf(model_dir: pathlib.Path) -> ModelConfig:
    """Read `config.json` (and `generation_config.json` for EOS ids) from a Hugging Face model directory.

    Args:
        model_dir: directory holding config.json.

    Returns:
        ModelConfig with rope_style "neox" (HF checkpoints store Q/K in the rotate-halves layout).

    Raises:
        UnsupportedModelError: an architecture not in `ARCHITECTURES`, or rope scaling (not implemented).
        LoaderError: config.json is missing, unreadable, lacks a required field or holds one of the wrong type or
            range (a traceback-free message: `voltserve serve` checks it before the load).
    """
    path = model_dir / "config.json"
    if not path.is_file():
        raise LoaderError(f"{model_dir} has no config.json")
    cfg = read_json(path)
    if not isinstance(cfg, dict):
        raise LoaderError(f"{path} is not a JSON object")
    try:
        missing = missing_keys(cfg)
        if missing:  # all of them at once: a `{}` (a failed download, say) was "no readable config.json" before
            raise LoaderError(f"{path} lacks required key(s): {', '.join(repr(k) for k in missing)}")
        config = _model_config(model_dir, cfg)
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:  # e.g. a string where a count goes
        raise LoaderError(f"{model_dir}: a value in config.json or generation_config.json has the wrong type or "
                          f"range: {exc}") from exc
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):
        if getattr(config, name) < 1:
            raise LoaderError(f"{path} gives {name} {getattr(config, name)}: a size or count must be >= 1")
    return config


def _merged(cfg: dict) -> dict:
    """config.json's keys over those of its `text_config` (a multimodal checkpoint's decoder).

    Raises:
        TypeError: `text_config` is neither an object nor null.
    """
    return {**(cfg.get("text_config") or {}), **cfg}


def missing_keys(cfg: dict) -> list[str]:
    """The `REQUIRED_KEYS` that the parsed config.json `cfg` (or its `text_config`) lacks or sets to null, [] or ""."""
    merged = _merged(cfg)
    return [key for key in REQUIRED_KEYS if merged.get(key) in (None, [], "")]


def _model_config(model_dir: pathlib.Path, cfg: dict) -> ModelConfig:
    """`config_from_hf` on the parsed config.json (`cfg`), which holds every one of `REQUIRED_KEYS`."""
    cfg = _merged(cfg)
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or cfg.get('model_type')!r} in {model_dir / 'config.json'} "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    theta, scaling = _rope(cfg)
    if scaling is not None:
        raise UnsupportedModelError(f"rope scaling {scaling!r} is not supported yet")
    hidden = int(cfg["hidden_size"])
    num_heads = int(cfg["num_attention_heads"])
    gen = read_json(model_dir / "generation_config.json")
    eos = _id_list(gen.get("eos_token_id")) + _id_list(cfg.get("eos_token_id"))
    bos = gen.get("bos_token_id", cfg.get("bos_token_id"))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_style="neox",
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )
