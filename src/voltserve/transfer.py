"""Host-to-device copies of small step tensors (indices, sampling parameters) that never wait for the device."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) on `device`. On a GPU it goes through pinned memory with a non-blocking copy: a copy
    from pageable memory would wait for the work in flight, and the caching host allocator keeps the pinned
    buffer until the copy is done. On the CPU: `t` itself."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
