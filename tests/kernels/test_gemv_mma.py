"""gemv_mma (both paths: m16n8k16 on SM80+, the SM70 m8n8k4 path forced with gemv_kernel="mma884") and
gemv_mma_sb (SM80+) (ptx/gemv_mma.cu, tensor cores) at the Llama-3-8B decode shapes and its edge cases, against
CpuBackend on the dequantized fp32 weights.

Bound: max |got - ref| <= 3e-3 * max |ref| (fp32 accumulation; quant weights are rounded once to fp16, 2.4e-4
relative each, uncorrelated; one fp16 output rounding is 4.9e-4). The routing rules (which launches may take the
kernel) are CPU unit tests in tests/unit/test_gemv_routing.py.
"""

import pytest
import torch
from tests.kernels.kutils import capture, make_linear, rel_err

pytestmark = pytest.mark.gpu
TOL = 3e-3


@pytest.fixture(params=[("mma", 32), ("mma", 16), ("mma884", 32), ("mma884", 16)], ids=lambda p: f"{p[0]}-t{p[1]}")
def mma_backend(request, cuda_backend):
    """The backend with gemv_mma forced on: its SM80 path (m16n8k16, gemv_mma_sb for quant superblocks) and its
    SM70 path (m8n8k4, what a V100 runs), which newer GPUs execute too; each with 32- and 16-row blocks."""
    kernel, tile = request.param
    if kernel == "mma" and cuda_backend.loader.arch < 80:
        pytest.skip("the m16n8k16 path needs SM80+")
    cuda_backend.gemv_kernel, cuda_backend.gemv_mma_tile = kernel, tile
    yield cuda_backend
    cuda_backend.gemv_kernel, cuda_backend.gemv_mma_tile = "auto", 0


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("nk", [(4096, 4096), (1024, 14336), (6144, 4096)])
def test_llama_shapes(mma_backend, cpu_backend, fmt, nk):
    """Every m of a decode batch (1..8) in one test: outputs of the m = 8 launch, and each m's own launch."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    n, k = nk
    gen = torch.Generator().manual_seed(n + k)
    weight, w = make_linear(mma_backend, fmt, n, k, gen, 0.02)
    sb = fmt != "F16" and mma_backend.gemv_kernel == "mma"
    assert gemv_kernel_name(mma_backend, w, 1) == ("gemv_mma_sb" if sb else "gemv_mma")
    x = torch.randn(8, k, generator=gen).half()
    ref = cpu_backend.linear(x.float(), weight)
    xd = x.cuda()
    full = mma_backend.linear(xd, w)
    assert rel_err(full, ref) <= TOL
    for m in (1, 2, 5):
        assert torch.equal(mma_backend.linear(xd[:m].contiguous(), w), full[:m]), m


@pytest.mark.parametrize("fmt", ["F16", "Q4_1"])
@pytest.mark.parametrize("n", [1, 15, 17, 45])
def test_partial_tiles(mma_backend, cpu_backend, fmt, n):
    """n not a multiple of the block's rows (32 or 16; SwiGLU: half of them): every output is written (the allocator is
    NaN-poisoned, so a missed row shows as NaN) and correct."""
    gen = torch.Generator().manual_seed(n)
    k = 96
    weight, w = make_linear(mma_backend, fmt, 2 * n, k, gen, 0.02)
    x = torch.randn(3, k, generator=gen).half()
    got = mma_backend.linear(x.cuda(), w)
    assert rel_err(got, cpu_backend.linear(x.float(), weight)) <= TOL
    fused = mma_backend.norm_linear(x.cuda(), mma_backend.prepare_norm(torch.ones(k)), 1e-5, w, silu=True)
    assert fused.shape == (3, n) and not torch.isnan(fused).any()
    assert rel_err(fused, cpu_backend.norm_linear(x.float(), torch.ones(k), 1e-5, weight, silu=True)) <= 4e-3


def test_k_split_uneven(mma_backend, cpu_backend):
    """k / 32 chunks not divisible by the 8 warps, and fewer chunks (3) than warps: idle warps add zeros."""
    gen = torch.Generator().manual_seed(5)
    for k in (96, 32 * 37):
        weight, w = make_linear(mma_backend, "Q8_0", 64, k, gen, 0.02)
        x = torch.randn(8, k, generator=gen).half()
        assert rel_err(mma_backend.linear(x.cuda(), w), cpu_backend.linear(x.float(), weight)) <= TOL, k


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("k", [256, 768, 2304, 256 * 17])
def test_superblocks_uneven(mma_backend, cpu_backend, fmt, k):
    """gemv_mma_sb: fewer superblocks than warps (1, 3), an odd count per warp (9 -> 2, 2, 2, 2, 1), 17 -> 3 per
    warp; SwiGLU with the fused norm on the same weights."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    if mma_backend.gemv_kernel != "mma":
        pytest.skip("gemv_mma_sb is the SM80 path only")
    gen = torch.Generator().manual_seed(k)
    weight, w = make_linear(mma_backend, fmt, 96, k, gen, 0.02)
    assert gemv_kernel_name(mma_backend, w, 5) == "gemv_mma_sb"
    x = torch.randn(5, k, generator=gen).half()
    assert rel_err(mma_backend.linear(x.cuda(), w), cpu_backend.linear(x.float(), weight)) <= TOL
    norm_w = torch.rand(k, generator=gen) + 0.5
    got = mma_backend.norm_linear(x.cuda(), mma_backend.prepare_norm(norm_w), 1e-5, w, silu=True)
    assert rel_err(got, cpu_backend.norm_linear(x.float(), norm_w, 1e-5, weight, silu=True)) <= 4e-3


def test_unaligned_quant_and_strided_residual(mma_backend, cpu_backend):
    """Quant rows 4 bytes off 16-byte alignment take gemv_mma's direct loads (not the cp.async superblocks), and a
    residual with a row stride != n is made contiguous by the launcher: both still match the reference."""
    from dataclasses import replace

    from voltserve.backends.cuda.linear import gemv_kernel_name

    gen = torch.Generator().manual_seed(21)
    weight, w = make_linear(mma_backend, "Q4_1", 64, 512, gen, 0.02)
    buf = torch.zeros(w.data.numel() + 4, dtype=torch.uint8, device="cuda")
    buf[4:].copy_(w.data.view(-1))
    shifted = replace(w, data=buf[4:].view(w.data.shape))
    assert gemv_kernel_name(mma_backend, shifted, 4) == "gemv_mma"
    x = torch.randn(4, 512, generator=gen).half()
    wide = torch.randn(4, 100, generator=gen).half()
    res = wide.cuda()[:, 10:74]  # row stride 100 on the device
    assert res.stride(0) == 100
    got = mma_backend.linear(x.cuda(), shifted, residual=res)
    assert rel_err(got, cpu_backend.linear(x.float(), weight, residual=wide[:, 10:74].float())) <= TOL


def test_graph_replay_bitwise(mma_backend):
    """Fixed-order partial sums: repeated launches and a replayed CUDA graph equal eager bit for bit."""
    gen = torch.Generator().manual_seed(9)
    _, w = make_linear(mma_backend, "Q4_1", 4096, 4096, gen, 0.02)
    norm = mma_backend.prepare_norm(torch.rand(4096, generator=gen) + 0.5)
    x = torch.randn(4, 4096, generator=gen).half().cuda()
    first = mma_backend.norm_linear(x, norm, 1e-5, w, silu=True)
    assert torch.equal(mma_backend.norm_linear(x, norm, 1e-5, w, silu=True), first)
    graph, captured = capture(mma_backend, lambda: mma_backend.norm_linear(x, norm, 1e-5, w, silu=True))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, first)


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
def test_agrees_with_scalar_kernels(mma_backend, fmt):
    """gemv_mma (either path) vs the scalar kernels (gemv / gemv_q) on the same inputs: equal up to rounding
    (fp16 weights: summation order only; quant: plus the fp16 rounding of each dequantized weight)."""
    gen = torch.Generator().manual_seed(11)
    _, w = make_linear(mma_backend, fmt, 576, 1536, gen, 0.02)
    x = torch.randn(6, 1536, generator=gen).half().cuda()
    mma = mma_backend.linear(x, w)
    choice, mma_backend.gemv_kernel = mma_backend.gemv_kernel, "scalar"
    try:
        scalar = mma_backend.linear(x, w)
    finally:
        mma_backend.gemv_kernel = choice
    assert rel_err(mma, scalar) <= TOL
    assert not torch.equal(mma, scalar) or fmt == "F16"  # two different kernels really ran
