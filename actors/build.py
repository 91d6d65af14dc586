"""Composition: model spec -> loaded weights -> backend, model, KV tensor and ModelRunner."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from voltserve.config import EngineConfig, ModelConfig
from voltserve.errors import ConfigError
from voltserve.models.llama import LlamaModel
from voltserve.runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BuiltEngine:
    runner: ModelRunner
    model_config: ModelConfig
    tokenizer: Any
    chat_template: Any
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    num_blocks: int
    device: str
    thread_init: Callable[[], None] | None


def resolve_device(requested: str) -> str:
    """"auto" -> "cuda" when a GPU and the CUDA backend are usable, else "cpu"."""
    if requested != "auto":
        return requested
    if torch.cuda.is_available():
        try:
            import voltserve.backends.cuda.backend  # noqa: F401
            return "cuda"
        except ImportError:
            logger.warning("a GPU is present but the CUDA backend cannot load; using the CPU")
    return "cpu"


def make_backend(config: EngineConfig, device: str):
    if device == "cuda":
        from voltserve.backends.cuda.backend import CudaBackend

        return CudaBackend(0)
    from voltserve.backends.cpu import CpuBackend

    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    return CpuBackend(_DTYPES[config.dtype], use_int4=config.weight_format == "auto")


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


def build_runner(config: EngineConfig, loaded=None) -> BuiltEngine:
    """Load (unless given) and assemble everything a WorkerActor and the SchedulerActor need.

    Raises:
        LoaderError / UnsupportedModelError: from the loader.
        ConfigError: the KV pool cannot hold one full-length sequence.
    """
    from loaders import load_model
    from voltserve.chat_template import ChatTemplate

    if loaded is None:
        loaded = load_model(config.model)
    cfg = loaded.config
    device = resolve_device(config.device)
    backend = make_backend(config, device)
    max_model_len = config.max_model_len or cfg.max_position_embeddings
    block_bytes = kv_block_bytes(cfg, config.block_size, backend.dtype)
    num_blocks = config.num_kv_blocks or int(config.kv_cache_memory_gb * 2**30 // block_bytes)
    if num_blocks * config.block_size < max_model_len:
        if config.max_model_len:
            raise ConfigError(f"the KV pool ({num_blocks} blocks of {config.block_size} tokens) cannot hold one "
                              f"sequence of max_model_len {max_model_len}; give it more memory or blocks")
        max_model_len = num_blocks * config.block_size
    model = LlamaModel(cfg, loaded.tensors, backend, loaded.quantized, max_positions=max_model_len)
    kv_cache = backend.allocate_kv_cache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads,
                                         cfg.head_dim)
    logger.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB)", num_blocks, config.block_size,
                num_blocks * config.block_size, num_blocks * block_bytes / 2**20)
    tokenizer = loaded.tokenizer
    eos = tuple(cfg.eos_token_ids) or tuple(tokenizer.eos_token_ids)
    template = ChatTemplate(loaded.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    runner = ModelRunner(model, backend, kv_cache, eos)
    thread_init = getattr(backend, "thread_init", None)
    return BuiltEngine(runner, cfg, tokenizer, template, eos, max_model_len, num_blocks, device, thread_init)
