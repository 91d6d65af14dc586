"""Composition: model spec -> loaded weights -> backend, model, KV tensor and ModelRunner."""

from __future__ import annotations

import logging
import pathlib
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
            import cuda.bindings.driver  # noqa: F401  (the `cuda` extra)
            import voltserve.backends.cuda.backend  # noqa: F401
            return "cuda"
        except ImportError as exc:
            logger.warning("a GPU is present but the CUDA backend cannot load (%s; pip install "
                           "'voltserve[cuda]'); using the CPU", exc)
    return "cpu"


_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # before any engine of this process set it


def make_backend(config: EngineConfig, device: str, spare_cores: int = 0):
    """The backend for `device`; on the CPU it also sets torch's intra-op threads (`cpu_threads`)."""
    if device == "cuda":
        from voltserve.backends.cuda.backend import CudaBackend

        return CudaBackend(0, pdl=config.pdl)
    from voltserve.backends.cpu import CpuBackend

    if config.num_threads > 0 or spare_cores > 0:  # else torch's setting stays (an embedding host's own)
        torch.set_num_threads(cpu_threads(config.num_threads, _TORCH_DEFAULT_THREADS, spare_cores))
    backend = CpuBackend(_DTYPES[config.dtype], use_int4=config.weight_format == "auto")
    weights = ("every weight dequantized (the reference)" if not backend.use_int4 else
               "Q4 weights on the int4 kernel, other quantized ones " + ("on bf16" if backend.use_bf16 else
                                                                         "dequantized"))
    logger.info("CPU backend: %d torch threads, %s", torch.get_num_threads(), weights)
    return backend


def cpu_threads(num_threads: int, default: int, spare_cores: int) -> int:
    """torch intra-op threads: `num_threads` when set (> 0), else torch's `default` (one per core) less
    `spare_cores`, at least 1. A server keeps a core for its event loop and API process: every op's parallel
    region waits for its slowest thread, and one that shares its core with them stalls the step (2-core machine,
    default model through HTTP: one stream's time per token 23 ms with 2 threads, 17 ms with 1; 1.5x the tokens/s
    at 8 streams)."""
    return num_threads if num_threads > 0 else max(1, default - spare_cores)


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    return cfg.num_layers * 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


# activations and CUDA graph pools beside the weights and the KV pool (bytes); generous for small models
_GPU_ACTIVATION_RESERVE = 2 * 2**30


def _default_num_blocks(config: EngineConfig, device: str, block_bytes: int) -> int:
    """KV blocks from `kv_cache_memory_gb` on the CPU; on a GPU from free memory and gpu_memory_utilization."""
    if device != "cuda":
        return int(config.kv_cache_memory_gb * 2**30 // block_bytes)
    free, total = torch.cuda.mem_get_info()
    budget = total * config.gpu_memory_utilization - (total - free) - _GPU_ACTIVATION_RESERVE
    if budget < block_bytes:
        raise ConfigError(f"no GPU memory left for the KV pool ({free / 2**30:.1f} GiB free of "
                          f"{total / 2**30:.1f}); raise --gpu-memory-utilization or free the GPU")
    return int(budget // block_bytes)


def speculation(config: EngineConfig) -> dict:
    """The Scheduler's speculative decoding arguments (`drafter`, `ladder`) for `config.speculative_method`; {}
    for "none"."""
    if config.speculative_method == "none":
        return {}
    from voltserve.spec.ngram import NgramDrafter

    return {"drafter": NgramDrafter(config.num_speculative_tokens, config.ngram_min, config.ngram_max),
            "ladder": config.draft_ladder()}


def build_runner(config: EngineConfig, loaded=None, spare_cores: int = 0) -> BuiltEngine:
    """Load (unless given) and assemble everything a WorkerActor and the SchedulerActor need. `spare_cores`:
    CPU cores torch's threads leave free when `config.num_threads` is 0 (`cpu_threads`; the engine's own 1).

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
    backend = make_backend(config, device, spare_cores)
    max_model_len = config.max_model_len or cfg.max_position_embeddings
    model = LlamaModel(cfg, loaded.tensors, backend, loaded.quantized, max_positions=max_model_len)
    block_bytes = kv_block_bytes(cfg, config.block_size, backend.dtype)
    num_blocks = config.num_kv_blocks or _default_num_blocks(config, device, block_bytes)
    if num_blocks * config.block_size < max_model_len:
        if config.max_model_len:
            raise ConfigError(f"the KV pool ({num_blocks} blocks of {config.block_size} tokens) cannot hold one "
                              f"sequence of max_model_len {max_model_len}; give it more memory or blocks")
        max_model_len = num_blocks * config.block_size
    kv_cache = backend.allocate_kv_cache(cfg.num_layers, num_blocks, config.block_size, cfg.num_kv_heads,
                                         cfg.head_dim)
    logger.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)", num_blocks, config.block_size,
                num_blocks * config.block_size, num_blocks * block_bytes / 2**20, device)
    graphs = None
    if device == "cuda" and not config.enforce_eager:
        from voltserve.graphs import StepGraphs, prefill_buckets

        mixed = prefill_buckets(config.max_num_batched_tokens) if config.mixed_graphs else []
        verify = config.draft_ladder().width if config.speculative_method != "none" else None
        graphs = StepGraphs(model, backend, kv_cache, config.max_num_seqs, max_model_len, mixed, verify)
        graphs.capture()
    tokenizer = loaded.tokenizer
    eos = tuple(cfg.eos_token_ids) or tuple(tokenizer.eos_token_ids)
    source = loaded.chat_template
    if config.chat_template:  # --chat-template FILE replaces the model's own
        source = pathlib.Path(config.chat_template).read_text(encoding="utf-8")
    template = ChatTemplate(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    runner = ModelRunner(model, backend, kv_cache, eos, graphs=graphs)
    if device == "cuda" and config.gpu_busy_log_interval > 0:
        from voltserve.gpu_busy import GpuBusyMeter

        runner.busy_meter = GpuBusyMeter(config.gpu_busy_log_interval)
    thread_init = None
    if device == "cuda":
        thread_init = lambda: torch.cuda.set_device(backend.device)  # noqa: E731 (a new thread has no context)
    return BuiltEngine(runner, cfg, tokenizer, template, eos, max_model_len, num_blocks, device, thread_init)
