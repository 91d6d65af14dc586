"""The host memory a new allocation can still have, for refusing a CPU KV pool that cannot fit before it is filled.

Linux overcommits: a `torch.zeros` far above the free memory is granted, and the OOM killer ends the process while
the zeros are written (no error, no log line). So the CPU pool's size is checked against what the kernel reports
as available first (`actors.build.allocate_kv`).
"""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP_V2 = Path("/sys/fs/cgroup")  # the cgroup v2 hierarchy as a container sees its own group
CGROUP_V1 = Path("/sys/fs/cgroup/memory")


def available_bytes(meminfo: Path = MEMINFO, cgroup_v2: Path = CGROUP_V2, cgroup_v1: Path = CGROUP_V1) -> int | None:
    """Bytes this process can still allocate without reclaim failing: the smaller of /proc/meminfo's MemAvailable
    and its memory cgroup's limit less its usage (v2: memory.max - memory.current; v1: memory.limit_in_bytes -
    memory.usage_in_bytes), of those this host reports; None where none is readable (not Linux).

    An estimate (MemAvailable counts reclaimable caches), right for refusing a pool that cannot fit, not for sizing
    one to the last page."""
    known = [k for k in (_meminfo_available(meminfo),
                         _cgroup_room(cgroup_v2 / "memory.max", cgroup_v2 / "memory.current"),
                         _cgroup_room(cgroup_v1 / "memory.limit_in_bytes", cgroup_v1 / "memory.usage_in_bytes"))
             if k is not None]
    return min(known) if known else None


def _meminfo_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # "MemAvailable:   12345 kB"
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(limit_file: Path, usage_file: Path) -> int | None:
    """limit - usage of a memory cgroup; None without one, or with no limit ("max"; v1's unlimited is a number
    near 2**63, which the min in `available_bytes` then ignores by itself)."""
    try:
        limit = limit_file.read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(usage_file.read_text().strip()))
    except (OSError, ValueError):
        return None
