"""Decode fusions vs the CPU reference and vs the unfused CUDA ops.

- norm_linear (RMSNorm in the GEMV prologue), with silu (SwiGLU epilogue), and linear with a residual epilogue, on
  fp16 and GGUF weights, m from 1 (gemv) through 8 (gemv_q) to 17 (GEMM + separate ops), under each
  `gemv_choice` (routing, SM70 kernels, tensor-core gemv_mma).
  Bound vs CpuBackend: max |got - ref| <= 4e-3 * max |ref| (fp32 accumulation; the fused paths keep the fp16
  roundings of the unfused ones: normalized x, linear output; one more fp16 rounding than test_linear's 3e-3).
- The residual and SwiGLU epilogues equal the unfused CUDA ops bit for bit (same kernel and row bucket); the norm
  prologue differs from rms_norm only by the fp32 summation order of 1/rms.
- fp16 weights with the norm folded in (prepare_linear's `norm`; gemv's NORM_POST build, else a unit-weight
  rms_norm before gemv_mma or the GEMM): the same 4e-3 bound vs CpuBackend on the unfolded weight (fp16(W g)
  rounds where the unfused path rounds the normalized x).
"""

import pytest
import torch
from tests.kernels.kutils import make_linear, poison_allocator, rel_err

pytestmark = pytest.mark.gpu
TOL = 4e-3


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 11, 17])
@pytest.mark.parametrize("nk", [(3072, 576), (130, 4096), (66, 96), (9000, 96)])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_linear(cuda_backend, cpu_backend, gemv_choice, fmt, m, nk, silu):
    n, k = nk
    gen = torch.Generator().manual_seed(m * 7 + n + k + silu)
    weight, w = make_linear(cuda_backend, fmt, n, k, gen)
    x = (torch.randn(m, k, generator=gen) * 3).half()
    norm_w = torch.rand(k, generator=gen) + 0.5
    poison_allocator()
    got = cuda_backend.norm_linear(x.cuda(), cuda_backend.prepare_norm(norm_w), 1e-5, w, silu=silu)
    ref = cpu_backend.norm_linear(x.float(), norm_w, 1e-5, weight, silu=silu)
    assert got.shape == (m, n // 2 if silu else n)
    assert rel_err(got, ref) <= TOL
    # the unfused CUDA ops (rms_norm kernel, linear, silu_mul): equal up to 1/rms summation order
    xn, _ = cuda_backend.rms_norm(x.cuda(), cuda_backend.prepare_norm(norm_w), 1e-5)
    unfused = cuda_backend.linear(xn, w)
    unfused = cuda_backend.silu_and_mul(unfused) if silu else unfused
    assert rel_err(got, unfused) <= TOL


@pytest.mark.parametrize("fmt", ["F16", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 11, 17])
@pytest.mark.parametrize("nk", [(576, 1536), (4096, 512), (45, 96)])
def test_linear_residual(cuda_backend, cpu_backend, gemv_choice, fmt, m, nk):
    n, k = nk
    gen = torch.Generator().manual_seed(m + n * k)
    weight, w = make_linear(cuda_backend, fmt, n, k, gen)
    x = torch.randn(m, k, generator=gen).half()
    res = (torch.randn(m, n, generator=gen) * 4).half()
    got = cuda_backend.linear(x.cuda(), w, residual=res.cuda())
    assert rel_err(got, cpu_backend.linear(x.float(), weight, residual=res.float())) <= TOL
    assert torch.equal(got, torch.add(cuda_backend.linear(x.cuda(), w), res.cuda()))  # bitwise: same roundings


@pytest.mark.parametrize("fmt", ["F16", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_silu_epilogue_bitwise(cuda_backend, gemv_choice, fmt, m):
    """The SwiGLU epilogue equals linear + silu_mul bit for bit (without the norm prologue) where one kernel runs
    both: gemv (m <= 2 scalar) and gemv_mma (any m); the scalar quant path at m = 5 is gemv_q + silu_mul anyway."""
    from voltserve.backends.cuda.linear import launch_linear

    gen = torch.Generator().manual_seed(m)
    _, w = make_linear(cuda_backend, fmt, 2 * 768, 576, gen)
    x = torch.randn(m, 576, generator=gen).half().cuda()
    fused = launch_linear(cuda_backend, x, w, silu=True)
    assert torch.equal(fused, cuda_backend.silu_and_mul(cuda_backend.linear(x, w)))


def test_norm_linear_large_x_falls_back(cuda_backend, cpu_backend, gemv_choice):
    """gemv: 8 rows x 4096 fp16 = 64 KB > the prologue's smem budget, so rms_norm runs first, result the same;
    gemv_mma reads x from global memory and fuses the norm at any size."""
    gen = torch.Generator().manual_seed(3)
    weight, w = make_linear(cuda_backend, "F16", 40, 4096, gen)
    x = torch.randn(7, 4096, generator=gen).half()
    norm_w = torch.rand(4096, generator=gen) + 0.5
    got = cuda_backend.norm_linear(x.cuda(), cuda_backend.prepare_norm(norm_w), 1e-6, w)
    assert rel_err(got, cpu_backend.norm_linear(x.float(), norm_w, 1e-6, weight)) <= TOL


@pytest.mark.parametrize("fmt", ["F16", "Q4_1"])
def test_norm_rows_bitwise(cuda_backend, fmt):
    """The fused norm's 1/rms is one pass over all x rows from m = 2 and a pass per row at m = 1, with the same
    sums bit for bit: every row of a gemv_mma launch equals that row alone and inside any other launch."""
    cuda_backend.gemv_kernel = "mma"
    try:
        gen = torch.Generator().manual_seed(11)
        k = 4096
        weight, w = make_linear(cuda_backend, fmt, 64, k, gen)
        x = (torch.randn(8, k, generator=gen) * 3).half().cuda()
        norm_w = cuda_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)
        full = cuda_backend.norm_linear(x, norm_w, 1e-5, w)
        for m in range(1, 8):
            assert torch.equal(cuda_backend.norm_linear(x[:m].contiguous(), norm_w, 1e-5, w), full[:m]), m
        assert torch.equal(cuda_backend.norm_linear(x[5:6].contiguous(), norm_w, 1e-5, w), full[5:6])
    finally:
        cuda_backend.gemv_kernel = "auto"


@pytest.fixture
def norm_fold_on(cuda_backend):
    cuda_backend.norm_fold = "on"
    yield
    cuda_backend.norm_fold = "auto"


@pytest.mark.parametrize("m", [1, 2, 3, 8, 11, 17])
@pytest.mark.parametrize("nk", [(3072, 576), (130, 4096), (66, 96), (40, 100)])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_folded_linear(cuda_backend, cpu_backend, gemv_choice, norm_fold_on, m, nk, silu):
    """The norm folded into an fp16 weight: gemv's NORM_POST build (m = 1, every m under "scalar", k % 8 != 0
    through its scalar tail), gemv_mma after a unit-weight rms_norm (from 2 rows) and the GEMM path (17 rows)."""
    n, k = nk
    gen = torch.Generator().manual_seed(m * 5 + n + k + silu)
    weight = (torch.randn(n, k, generator=gen) * 0.05).half().float()
    norm_w = torch.rand(k, generator=gen) + 0.5
    w = cuda_backend.prepare_linear(weight, None, swiglu=silu, norm=norm_w)
    assert w.norm_folded
    x = (torch.randn(m, k, generator=gen) * 3).half()
    got = cuda_backend.norm_linear(x.cuda(), cuda_backend.prepare_norm(norm_w), 1e-5, w, silu=silu)
    ref = cpu_backend.norm_linear(x.float(), norm_w, 1e-5, weight, silu=silu)
    assert got.shape == (m, n // 2 if silu else n)
    assert rel_err(got, ref) <= TOL
    with pytest.raises(ValueError, match="norm_linear"):
        cuda_backend.linear(x.cuda(), w)


def test_norm_folded_rows_independent(cuda_backend, norm_fold_on):
    """Each row's 1/rms comes from its own x row: a row's output is the same alone as among 8 (gemv_mma's rows
    from 2 up are bitwise independent of the others; gemv's NORM_POST at 1 row differs by rounding order)."""
    gen = torch.Generator().manual_seed(11)
    k = 4096
    w = cuda_backend.prepare_linear(torch.randn(256, k, generator=gen) * 0.05, None,
                                    norm=torch.rand(k, generator=gen) + 0.5)
    x = (torch.randn(8, k, generator=gen) * torch.arange(1, 9).float()[:, None]).half().cuda()
    unit = cuda_backend.prepare_norm(torch.ones(k))
    full = cuda_backend.norm_linear(x, unit, 1e-5, w)
    assert torch.equal(cuda_backend.norm_linear(x[2:5].contiguous(), unit, 1e-5, w), full[2:5])
    one = cuda_backend.norm_linear(x[6:7].contiguous(), unit, 1e-5, w)
    assert rel_err(one, full[6:7]) <= 2e-3  # gemv NORM_POST vs rms_norm + gemv_mma: rounding order only
