"""What `voltserve serve` checks before anything loads: the model file's header, whether the KV pool can hold one
sequence of `max_model_len`, and the address it will listen on. A bad one is then one line and exit status 2 at
once, not a traceback after minutes of loading the model.

Part of the CLI, a composition root: it reads model files through `loaders` (their torch-free parts only).
"""

from __future__ import annotations

import os
import socket

from voltserve.config import EngineConfig
from voltserve.errors import ConfigError
from voltserve.kv_cache import CPU_DTYPE_BYTES, blocks_in_memory, pool_block_bytes, pool_max_model_len

# where any of these exists, `--device auto` may pick a GPU (the kernel driver; WSL2's GPU device)
NVIDIA_SIGNS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg")


def address(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets (as hypercorn's `--bind` takes it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listen_error(host: str, port: int, exc: OSError) -> str:
    """The one-line message for an address that cannot be listened on: host:port and the OS's reason."""
    return f"cannot listen on {address(host, port)}: {exc.strerror or exc} (--host / --port)"


def check_address(host: str, port: int) -> None:
    """Bind a TCP socket to host:port as hypercorn will (SO_REUSEADDR; IPv6 when the host has a ':'), then close
    it: a port in use, or a host that is no local address or does not resolve, fails here, before the model loads,
    instead of in hypercorn once it has.

    Raises:
        ConfigError: naming host:port and the OS's reason.
    """
    bind_host = host.replace("[", "").replace("]", "")  # as hypercorn reads its bind
    try:
        with socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((bind_host, port))
    except OSError as exc:
        raise ConfigError(listen_error(host, port, exc)) from exc


def check_model(config: EngineConfig) -> None:
    """Read the model's (and the draft model's) hyper-parameters as the loader will, without loading it: a name
    that is no alias, file or directory, an empty, truncated or corrupt GGUF file or an unreadable config.json
    fails here. Where the KV pool's size is known before the load (`num_kv_blocks` set, or the CPU backend, whose
    pool is `kv_cache_memory_gb`), check that it holds one sequence of `max_model_len`, as the engine will.

    Raises:
        LoaderError: the model (or draft model) cannot be found or read, or is not supported.
        ConfigError: the KV pool holds no block, or not one sequence of max_model_len.
    """
    from loaders import peek_model_config

    model = peek_model_config(config.model)
    draft = peek_model_config(config.speculative_model) if config.speculative_model else None
    if model is None or (config.speculative_model and draft is None):  # an alias not fetched yet
        return
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif _runs_on_cpu(config.device) and model.num_kv_heads % config.tensor_parallel_size == 0:
        dtype_bytes, kv_heads = CPU_DTYPE_BYTES[config.dtype], model.num_kv_heads // config.tensor_parallel_size
        one = pool_block_bytes(model, config.block_size, dtype_bytes, kv_heads)  # a TP rank's share
        if draft is not None:  # its blocks share the pool's memory (`actors.build.rank_model`)
            one += pool_block_bytes(draft, config.block_size, dtype_bytes)
        num_blocks = blocks_in_memory(config.kv_cache_memory_gb, one)
    else:  # sized from the GPU's free memory once the weights are on it: the engine checks it
        return
    pool_max_model_len(config.max_model_len, model.max_position_embeddings, num_blocks, config.block_size)


def _runs_on_cpu(device: str) -> bool:
    """Whether the engine will run on the CPU backend: asked for, or `auto` on a host with no NVIDIA GPU."""
    return device == "cpu" or (device == "auto" and not any(os.path.exists(p) for p in NVIDIA_SIGNS))
