"""Run a function on N tensor-parallel ranks: spawned CPU processes joined in one gloo group."""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from voltserve.distributed import init_tp_group


def run_ranks(world_size: int, fn, args: tuple, tmp_path: pathlib.Path) -> list:
    """fn(tp, *args) on `world_size` spawned processes (rendezvous through a file in tmp_path, so no port can
    clash); returns each rank's result (torch.save-able), rank order. A rank's exception fails the call."""
    mp.spawn(_rank_main, args=(world_size, str(tmp_path), fn, args), nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


def _rank_main(rank: int, world_size: int, folder: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    tp = init_tp_group(rank, world_size, f"file://{folder}/store")
    try:
        torch.save(fn(tp, *args), f"{folder}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
