"""The CPU KV pool against the host's available memory (`voltserve.host_memory`, `actors.build.allocate_kv`): a
pool above it was granted by Linux's overcommit and the process OOM-killed while the zeros were written."""

from types import SimpleNamespace

import pytest
import torch

from actors.build import allocate_kv
from voltserve import host_memory
from voltserve.errors import ConfigError

MEMINFO = "MemTotal:       24000000 kB\nMemFree:         1000000 kB\nMemAvailable:   10000000 kB\n"


def _files(tmp_path, meminfo=MEMINFO, v2=None, v1=None):
    (tmp_path / "meminfo").write_text(meminfo)
    for name, pair in (("v2", v2), ("v1", v1)):
        d = tmp_path / name
        d.mkdir()
        if pair is not None:
            limit, usage = pair
            (d / ("memory.max" if name == "v2" else "memory.limit_in_bytes")).write_text(f"{limit}\n")
            (d / ("memory.current" if name == "v2" else "memory.usage_in_bytes")).write_text(f"{usage}\n")
    return tmp_path / "meminfo", tmp_path / "v2", tmp_path / "v1"


@pytest.mark.parametrize("v2, v1, expected", [
    (None, None, 10_000_000 * 1024),                           # MemAvailable alone
    (("max", 5 << 30), None, 10_000_000 * 1024),               # a cgroup without a limit
    ((8 << 30, 3 << 30), None, 5 << 30),                       # the cgroup's room is smaller
    ((64 << 30, 1 << 30), None, 10_000_000 * 1024),            # MemAvailable is smaller
    (None, (9223372036854771712, 1 << 30), 10_000_000 * 1024),  # v1's "unlimited"
    (None, (4 << 30, 1 << 30), 3 << 30),
    ((1 << 30, 2 << 30), None, 0),                              # over its limit already
])
def test_available_bytes_is_the_smallest_room_reported(tmp_path, v2, v1, expected):
    assert host_memory.available_bytes(*_files(tmp_path, v2=v2, v1=v1)) == expected


def test_available_bytes_is_none_where_nothing_is_readable(tmp_path):
    assert host_memory.available_bytes(tmp_path / "no-meminfo", tmp_path / "no-v2", tmp_path / "no-v1") is None
    meminfo, v2, v1 = _files(tmp_path, meminfo="MemTotal: 1 kB\n")  # no MemAvailable line (kernels < 3.14)
    assert host_memory.available_bytes(meminfo, v2, v1) is None


def _cpu_model(allocate):
    cfg = SimpleNamespace(num_layers=30, head_dim=64)
    backend = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"), allocate_kv_cache=allocate)
    return SimpleNamespace(config=cfg, num_kv_heads=3, backend=backend)


def test_a_cpu_pool_above_the_available_memory_is_refused_before_it_is_allocated(monkeypatch):
    """30 layers x 2 x 2,000 blocks x 16 tokens x 3 KV heads x 64 x 4 bytes = 1.4 GiB against 1 GiB available:
    a ConfigError naming both, and the allocator never called."""
    def never(*shape):
        raise AssertionError("allocated")

    monkeypatch.setattr(host_memory, "available_bytes", lambda: 1 << 30)
    with pytest.raises(ConfigError, match=r"^the KV pool \(2000 blocks of 16 tokens, 1\.4 GiB\) does not fit the "
                                          r"1\.0 GiB of memory this host has available \(MemAvailable, or its "
                                          r"memory cgroup's room\); lower kv_cache_memory_gb or num_kv_blocks$"):
        allocate_kv(_cpu_model(never), 2000, 16)


@pytest.mark.parametrize("available", [2 << 30, None])
def test_a_cpu_pool_that_fits_or_an_unknown_room_is_allocated(monkeypatch, available):
    calls = []
    monkeypatch.setattr(host_memory, "available_bytes", lambda: available)
    got = allocate_kv(_cpu_model(lambda *shape: calls.append(shape) or "pool"), 1000, 16)
    assert got == "pool" and calls == [(30, 1000, 16, 3, 64)]
