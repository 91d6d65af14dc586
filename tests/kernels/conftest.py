"""Fixtures of the kernel tests: the CUDA backend under test and the CPU oracle.

Every test here is `@pytest.mark.gpu` (skipped without a GPU by tests/conftest.py); the `cuda_backend` fixture
also skips on its own, so these files stay safe if that hook changes.
"""

from __future__ import annotations

import pytest

from tests.conftest import gpu_available as _gpu_ok


@pytest.fixture(scope="session")
def cuda_backend():
    if not _gpu_ok():
        pytest.skip("needs an NVIDIA GPU and cuda-python (cuda.bindings)")
    from voltserve.backends.cuda.backend import CudaBackend

    backend = CudaBackend(0)
    # the GGUF-layout kernels are under test here; the repacked layout has tests of its own
    # (test_repacked.py sets quant_repack itself)
    backend.quant_repack = "off"
    return backend


@pytest.fixture(scope="session")
def cpu_backend():
    import torch

    from voltserve.backends.cpu import CpuBackend

    return CpuBackend(torch.float32)


@pytest.fixture(autouse=True)
def _poison(request):
    """Fill torch's cached device memory with NaN before each GPU test, so outputs a kernel never writes show."""
    if "gpu" in request.keywords and _gpu_ok():
        from tests.kernels.kutils import poison_allocator

        poison_allocator()
    yield


@pytest.fixture(params=["auto", "scalar", "mma", "mma884"])
def gemv_choice(request, cuda_backend):
    """Runs a GEMV test under each `CudaBackend.gemv_kernel` choice: the engine's routing ("auto"), the scalar
    kernels gemv / gemv_q ("scalar"), the tensor-core gemv_mma / gemv_mma_sb wherever their shape rules allow
    ("mma": the m16n8k16 path, SM80+) and gemv_mma's SM70 m8n8k4 path on this GPU ("mma884")."""
    if request.param == "mma" and cuda_backend.loader.arch < 80:
        pytest.skip("the m16n8k16 path needs SM80+")
    cuda_backend.gemv_kernel = request.param
    yield request.param
    cuda_backend.gemv_kernel = "auto"


@pytest.fixture(params=["auto", "simt"])
def attn_choice(request, cuda_backend):
    """Runs a decode-attention test under each `CudaBackend.attn_kernel` choice: the engine's ("auto": tensor
    cores on SM80+ where the GQA group fits) and the CUDA-core path V100 runs ("simt")."""
    cuda_backend.attn_kernel = request.param
    yield request.param
    cuda_backend.attn_kernel = "auto"
