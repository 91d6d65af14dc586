"""Tensor parallelism: process groups (`group`) and Megatron-style weight slicing (`sharding`)."""

from voltserve.distributed.group import SingleRank, TorchTPGroup, TPGroup, check_tp_devices, init_tp_group

__all__ = ["SingleRank", "TPGroup", "TorchTPGroup", "check_tp_devices", "init_tp_group"]
