"""Loaded kernels: compile through nvrtc.py, load the CUBIN for the device's arch (PTX as fallback), memoise.

The CUBIN loads in ~0.1 ms; PTX costs a driver JIT (150-200 ms per module) and is refused by a driver older than
the NVRTC that wrote it, so it is only the fallback (DESIGN section 9).
"""

from __future__ import annotations

import logging
from typing import Any

from voltserve.backends.cuda import driver, kernels, nvrtc
from voltserve.errors import CudaError

logger = logging.getLogger(__name__)

_DEFAULT_MAX_SMEM = 48 * 1024


class KernelLoader:
    """Per-device cache of loaded modules and functions.

    Args:
        device_index: CUDA device ordinal; its primary context must be current on the calling thread
            (torch makes it so after `torch.cuda.set_device` and a first CUDA op).
    """

    def __init__(self, device_index: int = 0):
        self.device_index = device_index
        self.arch = driver.device_arch(device_index)
        self.max_smem_optin = driver.max_smem_optin(device_index)
        supported = nvrtc.supported_archs()
        below = [a for a in supported if a <= self.arch]
        # the exact arch gets a CUBIN; an arch newer than this NVRTC knows runs the newest PTX it can write
        self.compile_arch = self.arch if self.arch in supported else max(below or supported)
        self._modules: dict[tuple, Any] = {}
        self._functions: dict[tuple, Any] = {}
        self._smem_set: dict[tuple, int] = {}
        self._static: dict[tuple, int] = {}  # static shared memory per function

    def function(self, op: str, kernel: str, spec: dict[str, int] | None = None, smem_bytes: int = 0) -> Any:
        """The CUfunction `kernel` of `op`'s source compiled with `spec`, ready for `smem_bytes` of dynamic smem.

        Raises:
            KernelCompileError: NVRTC rejected the source.
            CudaError: the module could not be loaded or the function is missing.
        """
        key = (op, kernel, tuple(sorted((spec or {}).items())))
        fn = self._functions.get(key)
        if fn is None:
            module = self._module(op, spec or {})
            fn = driver.get_function(module, kernel)
            self._functions[key] = fn
        # the opt-in is needed once static + dynamic shared memory pass 48 KiB
        if smem_bytes and self._smem_set.get(key, 0) < smem_bytes and \
                smem_bytes + self._static_smem(key, fn) > _DEFAULT_MAX_SMEM:
            driver.set_max_dynamic_smem(fn, smem_bytes)
            self._smem_set[key] = smem_bytes
        return fn

    def _static_smem(self, key: tuple, fn: Any) -> int:
        hit = self._static.get(key)
        if hit is None:
            hit = self._static[key] = driver.static_smem_bytes(fn)
        return hit

    def _module(self, op: str, spec: dict[str, int]) -> Any:
        key = (op, tuple(sorted(spec.items())))
        module = self._modules.get(key)
        if module is not None:
            return module
        compiled = nvrtc.compile_source(kernels.SOURCES[op].file, self.compile_arch, kernels.defines(op, **spec))
        if compiled.cubin is not None and self.compile_arch == self.arch:
            try:
                module = driver.load_module(compiled.cubin)
            except CudaError as exc:
                logger.warning("CUBIN for %s sm_%d did not load (%s); falling back to PTX", op, self.arch, exc)
        if module is None:
            module = driver.load_module(compiled.ptx)
        self._modules[key] = module
        return module
