"""CPU stand-ins for the decode-GEMV routing tests (tests/unit/test_gemv_routing.py, test_gemv_int8_routing.py):
a backend with only the attributes the routing reads, CudaLinear weights of zeros, and a backend whose launches
are recorded instead of run."""

from types import SimpleNamespace

import torch

from voltserve.backends.cuda.linear import CudaLinear


def fake_backend(arch, choice="auto", smem_kb=227):
    """The attributes gemv routing reads: compute capability `arch`, the GEMV choice, `smem_kb` KB of opt-in
    shared memory an SM, 132 SMs."""
    loader = SimpleNamespace(arch=arch, compile_arch=arch, max_smem_optin=smem_kb * 1024)
    return SimpleNamespace(loader=loader, gemv_kernel=choice, num_sms=132)


def fake_linear(fmt, n, k):
    """A [n, k] CudaLinear of zeros: fp16, or GGUF rows of `fmt` (Q4_0 / Q4_1 / Q8_0)."""
    if fmt == "F16":
        return CudaLinear("F16", torch.zeros(n, k, dtype=torch.float16), n, k, 2 * k)
    block = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[fmt]
    return CudaLinear(fmt, torch.zeros(n, k // 32 * block, dtype=torch.uint8), n, k, k // 32 * block)


def repacked_linear(fmt, n, k):
    """`fake_linear` stored as repacked rows (gemv_s8 / gemv_s8w's layout)."""
    w = fake_linear(fmt, n, k)
    w.layout = "repacked"
    return w


def recording_backend(**knobs):
    """A CPU stand-in for CudaBackend whose `_launch` records (kernel, grid, block, smem, params, pdl) instead of
    launching: launch_linear's Python side (routing, grids, params) runs for real."""
    launches = []

    def record(op, kernel, spec, grid, block, smem, params, pdl=None):
        launches.append(SimpleNamespace(kernel=kernel, spec=spec, grid=grid, block=block, smem=smem, params=params,
                                        pdl=pdl))
        backend.last_launch_weight_bytes = 0

    backend = SimpleNamespace(pdl=True, gemv_pdl="auto", gemv_kernel="auto", gemv_mma_tile=0, gemv_s8="auto",
                              gemv_s8_m1="warp", gemv_s8_x="auto", gemv_s8_xcopy="split", gemv_s8_grid="persistent",
                              gemv_s8_tiles="auto",
                              gemv_s8_rows="auto", quant_gemv_rows="auto", quant_gemm="auto",
                              gemv_tma="folded", gemv_tma_s8="off", fuse_norm="auto", num_sms=132,
                              last_launch_weight_bytes=0, _launch=record, _occupancy=lambda *a, **k: 2,
                              loader=SimpleNamespace(arch=90, compile_arch=90, max_smem_optin=227 * 1024))
    for name, value in knobs.items():
        setattr(backend, name, value)
    return backend, launches
