"""The CUDA driver API through cuda-python: error checks, context, module load, kernel launch.

Works with cuda-bindings 12.x and 13.x (`from cuda.bindings import driver, nvrtc`; the pre-12.6 `cuda.cuda`
module is accepted as a fallback). The import is lazy so that voltserve imports without cuda-python.
`check()` is the only place that inspects a `CUresult` / `nvrtcResult`.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from typing import Any

from voltserve.errors import CudaError


@functools.cache
def bindings() -> tuple[Any, Any]:
    """Return the (driver, nvrtc) binding modules.

    Raises:
        CudaError: cuda-python is not installed.
    """
    try:
        from cuda.bindings import driver, nvrtc
    except ImportError:
        try:
            from cuda import cuda as driver, nvrtc  # cuda-python < 12.6
        except ImportError as exc:
            raise CudaError("import cuda.bindings", -1, f"cuda-python is not installed ({exc})") from exc
    return driver, nvrtc


def check(result: Any, call: str) -> Any:
    """Unwrap a cuda-python result tuple `(status, *values)`.

    Args:
        result: what a binding returned.
        call: the function name, for the error message.
    Returns:
        None, the single value, or the tuple of values.
    Raises:
        CudaError: the status is not success; carries the code and its name.
    """
    status, values = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    code = int(status)
    if code != 0:
        raise CudaError(call, code, _error_name(status))
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _error_name(status: Any) -> str:
    driver, nvrtc = bindings()
    try:
        if isinstance(status, nvrtc.nvrtcResult):
            name = nvrtc.nvrtcGetErrorString(status)[1]
        else:
            name = driver.cuGetErrorName(status)[1]
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # the error path must never raise on its own
        return getattr(status, "name", str(status))


def device_arch(device_index: int = 0) -> int:
    """Compute capability as an int, e.g. 70 for V100, 90 for H100/H200."""
    driver, _ = bindings()
    check(driver.cuInit(0), "cuInit")
    dev = check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    attr = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                  "cuDeviceGetAttribute")
    minor = check(driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                  "cuDeviceGetAttribute")
    return major * 10 + minor


def max_smem_optin(device_index: int = 0) -> int:
    """Most shared memory (bytes) one block may opt into (cuFuncSetAttribute) on this device: 227 KB on
    SM90, 163 KB on A100, 99 KB on SM86/89, 96 KB on V100."""
    driver, _ = bindings()
    check(driver.cuInit(0), "cuInit")
    dev = check(driver.cuDeviceGet(device_index), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
    return int(check(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute"))


def load_module(image: bytes) -> Any:
    """cuModuleLoadData on a CUBIN or NUL-terminated PTX image; returns the CUmodule."""
    driver, _ = bindings()
    return check(driver.cuModuleLoadData(image), "cuModuleLoadData")


def get_function(module: Any, name: str) -> Any:
    """The CUfunction `name` (an `extern "C"` kernel) of a loaded module."""
    driver, _ = bindings()
    return check(driver.cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")


def blocks_per_sm(function: Any, block_threads: int, smem_bytes: int) -> int:
    """How many blocks of `function` (block_threads threads, smem_bytes of dynamic shared memory) one SM holds at
    once (cuOccupancyMaxActiveBlocksPerMultiprocessor: registers, shared memory and thread limits)."""
    driver, _ = bindings()
    return int(check(driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(function, block_threads, smem_bytes),
                     "cuOccupancyMaxActiveBlocksPerMultiprocessor"))


def static_smem_bytes(function: Any) -> int:
    """Bytes of a kernel's static (`__shared__`) shared memory (CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)."""
    driver, _ = bindings()
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
    return int(check(driver.cuFuncGetAttribute(attr, function), "cuFuncGetAttribute"))


def set_max_dynamic_smem(function: Any, num_bytes: int) -> None:
    """Opt a kernel into more than 48 KiB of dynamic shared memory (SM70: up to 96 KiB)."""
    driver, _ = bindings()
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    check(driver.cuFuncSetAttribute(function, attr, num_bytes), "cuFuncSetAttribute")


def launch(function: Any, grid: tuple[int, int, int], block: tuple[int, int, int], smem_bytes: int,
           stream: int, params: ctypes.Structure, name: str = "kernel", pdl: bool = False) -> None:
    """Launch a kernel with one by-value params struct as the only kernel argument.

    Args:
        function: CUfunction.
        grid, block: launch dimensions (x, y, z).
        smem_bytes: dynamic shared memory per block.
        stream: CUstream handle as an int (torch's `cuda_stream`); 0 = legacy default stream.
        params: the kernel's params struct (ctypes mirror of the C struct); copied by the driver at launch, so it
            may be freed right after (also under CUDA graph capture).
        pdl: launch with programmatic stream serialization (SM90+; cuLaunchKernelEx): the kernel may start
            while the previous kernel in the stream still runs, and orders itself with `pdl_enter()`
            (ptx/common.cuh). Under stream capture this becomes a programmatic graph edge.
    Raises:
        CudaError: the launch was rejected.
    """
    driver, _ = bindings()
    arg_ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
    if pdl:
        config = _pdl_config()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = smem_bytes
        config.hStream = driver.CUstream(stream)
        check(driver.cuLaunchKernelEx(config, function, ctypes.addressof(arg_ptrs), 0), f"cuLaunchKernelEx({name})")
        return
    check(driver.cuLaunchKernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2], smem_bytes,
                                driver.CUstream(stream), ctypes.addressof(arg_ptrs), 0),
          f"cuLaunchKernel({name})")


_thread_state = threading.local()


def _pdl_config() -> Any:
    """This thread's reusable CUlaunchConfig carrying the PDL attribute (building one costs ~3.5 us of Python,
    setting its fields ~0.2 us)."""
    config = getattr(_thread_state, "pdl_config", None)
    if config is None:
        driver, _ = bindings()
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        config = driver.CUlaunchConfig()
        config.attrs = [attr]
        config.numAttrs = 1
        _thread_state.pdl_config = config
    return config
