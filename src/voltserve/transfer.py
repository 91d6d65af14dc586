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


def indices_to_device(device: torch.device, *lists: list[int]) -> list[torch.Tensor]:
    """Each list of ints as an int64 tensor on `device` ([len(list)] each), all in one host-to-device copy
    (`to_device`; views of one buffer): a step's index tensors cost one copy, not one each (~20 us of host time
    a copy on a GPU host)."""
    flat = to_device(torch.tensor([v for values in lists for v in values], dtype=torch.int64), device)
    out, at = [], 0
    for values in lists:
        out.append(flat[at:at + len(values)])
        at += len(values)
    return out
