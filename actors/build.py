"""Composition: model spec -> loaded weights -> backend, model, KV tensor and ModelRunner."""

from __future__ import annotations

import logging
import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from voltserve import host_memory
from voltserve.config import EngineConfig, ModelConfig
from voltserve.distributed import check_tp_devices
from voltserve.distributed.group import TPGroup
from voltserve.distributed.sharding import local_heads
from voltserve.errors import ConfigError
from voltserve.kv_cache import blocks_in_memory, pool_block_bytes, pool_max_model_len
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
    tp_ranks: Any = None  # actors.tp.TPRanks (ranks 1..N-1) when tensor_parallel_size > 1, else None
    drafter: Any = None  # voltserve.spec.draft_model.DraftModelDrafter with speculative_method "draft_model"


def resolve_device(requested: str) -> str:
    """"auto" -> "cuda" when a GPU and the CUDA backend are usable, else "cpu"; "cpu" and "cuda" as they are.

    Raises:
        ConfigError: "cuda" where torch sees no GPU or the CUDA backend cannot load (was an AttributeError or
            ImportError traceback from the first CUDA call, after the model's load, and exit status 1); cuda-python
            missing (a ModuleNotFoundError of the `cuda` package; other import errors propagate).
    """
    if requested not in ("auto", "cuda"):
        return requested
    if not torch.cuda.is_available():
        if requested == "cuda":
            raise ConfigError(f"device cuda: torch {torch.__version__} sees no CUDA GPU (a CPU-only torch build, "
                              "no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides the GPUs); use device auto or cpu")
        return "cpu"
    missing = _cuda_backend_import_error()
    if missing is None:
        return "cuda"
    if requested == "cuda":
        if not isinstance(missing, ModuleNotFoundError) or not (missing.name or "").startswith("cuda"):
            raise missing  # a broken module of ours: not the operator's to fix
        raise ConfigError(f"device cuda: the CUDA backend cannot load ({missing}; pip install "
                          "'voltserve[cuda]')") from missing
    logger.warning("a GPU is present but the CUDA backend cannot load (%s; pip install 'voltserve[cuda]'); using "
                   "the CPU", missing)
    return "cpu"


def _cuda_backend_import_error() -> ImportError | None:
    """The ImportError of importing cuda-python (the `cuda` extra) and the CUDA backend, or None when both load."""
    try:
        import cuda.bindings.driver  # noqa: F401
        import voltserve.backends.cuda.backend  # noqa: F401
    except ImportError as exc:
        return exc
    return None


_TORCH_DEFAULT_THREADS = torch.get_num_threads()  # before any engine of this process set it


def make_backend(config: EngineConfig, device: str, spare_cores: int = 0, rank: int = 0):
    """The backend of TP rank `rank` on `device` (CUDA: GPU `rank`); on the CPU it also sets torch's intra-op
    threads (`cpu_threads`; with tensor_parallel_size N > 1 and num_threads 0 each rank takes 1 / N of them, as
    the N rank processes share the cores)."""
    if device == "cuda":
        from voltserve.backends.cuda.backend import CudaBackend

        return CudaBackend(rank, pdl=config.pdl)
    from voltserve.backends.cpu import CpuBackend

    tp_size = config.tensor_parallel_size
    if config.num_threads > 0 or spare_cores > 0 or tp_size > 1:  # else torch's setting stays (an embedder's)
        threads = cpu_threads(config.num_threads, _TORCH_DEFAULT_THREADS, spare_cores)
        torch.set_num_threads(threads if config.num_threads > 0 else max(1, threads // tp_size))
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


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Bytes of one KV block across all layers (K and V) on one TP rank, which holds 1 / tp_size of the KV heads.

    Raises:
        ConfigError: num_kv_heads does not divide by tp_size (`local_heads`).
    """
    _, kv_heads = local_heads(cfg, tp_size)
    return pool_block_bytes(cfg, block_size, dtype.itemsize, kv_heads)


# activations and CUDA graph pools beside the weights and the KV pool (bytes); generous for small models
_GPU_ACTIVATION_RESERVE = 2 * 2**30


def _default_num_blocks(config: EngineConfig, device: str, block_bytes: int) -> int:
    """KV blocks from `kv_cache_memory_gb` on the CPU; on a GPU from free memory and gpu_memory_utilization."""
    if device != "cuda":
        return blocks_in_memory(config.kv_cache_memory_gb, block_bytes)
    free, total = torch.cuda.mem_get_info()
    budget = total * config.gpu_memory_utilization - (total - free) - _GPU_ACTIVATION_RESERVE
    if budget < block_bytes:
        raise ConfigError(f"no GPU memory left for the KV pool ({free / 2**30:.1f} GiB free of "
                          f"{total / 2**30:.1f}); raise --gpu-memory-utilization or free the GPU")
    return int(budget // block_bytes)


def warn_past_model_len(max_model_len: int, model_len: int) -> None:
    """Log one warning when `max_model_len` is above the model's own context length: accepted (as llama.cpp does;
    vLLM refuses it), since the model may still serve it, but positions past those it was trained on can degrade
    its output."""
    if max_model_len > model_len:
        logger.warning("max_model_len %d is above the model's context length %d: serving it, but output past %d "
                       "tokens may degrade", max_model_len, model_len, model_len)


def speculation(config: EngineConfig, drafter=None) -> dict:
    """The Scheduler's speculative decoding arguments (`drafter`, `ladder`, `draft_max_pause`, `gate`) for
    `config.speculative_method`; {} for "none". drafter: the built engine's (`BuiltEngine.drafter`, the
    "draft_model" method's)."""
    if config.speculative_method == "none":
        return {}
    if config.speculative_method == "ngram":
        from voltserve.spec.ngram import NgramDrafter

        drafter = NgramDrafter(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
    elif drafter is None:
        raise ValueError(f"speculative_method {config.speculative_method!r} needs the built engine's drafter")
    return {"drafter": drafter, "ladder": config.draft_ladder(), "draft_max_pause": config.draft_max_pause,
            "gate": config.draft_gate()}


def rank_model(config: EngineConfig, loaded, backend, device: str, tp: TPGroup | None = None,
               extra_block_bytes: int = 0) -> tuple[LlamaModel, int, int]:
    """The model of one TP rank (the whole model when tp is None) and its KV pool's size.

    extra_block_bytes: memory that goes with each KV block besides this model's (a draft model's block), counted
    when the pool's size comes from memory.

    Returns:
        (model, bytes of one KV block of this rank, blocks its pool could hold: `num_kv_blocks`, else from memory).
    Raises:
        ConfigError: heads that do not divide by the TP size; no GPU memory left for the pool.
    """
    cfg = loaded.config
    max_positions = config.max_model_len or cfg.max_position_embeddings
    model = LlamaModel(cfg, loaded.tensors, backend, loaded.quantized, max_positions=max_positions, tp=tp,
                       fuse_mixed=config.gguf_convert == "auto")
    block_bytes = kv_block_bytes(cfg, config.block_size, backend.dtype, model.tp.world_size)
    return model, block_bytes, config.num_kv_blocks or _default_num_blocks(config, device,
                                                                             block_bytes + extra_block_bytes)


def allocate_kv(model: LlamaModel, num_blocks: int, block_size: int) -> torch.Tensor:
    """The rank's KV pool: [num_layers, 2, num_blocks, block_size, model.num_kv_heads (this rank's), head_dim].

    Raises:
        ConfigError: the memory for it cannot be had (e.g. a kv_cache_memory_gb above the host's memory: was
            torch's allocator error and a traceback, exit status 1); on the CPU, a pool larger than the memory the
            host has available (`host_memory.available_bytes`): Linux's overcommit granted it and the OOM killer
            ended the process while it was zeroed.
    """
    cfg = model.config
    size = num_blocks * pool_block_bytes(cfg, block_size, model.backend.dtype.itemsize, model.num_kv_heads)
    pool = f"the KV pool ({num_blocks} blocks of {block_size} tokens, {size / 2**30:.1f} GiB)"
    if getattr(model.backend, "device", None) == torch.device("cpu"):
        available = host_memory.available_bytes()  # else granted by overcommit, then OOM-killed while zeroed
        if available is not None and size > available:
            raise ConfigError(f"{pool} does not fit the {available / 2**30:.1f} GiB of memory this host has "
                              "available (MemAvailable, or its memory cgroup's room); lower kv_cache_memory_gb or "
                              "num_kv_blocks")
    try:
        return model.backend.allocate_kv_cache(cfg.num_layers, num_blocks, block_size, model.num_kv_heads,
                                               cfg.head_dim)
    except RuntimeError as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in str(exc):
            raise
        raise ConfigError(f"{pool} cannot be allocated: not enough memory; lower kv_cache_memory_gb (GPU: "
                          "gpu_memory_utilization) or num_kv_blocks") from None


def build_runner(config: EngineConfig, loaded=None, spare_cores: int = 0) -> BuiltEngine:
    """Load (unless given) and assemble everything a WorkerActor and the SchedulerActor need. `spare_cores`:
    CPU cores torch's threads leave free when `config.num_threads` is 0 (`cpu_threads`; the engine's own 1).

    With tensor_parallel_size N > 1 this process is TP rank 0 and N - 1 rank processes start first (`actors.tp`;
    they load `config.model` themselves, `loaded` serves rank 0 only); the returned `tp_ranks` owns them, and
    every step runs eagerly (no CUDA graphs, so no asynchronous scheduling either).

    Raises:
        LoaderError / UnsupportedModelError: from the loader.
        ConfigError: the KV pool cannot hold one full-length sequence; heads that do not divide by the TP size;
            fewer GPUs than ranks.
        RuntimeError: a TP rank process failed to start.
    """
    device = resolve_device(config.device)
    if config.tensor_parallel_size == 1:
        return _build(config, loaded, spare_cores, device, None)
    from actors.tp import TPRanks

    check_tp_devices(config.tensor_parallel_size, device)
    ranks = TPRanks.start(config, device, spare_cores)
    try:
        return _build(config, loaded, spare_cores, device, ranks)
    except BaseException:
        ranks.stop()
        raise


def _build(config: EngineConfig, loaded, spare_cores: int, device: str, ranks) -> BuiltEngine:
    from loaders import load_model
    from voltserve.chat_template import ChatTemplate

    if loaded is None:
        loaded = load_model(config.model, gguf_convert=config.gguf_convert == "auto")
    cfg = loaded.config
    warn_past_model_len(config.max_model_len, cfg.max_position_embeddings)
    backend = make_backend(config, device, spare_cores)
    max_model_len = config.max_model_len or cfg.max_position_embeddings
    draft_model, draft_block_bytes = None, 0
    if config.speculative_method == "draft_model":  # its weights on the device before the pool takes the rest
        from actors.draft_build import load_draft_model

        draft_model = load_draft_model(config, loaded.tokenizer, backend, max_model_len)
        draft_block_bytes = kv_block_bytes(draft_model.config, config.block_size, backend.dtype)
    model, block_bytes, num_blocks = rank_model(config, loaded, backend, device, ranks.tp if ranks else None,
                                                draft_block_bytes)
    if ranks is not None:  # one pool size for all: block ids mean the same slots on every rank
        num_blocks = ranks.agree_num_blocks(num_blocks)
    max_model_len = pool_max_model_len(config.max_model_len, cfg.max_position_embeddings, num_blocks,
                                       config.block_size)
    kv_cache = allocate_kv(model, num_blocks, config.block_size)
    logger.info("KV pool: %d blocks x %d tokens = %d tokens (%.1f MiB per rank, %s, %d TP ranks)", num_blocks,
                config.block_size, num_blocks * config.block_size, num_blocks * block_bytes / 2**20, device,
                config.tensor_parallel_size)
    graphs = None
    if ranks is not None:
        logger.info("tensor_parallel_size %d: every step runs eagerly (no CUDA graphs, no asynchronous "
                    "scheduling)", config.tensor_parallel_size)
    elif device == "cuda" and not config.enforce_eager:
        from voltserve.graphs import StepGraphs, prefill_buckets

        mixed = prefill_buckets(config.max_num_batched_tokens) if config.mixed_graphs else []
        verify = config.draft_ladder().width if config.speculative_method != "none" else None
        graphs = StepGraphs(model, backend, kv_cache, config.max_num_seqs, max_model_len, mixed, verify)
        graphs.capture()
    drafter = None
    if draft_model is not None:
        from actors.draft_build import make_drafter

        drafter = make_drafter(config, draft_model, num_blocks, max_model_len, cfg.vocab_size, device)
    tokenizer = loaded.tokenizer
    eos = tuple(cfg.eos_token_ids) or tuple(tokenizer.eos_token_ids)
    source = loaded.chat_template
    if config.chat_template:  # --chat-template FILE replaces the model's own
        source = pathlib.Path(config.chat_template).read_text(encoding="utf-8")
    template = ChatTemplate(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    if ranks is None:
        runner = ModelRunner(model, backend, kv_cache, eos, graphs=graphs)
    else:
        from actors.tp import TPModelRunner

        runner = TPModelRunner(model, backend, kv_cache, eos, ranks=ranks)
    if device == "cuda" and config.gpu_busy_log_interval > 0:
        from voltserve.gpu_busy import GpuBusyMeter

        runner.busy_meter = GpuBusyMeter(config.gpu_busy_log_interval)
    thread_init = None
    if device == "cuda":
        thread_init = lambda: torch.cuda.set_device(backend.device)  # noqa: E731 (a new thread has no context)
    return BuiltEngine(runner, cfg, tokenizer, template, eos, max_model_len, num_blocks, device, thread_init,
                       ranks, drafter)
