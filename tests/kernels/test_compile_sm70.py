"""Kernels compile for compute_70 / sm_70 with CUDA 12.x NVRTC, on the CPU (no GPU needed); plus the NVRTC
wrapper's cache and error behaviour. Skipped unless cuda-python 12.x and the NVRTC 12 library import.
"""

from __future__ import annotations

import pytest


def _nvrtc_major() -> int | None:
    try:
        from voltserve.backends.cuda import nvrtc

        return nvrtc.nvrtc_version()[0]
    except Exception:
        return None


pytestmark = pytest.mark.skipif(_nvrtc_major() != 12, reason="needs cuda-python 12.x with the NVRTC 12 library")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("VOLTSERVE_CACHE_DIR", str(tmp_path))


def _specs():
    from voltserve.backends.cuda import kernels

    return kernels.engine_specializations()


@pytest.mark.parametrize("op,spec", _specs() if _nvrtc_major() == 12 else [])
def test_compiles_for_sm70(op, spec):
    from voltserve.backends.cuda import kernels, nvrtc

    out = nvrtc.compile_source(kernels.SOURCES[op].file, 70, kernels.defines(op, **spec))
    assert out.cubin and out.ptx.endswith(b"\0")
    assert b".target sm_70" in out.ptx
    for name in kernels.SOURCES[op].kernels:
        assert f".entry {name}(".encode() in out.ptx


def test_headers_match_nvrtc_major():
    from voltserve.backends.cuda import nvrtc

    dirs = nvrtc.include_dirs()
    assert dirs, "no CUDA 12 include dir found: install nvidia-cuda-runtime-cu12"
    assert nvrtc._cudart_major(nvrtc.Path(dirs[0])) == 12


def test_cache_hit_and_key(tmp_path):
    from voltserve.backends.cuda import kernels, nvrtc

    first = nvrtc.compile_source("silu_mul.cu", 70, kernels.defines("silu_mul"))
    files = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert any(f.endswith(".cubin") for f in files) and any(f.endswith(".ptx") for f in files)
    again = nvrtc.compile_source("silu_mul.cu", 70, kernels.defines("silu_mul"))
    assert again.ptx == first.ptx
    nvrtc.compile_source("silu_mul.cu", 70, {**kernels.defines("silu_mul"), "EXTRA": 1})
    assert len(list((tmp_path / "kernels").glob("*.ptx"))) == 2  # a new define is a new key


def test_compile_error_carries_log(tmp_path, monkeypatch):
    from voltserve.backends.cuda import nvrtc
    from voltserve.errors import KernelCompileError

    (tmp_path / "bad.cu").write_text('extern "C" __global__ void k() { undefined_thing(); }\n')
    monkeypatch.setattr(nvrtc, "ptx_dir", lambda: tmp_path)
    with pytest.raises(KernelCompileError) as info:
        nvrtc.compile_source("bad.cu", 70)
    assert info.value.kernel == "bad.cu" and "undefined_thing" in info.value.log


def test_params_size_drift_fails_to_compile():
    from voltserve.backends.cuda import kernels, nvrtc
    from voltserve.errors import KernelCompileError

    wrong = {**kernels.defines("rmsnorm"), "VOLT_RMSNORM_PARAMS_BYTES": 8}
    with pytest.raises(KernelCompileError, match="drifted"):
        nvrtc.compile_source("rmsnorm.cu", 70, wrong)


def test_nvrtc_outputs_never_write_into_shared_bytes():
    """A compile whose log is empty (NVRTC's log is then one NUL) leaves the interpreter's cached one-byte b" "
    alone: NVRTC wrote its outputs into `b" " * size`, which for size 1 is that cached object, so every b" " of
    the process (then the spaces of text decoded from it) became b"\\x00" (seen on an H100 with a cold kernel
    cache: the server's answers had NULs for spaces)."""
    from voltserve.backends.cuda import nvrtc

    source = b'extern "C" __global__ void nothing() {}'
    ptx, log = nvrtc._run_nvrtc("nothing.cu", source, (), "--gpu-architecture=compute_80", cubin=False)
    assert log == "" and b".visible .entry nothing" in ptx
    space = bytes([32])  # not the literal: a corrupted constant would compare equal to itself
    assert b" " == space and b" ".decode() == " " and b" " * 1 is b" "


def test_build_ptx_workers_print_what_one_process_prints(monkeypatch, capsys):
    """tools/build_ptx.py (CI's build check) spreads its builds over worker processes: the same lines in the same
    order as one process prints them, and the same exit status."""
    import re

    from tools import build_ptx
    from voltserve.backends.cuda import kernels

    specs = [("rmsnorm", {}), ("silu_mul", {}), ("embedding", {})]
    monkeypatch.setattr(kernels, "engine_specializations", lambda: specs)  # the list is made in this process
    printed = []
    for workers in (1, 2):
        assert build_ptx.build_all(workers) == 0
        printed.append([re.sub(r"  \d+ ms$", "", line) for line in capsys.readouterr().out.splitlines()])
    assert printed[0] == printed[1] and printed[1][-1] == "6 builds, 0 failed"
    assert [line.split()[1] for line in printed[1][1:-1]] == ["rmsnorm.cu", "silu_mul.cu", "embedding.cu"] * 2
