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


def listen_error(config: EngineConfig, exc: OSError) -> str:
    """The one-line message for an address that cannot be listened on: `config.uds`, or host:port, and the OS's
    reason."""
    if config.uds:
        return f"cannot listen on unix:{config.uds}: {exc.strerror or exc} (--uds)"
    return f"cannot listen on {address(config.host, config.port)}: {exc.strerror or exc} (--host / --port)"


def listen(config: EngineConfig) -> tuple[socket.socket, int]:
    """The server's listening socket (`api_processes.open_listener`: on `config.uds`, else on host:port as
    hypercorn binds), opened before the model loads: a port in use, a host that is no local address or does not
    resolve, a socket path taken by a live server or by another file fails here at once instead of in hypercorn
    after the load, and no other process can take the address meanwhile (hypercorn then serves this socket,
    `fd://`; connections made during the load wait in its backlog, as with vLLM's early bind).

    Returns:
        the socket and, for `config.uds`, its file's inode (0 for TCP): the caller removes the file at exit.

    Raises:
        ConfigError: naming the address and the OS's reason.
    """
    from voltserve.api_processes import open_listener

    try:
        sock, inode = open_listener(config)
    except OSError as exc:
        raise ConfigError(listen_error(config, exc)) from exc
    sock.set_inheritable(False)  # this process's own: no child (the engine process) holds the port
    return sock, inode


def check_model(config: EngineConfig) -> None:
    """Read the model's (and the draft model's) hyper-parameters as the loader will, without loading it: a name
    that is no alias, file or directory, an empty, truncated or corrupt GGUF file or an unreadable config.json
    fails here. Where the KV pool's size is known before the load (`num_kv_blocks` set, or the CPU backend, whose
    pool is `kv_cache_memory_gb`), check that it holds one sequence of `max_model_len`, as the engine will.

    Raises:
        LoaderError: the model (or draft model) cannot be found or read, or is not supported.
        ConfigError: the KV pool holds no block, or not one sequence of max_model_len; the attention heads, KV
            heads or MLP inner features do not divide by tensor_parallel_size, or a rank's input slice of a
            row-parallel Q4_0 / Q4_1 / Q8_0 weight would split its blocks (`voltserve.distributed.sharding`).
            (`--device cuda` without a GPU is the engine's to refuse, `actors.build.resolve_device`, before the load:
            the driver's files are no sure sign, e.g. Jetson's nvgpu has none of NVIDIA_SIGNS.)
    """
    from loaders import peek_model_config

    model = peek_model_config(config.model)
    draft = peek_model_config(config.speculative_model) if config.speculative_model else None
    if model is None or (config.speculative_model and draft is None):  # an alias not fetched yet
        return
    if config.tensor_parallel_size > 1:  # else N - 1 spawned ranks and rank 0 each load the model to find out
        _check_tp_split(config, model)
    if config.num_kv_blocks:
        num_blocks = config.num_kv_blocks
    elif _runs_on_cpu(config.device):
        dtype_bytes, kv_heads = CPU_DTYPE_BYTES[config.dtype], model.num_kv_heads // config.tensor_parallel_size
        one = pool_block_bytes(model, config.block_size, dtype_bytes, kv_heads)  # a TP rank's share
        if draft is not None:  # its blocks share the pool's memory (`actors.build.rank_model`)
            one += pool_block_bytes(draft, config.block_size, dtype_bytes)
        num_blocks = blocks_in_memory(config.kv_cache_memory_gb, one)
    else:  # sized from the GPU's free memory once the weights are on it: the engine checks it
        return
    pool_max_model_len(config.max_model_len, model.max_position_embeddings, num_blocks, config.block_size)


def _check_tp_split(config: EngineConfig, model) -> None:
    """The model's slices for `config.tensor_parallel_size` ranks, from its header: whole attention and KV heads,
    MLP inner features that divide, and row-parallel block-quantized weights split on block boundaries (Q4_0 /
    Q4_1 / Q8_0, kept packed, and with `gguf_convert` the K-quant, Q5 and i-quant types converted into them; other types
    load as floats and split anywhere).

    Raises:
        ConfigError: the first split that does not work (`voltserve.distributed.sharding`).
    """
    from loaders import peek_packed_weights
    from voltserve.distributed.sharding import ROW_PARALLEL, check_block_split, local_heads, split_range

    local_heads(model, config.tensor_parallel_size)
    split_range(model.intermediate_size, 0, config.tensor_parallel_size, "intermediate_size")
    convert = config.gguf_convert == "auto"
    for name, (qtype, in_features) in peek_packed_weights(config.model, convert).items():
        if name.removesuffix(".weight").endswith(ROW_PARALLEL):
            try:
                check_block_split(name, qtype, in_features, config.tensor_parallel_size)
            except ConfigError as e:  # the header read again only here, to tell a converted tensor
                if not convert or name in peek_packed_weights(config.model, gguf_convert=False):
                    raise
                # a type `loaders.gguf_convert` converts: without the conversion it loads as floats, any split
                raise ConfigError(f"{e} ({name} is converted to {qtype} at the load; --gguf-convert off loads it "
                                  "as floats, which split anywhere)") from None


def _runs_on_cpu(device: str) -> bool:
    """Whether the engine will run on the CPU backend: asked for, or `auto` on a host with no NVIDIA GPU."""
    return device == "cpu" or (device == "auto" and not any(os.path.exists(p) for p in NVIDIA_SIGNS))
