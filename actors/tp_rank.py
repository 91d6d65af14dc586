"""The process of one tensor-parallel rank r >= 1 (spawned by `actors.tp.TPRanks`): join the group, build this
rank's shard of the model and its KV pool, then run the forward of every step rank 0 sends until told to stop.

The startup handshake over the pipe (each message a tuple, `("error", traceback)` instead when something fails):
    rank -> 0: ("hello",) just before the group's rendezvous
    rank -> 0: ("capacity", blocks its pool could hold)        0 -> rank: the pool size every rank uses
    rank -> 0: ("ready",) once its pool is allocated
Then 0 -> rank: pickled `StepInputs` per step, pickled None to stop (also accepted instead of the pool size). A
closed pipe (rank 0's process died) also stops the rank. Exit code 0 after a stop, 1 after an error (logged to stderr).
SIGINT is ignored once `rank_main` runs (rank 0's process handles Ctrl-C and stops the ranks). A rank whose rank-0
process is gone exits at once (`_exit_with_parent`), also while it loads its shard (no pipe is read then).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import signal
import threading
import traceback

import torch
import torch.distributed as dist

from voltserve.config import EngineConfig

logger = logging.getLogger(__name__)


def rank_main(rank: int, config: EngineConfig, device: str, init_method: str, spare_cores: int, conn,
              log_level: int = logging.INFO) -> None:
    """Entry point of a spawned rank process (rank >= 1 of config.tensor_parallel_size); `log_level`: rank 0's
    root logger level, so the ranks log what the engine logs (to stderr, each line tagged with its rank)."""
    # Ctrl-C reaches the whole foreground process group: rank 0's owner drains and stops us over the pipe, while a
    # KeyboardInterrupt here would kill the rank (and so the engine) in the middle of that drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(rank)
    logging.basicConfig(level=log_level, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        runner = _build(rank, config, device, init_method, spare_cores, conn)
    except BaseException:
        _report(conn, traceback.format_exc())
        raise SystemExit(1)
    try:
        if runner is not None:  # else stopped while starting (rank 0 failed to build)
            _serve_steps(runner, conn)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed in a step", rank)
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_with_parent(rank: int) -> None:
    """Exit this process (status 1) as soon as rank 0's process has exited, whatever this one is doing: its load
    would otherwise run to the end, and its rendezvous wait for minutes, for nobody."""
    parent = multiprocessing.parent_process()  # spawned: its sentinel is ready once the parent is gone
    if parent is None:
        return

    def wait() -> None:
        mpc.wait([parent.sentinel])
        os.write(2, f"tensor-parallel rank {rank}: rank 0's process is gone; exiting\n".encode())
        os._exit(1)

    threading.Thread(target=wait, name="tp-rank-parent-watch", daemon=True).start()


def _build(rank: int, config: EngineConfig, device: str, init_method: str, spare_cores: int, conn):
    from actors.build import allocate_kv, make_backend, rank_model
    from loaders import load_model
    from voltserve.distributed import init_tp_group
    from voltserve.runner import ModelRunner

    conn.send(("hello",))
    tp = init_tp_group(rank, config.tensor_parallel_size, init_method, device)
    loaded = load_model(config.model, gguf_convert=config.gguf_convert == "auto")
    backend = make_backend(config, device, spare_cores, rank)
    model, _, capacity = rank_model(config, loaded, backend, device, tp)
    del loaded  # the model holds its shard; the whole checkpoint's tensors go
    conn.send(("capacity", capacity))
    num_blocks = conn.recv()
    if num_blocks is None:
        return None
    runner = ModelRunner(model, backend, allocate_kv(model, num_blocks, config.block_size), ())
    conn.send(("ready",))
    logger.info("tensor-parallel rank %d of %d ready: %d KV heads, %d blocks", rank, tp.world_size,
                model.num_kv_heads, num_blocks)
    return runner


@torch.inference_mode()
def _serve_steps(runner, conn) -> None:
    """Run each step's forward; its logits are dropped (rank 0 samples from its identical copy)."""
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # rank 0's process is gone
            return
        step = pickle.loads(payload)
        if step is None:
            return
        runner.forward(step)


def _report(conn, text: str) -> None:
    try:
        conn.send(("error", text))
    except OSError:
        pass
