"""Tensor parallelism: process groups (`group`) and Megatron-style weight slicing (`sharding`)."""

__all__ = ["SingleRank", "TPGroup", "TorchTPGroup", "check_tp_devices", "init_tp_group"]


def __getattr__(name: str):
    """The group names, imported on first use: `voltserve serve`'s torch-free start-up check (`preflight`) reads
    `sharding`'s head and feature splits through this package without importing torch."""
    if name in __all__:
        from voltserve.distributed import group

        return getattr(group, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
