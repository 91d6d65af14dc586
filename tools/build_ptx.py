"""AOT compile check: every kernel in every specialisation the engine uses, for compute_70 and compute_90
(PTX) plus sm_70 / sm_90 CUBINs, with the installed NVRTC. Needs no GPU and no torch; CI runs it with CUDA 12.x
NVRTC (CUDA 13 dropped Volta).

Usage (no arguments):
    PYTHONPATH=src:. python tools/build_ptx.py
Prints one line per (source, specialisation, arch); exits 1 on any failure. Uses a throw-away cache directory,
so every kernel really compiles.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

ARCHS = (70, 90)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="voltserve-build-ptx-") as cache:  # removed at exit
        os.environ["VOLTSERVE_CACHE_DIR"] = cache
        return build_all()


def build_all() -> int:
    """Compile every specialisation for each of ARCHS; returns the process's exit status."""
    from voltserve.backends.cuda import kernels, nvrtc
    from voltserve.errors import VoltError

    major, minor = nvrtc.nvrtc_version()
    includes = nvrtc.include_dirs()
    print(f"NVRTC {major}.{minor}; CUDA include dirs: {', '.join(includes) or '(none)'}")
    failures = 0
    if major != 12:
        print(f"FAIL: compute_70 needs CUDA 12.x NVRTC, found {major}.{minor}")
        failures += 1
    specs = kernels.engine_specializations()
    for arch in ARCHS:
        for op, spec in specs:
            src = kernels.SOURCES[op]
            label = f"{src.file} {' '.join(f'{k}={v}' for k, v in spec.items()) or '-'} compute_{arch}/sm_{arch}"
            start = time.perf_counter()
            try:
                out = nvrtc.compile_source(src.file, arch, kernels.defines(op, **spec), use_cache=False)
                missing = [k for k in src.kernels if f".entry {k}(".encode() not in out.ptx]
                if out.cubin is None or missing:
                    raise RuntimeError(f"no cubin or missing entries {missing}")
            except (VoltError, RuntimeError) as exc:
                failures += 1
                print(f"FAIL {label}: {exc}")
                continue
            ms = (time.perf_counter() - start) * 1e3
            print(f"ok   {label}  ptx {len(out.ptx)} B  cubin {len(out.cubin)} B  {ms:.0f} ms")
    print(f"{len(specs) * len(ARCHS)} builds, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
