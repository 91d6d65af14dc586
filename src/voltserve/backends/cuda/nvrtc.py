"""NVRTC: compile `ptx/*.cu` to PTX and to a CUBIN for one arch, with a disk cache.

Cache key: sha256 of the source and every header it includes from `ptx/`, the arch, the options (defines
included) and the NVRTC version, so editing a `.cuh`, changing a specialisation or upgrading NVRTC recompiles.
Cache dir: `$VOLTSERVE_CACHE_DIR/kernels`, default `~/.cache/voltserve/kernels`.

Kernels include only `ptx/` headers (they are header-free by design, see ptx/README.md), but the CUDA include
directory matching the NVRTC major version is still located and passed (`cuda_fp16.h` / `mma.h` for future
tensor-core kernels). It must match NVRTC: with NVRTC 12 the headers come from the cu12 wheels
(`nvidia-cuda-runtime-cu12`, `nvidia-cuda-nvcc-cu12`), never from a system CUDA 13 toolkit (DESIGN section 9).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from voltserve.backends.cuda.driver import bindings, check
from voltserve.errors import KernelCompileError

logger = logging.getLogger(__name__)

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@dataclass(frozen=True)
class CompiledSource:
    """One source file compiled for one arch with one set of options.

    Attributes:
        source: file name inside `ptx/`, e.g. "rmsnorm.cu".
        arch: compute capability as an int (70, 90).
        ptx: PTX text, NUL-terminated (loadable by cuModuleLoadData), for `compute_<arch>`.
        cubin: SASS for `sm_<arch>`, or None when NVRTC cannot target that exact arch.
        log: NVRTC's log of the PTX compile (warnings, deprecation notes); empty when clean.
        options: the NVRTC options used (without the arch flag).
    """

    source: str
    arch: int
    ptx: bytes
    cubin: bytes | None
    log: str
    options: tuple[str, ...]


def ptx_dir() -> Path:
    """Directory holding the kernel sources (the installed `ptx` package)."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[4] / "ptx", here.parents[3] / "ptx"):  # source checkout, then site-packages
        if (candidate / "common.cuh").is_file():
            return candidate
    import ptx  # the package installed with the wheel

    return Path(ptx.__file__).resolve().parent


def cache_dir() -> Path:
    base = os.environ.get("VOLTSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "voltserve")
    return Path(base) / "kernels"


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC library."""
    _, nvrtc = bindings()
    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


@functools.cache
def supported_archs() -> tuple[int, ...]:
    """Real archs (sm_XY as XY) this NVRTC can compile for."""
    _, nvrtc = bindings()
    try:
        return tuple(int(a) for a in check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))
    except Exception:  # very old bindings: assume the common range
        return (70, 75, 80, 86, 89, 90)


def _cudart_major(include: Path) -> int | None:
    header = include / "cuda_runtime_api.h"
    if not header.is_file():
        return None
    match = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
    return int(match.group(1)) // 1000 if match else None


def _candidate_include_dirs(major: int) -> list[Path]:
    cands: list[Path] = []
    env = os.environ.get("VOLTSERVE_CUDA_INCLUDE")
    if env:
        cands += [Path(p) for p in env.split(os.pathsep) if p]
    # pip wheels first: they are what pairs with the NVRTC wheel (cu12: nvidia/cuda_runtime; cu13: nvidia/cu13)
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia"
        cands += [root / "cuda_runtime" / "include", root / f"cu{major}" / "include"]
    try:
        from cuda import pathfinder

        located = pathfinder.locate_nvidia_header_directory("cudart")
        if located is not None:
            cands.append(Path(located.abs_path))
    except Exception:  # pathfinder is optional (older cuda-python)
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands.append(Path(os.environ[var]) / "include")
    cands.append(Path("/usr/local/cuda/include"))
    return cands


@functools.cache
def include_dirs() -> tuple[str, ...]:
    """CUDA include dirs whose version matches NVRTC's major: the runtime headers, then the nvcc `crt/` ones.

    Empty (with a warning) when none matches; the shipped kernels do not need them.
    """
    major = nvrtc_version()[0]
    for inc in _candidate_include_dirs(major):
        if _cudart_major(inc) != major:
            continue
        dirs = [inc]
        if not (inc / "crt" / "mma.h").is_file():  # cu12 wheels keep crt/ in nvidia-cuda-nvcc-cu12
            nvcc_inc = inc.parent.parent / "cuda_nvcc" / "include"
            if (nvcc_inc / "crt" / "mma.h").is_file():
                dirs.append(nvcc_inc)
        return tuple(str(d) for d in dirs)
    logger.warning("no CUDA %d include directory found (install nvidia-cuda-runtime-cu%d)", major, major)
    return ()


def _source_digest(path: Path, seen: set[Path] | None = None) -> bytes:
    """sha256 over the file and, recursively, every `#include "..."` it pulls from its directory."""
    seen = set() if seen is None else seen
    seen.add(path)
    text = path.read_bytes()
    h = hashlib.sha256(path.name.encode() + b"\0" + text)
    for inc in _INCLUDE_RE.findall(text.decode(errors="replace")):
        dep = path.parent / inc
        if dep.is_file() and dep not in seen:
            h.update(_source_digest(dep, seen))
    return h.digest()


def _options(defines: dict[str, int | float | str]) -> tuple[str, ...]:
    opts = ["--std=c++17", f"--include-path={ptx_dir()}"]
    opts += [f"--include-path={d}" for d in include_dirs()]
    opts += [f"-D{k}={v}" for k, v in sorted(defines.items())]
    return tuple(opts)


def _run_nvrtc(source: str, text: bytes, options: tuple[str, ...], arch_flag: str, cubin: bool) -> tuple[bytes, str]:
    _, nvrtc = bindings()
    prog = check(nvrtc.nvrtcCreateProgram(text, source.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [arch_flag.encode()] + [o.encode() for o in options]
        status = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
        log_buf = _read_out(nvrtc.nvrtcGetProgramLogSize, nvrtc.nvrtcGetProgramLog, prog, "nvrtcGetProgramLog")
        log = log_buf.rstrip(b"\0 ").decode(errors="replace").strip()
        if int(status) != 0:
            raise KernelCompileError(source, [arch_flag, *options], log)
        if cubin:
            buf = _read_out(nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN, prog, "nvrtcGetCUBIN")
        else:
            buf = _read_out(nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX, prog, "nvrtcGetPTX")  # with its trailing NUL
        return buf, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _read_out(get_size, get, prog, what: str) -> bytes:
    """An NVRTC output (log, PTX, CUBIN) through its size getter and getter, into a fresh mutable buffer: NVRTC
    writes into the buffer it is given, and an immutable `bytes` of the right size may be shared (`b" " * 1` is
    the interpreter's cached b" ": an empty log's one NUL written into it turned every b" " of the process into
    b"\x00", and with it the spaces of text decoded later)."""
    size = check(get_size(prog), what + "Size")
    buf = bytearray(size)
    check(get(prog, buf), what)
    return bytes(buf)


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def compile_source(source: str, arch: int, defines: dict[str, int | float | str] | None = None,
                   want_cubin: bool = True, use_cache: bool = True) -> CompiledSource:
    """Compile `ptx/<source>` for `compute_<arch>` (PTX) and `sm_<arch>` (CUBIN), through the disk cache.

    Args:
        source: file name in `ptx/`, e.g. "attention_decode.cu".
        arch: compute capability as an int, e.g. 70 or 90.
        defines: `-D` specialisations (HEAD_DIM, WTYPE, params struct sizes, ...).
        want_cubin: also build the CUBIN (skipped when NVRTC does not list `sm_<arch>`).
        use_cache: read and write the disk cache.
    Returns:
        CompiledSource with the PTX, the CUBIN (or None) and the compile log.
    Raises:
        KernelCompileError: NVRTC rejected the source; carries the file name, options and full log.
        CudaError: any other NVRTC failure.
    """
    path = ptx_dir() / source
    options = _options(defines or {})
    version = nvrtc_version()
    cubin_ok = want_cubin and arch in supported_archs()
    key = hashlib.sha256(b"|".join([_source_digest(path), str(arch).encode(), "\0".join(options).encode(),
                                    f"nvrtc{version[0]}.{version[1]}".encode()])).hexdigest()[:32]
    stem = cache_dir() / f"{path.stem}-{arch}-{key}"
    ptx_file, cubin_file, log_file = stem.with_suffix(".ptx"), stem.with_suffix(".cubin"), stem.with_suffix(".log")
    if use_cache and ptx_file.is_file() and (not cubin_ok or cubin_file.is_file()):
        return CompiledSource(source, arch, ptx_file.read_bytes(), cubin_file.read_bytes() if cubin_ok else None,
                              log_file.read_text() if log_file.is_file() else "", options)
    text = path.read_bytes()
    ptx, log = _run_nvrtc(source, text, options, f"--gpu-architecture=compute_{arch}", cubin=False)
    cubin = _run_nvrtc(source, text, options, f"--gpu-architecture=sm_{arch}", cubin=True)[0] if cubin_ok else None
    if use_cache:
        try:
            _write_atomic(ptx_file, ptx)
            _write_atomic(log_file, log.encode())
            if cubin is not None:
                _write_atomic(cubin_file, cubin)
        except OSError as exc:  # a read-only cache must not stop the engine
            logger.warning("kernel cache %s not writable: %s", cache_dir(), exc)
    return CompiledSource(source, arch, ptx, cubin, log, options)
