"""Tensor-parallel (TP) process groups: the collectives the model forward needs, for one rank or N.

The model is written once against `TPGroup`; `SingleRank` makes every collective a no-op (TP = 1, no
torch.distributed at all), `TorchTPGroup` runs them over torch.distributed: NCCL between GPUs, gloo on the CPU
(how TP code is tested without a multi-GPU machine).
"""

from __future__ import annotations

import datetime
from typing import Protocol

import torch
import torch.distributed as dist

from voltserve.errors import ConfigError


class TPGroup(Protocol):
    """The ranks that share one model's weights (Megatron-LM's tensor-model-parallel group).

    Attributes:
        rank: this process's index in the group, 0..world_size - 1 (`tp_rank`).
        world_size: number of ranks (`tp_size`).
    """

    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; every rank gets the same (bitwise) sum. Returns `tensor`.

        Args:
            tensor: any shape and dtype, contiguous, on the group's device; the same shape on every rank.
        """

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `tensor` along `dim`, rank order: a new tensor [..., world_size * n, ...].

        Args:
            tensor: the same shape on every rank, on the group's device.
        """


class SingleRank:
    """TP = 1: collectives return their input unchanged (no process group, no copies)."""

    rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor


class TorchTPGroup:
    """A TP group over an initialized torch.distributed process group (`init_tp_group`).

    Args:
        group: the process group; None = the default (WORLD) group.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


def init_tp_group(rank: int, world_size: int, init_method: str, device: str = "cpu",
                  timeout_s: float = 120.0) -> TPGroup:
    """Join the TP group of `world_size` ranks as `rank` (call once per process, every rank).

    Args:
        rank: 0..world_size - 1.
        world_size: >= 1; 1 returns `SingleRank` without touching torch.distributed.
        init_method: torch.distributed rendezvous, e.g. "tcp://127.0.0.1:29500" or "file:///tmp/tp-store".
        device: "cpu" (backend gloo) or "cuda" (backend nccl; the rank uses GPU `rank`).
        timeout_s: how long a collective (and the rendezvous) waits for the other ranks.
    Raises:
        ConfigError: rank out of range, an unknown device, or too few GPUs (`check_tp_devices`).
    """
    if not 0 <= rank < world_size:
        raise ConfigError(f"tp rank {rank} is outside 0..{world_size - 1}")
    check_tp_devices(world_size, device)
    if world_size == 1:
        return SingleRank()
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return TorchTPGroup()


def check_tp_devices(tp_size: int, device: str) -> None:
    """Raise ConfigError unless `tp_size` ranks can run on `device` ("cpu": any number; "cuda": one GPU each)."""
    if tp_size < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, not {tp_size}")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"tensor parallel device must be cpu or cuda, not {device!r}")
    if device == "cuda":
        found = torch.cuda.device_count()
        if found < tp_size:
            raise ConfigError(f"tensor_parallel_size {tp_size} needs {tp_size} GPUs, {found} visible")
