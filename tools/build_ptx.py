"""AOT compile check: every kernel in every specialisation the engine uses, for compute_70 and compute_90
(PTX) plus sm_70 / sm_90 CUBINs, with the installed NVRTC. Needs no GPU and no torch; CI runs it with CUDA 12.x
NVRTC (CUDA 13 dropped Volta).

Usage (no arguments):
    PYTHONPATH=src:. python tools/build_ptx.py
Prints one line per (source, specialisation, arch), in order; exits 1 on any failure. Uses a throw-away cache
directory, so every kernel really compiles. An NVRTC compile runs on one thread: the builds run one per CPU core
(worker processes; ~470 builds took ~225 s one at a time on a 2-core CI machine).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

ARCHS = (70, 90)


def main(argv: list[str] | None = None) -> int:
    # no options: a parser only so that --help prints the usage instead of starting ~470 compiles
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="voltserve-build-ptx-") as cache:  # removed at exit
        os.environ["VOLTSERVE_CACHE_DIR"] = cache  # the workers inherit it
        return build_all()


def build_all(workers: int | None = None) -> int:
    """Compile every specialisation for each of ARCHS, `workers` builds at a time (default: one per CPU core this
    process may run on; 1: in this process); returns the process's exit status."""
    from voltserve.backends.cuda import kernels, nvrtc

    major, minor = nvrtc.nvrtc_version()
    includes = nvrtc.include_dirs()
    print(f"NVRTC {major}.{minor}; CUDA include dirs: {', '.join(includes) or '(none)'}", flush=True)
    failures = 0
    if major != 12:
        print(f"FAIL: compute_70 needs CUDA 12.x NVRTC, found {major}.{minor}")
        failures += 1
    builds = [(arch, op, spec) for arch in ARCHS for op, spec in kernels.engine_specializations()]
    # the cores this process may run on (cpusets); os.cpu_count() where the OS has no affinity call (macOS, Windows)
    workers = workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()) or 1
    # spawned, not forked: no NVRTC state of this process is carried into a worker
    spawned = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) if workers > 1 else None
    with spawned or contextlib.nullcontext():
        for ok, line in (spawned.map if spawned else map)(build_one, builds):  # in the order of `builds`
            failures += not ok
            print(line, flush=True)
    print(f"{len(builds)} builds, {failures} failed")
    return 1 if failures else 0


def build_one(build: tuple[int, str, dict]) -> tuple[bool, str]:
    """Compile one (arch, op, specialisation): (passed, the line to print)."""
    from voltserve.backends.cuda import kernels, nvrtc
    from voltserve.errors import VoltError

    arch, op, spec = build
    src = kernels.SOURCES[op]
    label = f"{src.file} {' '.join(f'{k}={v}' for k, v in spec.items()) or '-'} compute_{arch}/sm_{arch}"
    start = time.perf_counter()
    try:
        out = nvrtc.compile_source(src.file, arch, kernels.defines(op, **spec), use_cache=False)
        missing = [k for k in src.kernels if f".entry {k}(".encode() not in out.ptx]
        if out.cubin is None or missing:
            raise RuntimeError(f"no cubin or missing entries {missing}")
    except (VoltError, RuntimeError) as exc:
        return False, f"FAIL {label}: {exc}"
    ms = (time.perf_counter() - start) * 1e3
    return True, f"ok   {label}  ptx {len(out.ptx)} B  cubin {len(out.cubin)} B  {ms:.0f} ms"


if __name__ == "__main__":
    sys.exit(main())
