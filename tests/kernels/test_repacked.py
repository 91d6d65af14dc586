"""Repacked quant rows (backends/cuda/repack.py) through gemv_mma (m <= 16: both MMA paths, 32- and 16-row
blocks, the fused RMSNorm / SwiGLU / residual) and gemm_tc (m >= 17), against CpuBackend on the dequantized fp32
weights, and against the same weights in the GGUF layout.

Bounds: as tests/kernels/test_gemv_mma.py (3e-3 of max |ref|; 4e-3 with the fused norm + SwiGLU) and
test_linear.py's gemm_tc bound (3e-3). Where the per-warp k ranges coincide (k / 32 / 8 warps a multiple of the
load group: 4 blocks for Q4, 2 for Q8_0) gemv_mma reads the same words in the same order from either layout, so
its outputs are bitwise equal.
"""

import pytest
import torch
from tests.kernels.kutils import backend_settings, make_quant, rel_err

pytestmark = pytest.mark.gpu
TOL = 3e-3
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(params=[("mma", 32), ("mma", 16), ("mma884", 32)], ids=lambda p: f"{p[0]}-t{p[1]}")
def rp_backend(request, cuda_backend):
    """The backend storing quant weights repacked, with gemv_mma's SM80 path (m16n8k16; 32- and 16-row blocks)
    or its m8n8k4 path (never taken with repacked rows in production, where SM70 keeps GGUF rows; tested for the
    layout's bitwise equality with GGUF rows on one kernel)."""
    kernel, tile = request.param
    if cuda_backend.loader.arch < 80:
        pytest.skip("repacked rows are SM80+ (linear.repack_wanted)")
    with backend_settings(cuda_backend, gemv_kernel=kernel, gemv_mma_tile=tile, quant_repack="on"):
        yield cuda_backend


def _pair(backend, fmt, n, k, seed):
    """(fp32 reference weight, repacked linear, GGUF linear) of one random quant weight."""
    from voltserve.backends.cuda.repack import unpack_rows

    gen = torch.Generator().manual_seed(seed)
    quant, weight = make_quant(fmt, n, k, gen)
    rp = backend.prepare_linear(weight, quant)
    backend.quant_repack = "off"
    try:
        gguf = backend.prepare_linear(weight, quant)
    finally:
        backend.quant_repack = "on"
    assert rp.layout == "repacked" and gguf.layout == "gguf"
    assert torch.equal(unpack_rows(rp.data, fmt, k), gguf.data)  # the device-side repack is the CPU one's inverse
    return weight, rp, gguf


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("nk", [(4096, 4096), (1024, 14336), (45, 256), (70, 768)])
def test_gemv(rp_backend, cpu_backend, fmt, nk):
    """m = 1..8 in one test (each m's launch equals the rows of the m = 8 launch), partial tiles (45, 70 rows),
    k ranges shorter than the load group (256: one block per warp) and bitwise equality with the GGUF layout
    where the warps' k ranges coincide (4096, 14336)."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    n, k = nk
    weight, rp, gguf = _pair(rp_backend, fmt, n, k, n + k)
    for m in (1, 2, 8):
        assert gemv_kernel_name(rp_backend, rp, m) == "gemv_mma"
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(8, k, generator=gen).half()
    full = rp_backend.linear(x.cuda(), rp)
    assert rel_err(full, cpu_backend.linear(x.float(), weight)) <= TOL
    for m in (1, 2, 5):
        assert torch.equal(rp_backend.linear(x[:m].cuda(), rp), full[:m]), m
    twice = rp_backend.linear(torch.cat([x, x]).cuda(), rp)  # 16 rows: two launches of 8
    assert torch.equal(twice[:8], full) and torch.equal(twice[8:], full)
    if k >= 4096 and rp_backend.gemv_kernel == "mma884":  # GGUF rows take gemv_mma (not _sb) only on this path
        assert torch.equal(rp_backend.linear(x.cuda(), gguf), full)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_norm_swiglu_residual(rp_backend, cpu_backend, fmt):
    """The decoder block's fusions on repacked weights: RMSNorm + [gate; up] + SwiGLU at m = 1 (which GGUF
    weights run on the scalar gemv) and m = 8, and o_proj-like + residual."""
    k, inner = 2048, 3 * 32 + 5
    weight, rp, _ = _pair(rp_backend, fmt, 2 * inner, k, 7)
    gen = torch.Generator().manual_seed(8)
    norm = (torch.rand(k, generator=gen) + 0.5)
    nd = rp_backend.prepare_norm(norm)
    for m in (1, 8):
        x = torch.randn(m, k, generator=gen).half()
        got = rp_backend.norm_linear(x.cuda(), nd, 1e-5, rp, silu=True)
        ref = cpu_backend.norm_linear(x.float(), norm, 1e-5, weight, silu=True)
        assert got.shape == (m, inner) and rel_err(got, ref) <= 4e-3, m
        res = torch.randn(m, 2 * inner, generator=gen).half()
        got = rp_backend.linear(x.cuda(), rp, residual=res.cuda())
        ref = cpu_backend.linear(x.float(), weight) + res.float()
        assert rel_err(got, ref) <= TOL, m


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [17, 64, 200])
def test_gemm_tc(rp_backend, cpu_backend, fmt, m):
    """m >= 17 (prefill, large batches; 9..16 rows are two gemv_mma launches): gemm_tc reads repacked rows
    (split-K at small m), equal to its GGUF build bit for bit (same values, same order)."""
    k, n = 1024, 96
    weight, rp, gguf = _pair(rp_backend, fmt, n, k, m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).half().cuda()
    with backend_settings(rp_backend, quant_gemm="tc"):
        got = rp_backend.linear(x, rp)
        assert rel_err(got, cpu_backend.linear(x.float().cpu(), weight)) <= TOL
        assert torch.equal(got, rp_backend.linear(x, gguf))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequant_gemm(rp_backend, cpu_backend, fmt):
    """dequant_f16 on repacked rows (k = 5,120: two blocks a row, the second part-filled; from row 0 and 5): the
    same fp16 weights as from the GGUF rows (and the exact dequantized values), and the cuBLAS GEMM on them within
    the gemm_tc bound."""
    from voltserve.backends.cuda.dequant_gemm import dequantize_rows

    k, n, m = 5120, 96, 200
    weight, rp, gguf = _pair(rp_backend, fmt, n, k, 11)
    for n0 in (0, 5):
        out = [dequantize_rows(rp_backend, lin, n0, torch.full((n - n0, k), float("nan"), dtype=torch.float16,
                                                                device="cuda")) for lin in (rp, gguf)]
        assert torch.equal(out[0], out[1]) and torch.equal(out[0].cpu(), weight[n0:].half())
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).half().cuda()
    with backend_settings(rp_backend, quant_gemm="dequant"):
        got = rp_backend.linear(x, rp)
    assert rel_err(got, cpu_backend.linear(x.float().cpu(), weight)) <= TOL


def test_misaligned_x_is_copied(rp_backend, cpu_backend):
    """x rows that are a misaligned view (contiguous, off by one element) are copied, not refused."""
    weight, rp, _ = _pair(rp_backend, "Q4_1", 64, 512, 3)
    gen = torch.Generator().manual_seed(4)
    big = torch.randn(4 * 512 + 1, generator=gen).half()
    xd = big.cuda()[1:].view(4, 512)
    assert xd.is_contiguous() and xd.data_ptr() % 16
    got = rp_backend.linear(xd, rp)
    assert rel_err(got, cpu_backend.linear(big[1:].view(4, 512).float(), weight)) <= TOL
