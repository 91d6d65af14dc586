"""gemv_tma_s8 (ptx/gemv_tma_s8.cu): the one-row decode GEMV on repacked Q4_0 / Q4_1 / Q8_0 rows streaming its
weights through gemv_tma's bulk-copy ring (SM90+), products on int8 tensor cores with x quantized per 32 elements
as gemv_s8 does (llama.cpp's Q8_1).

Bounds (max |got - ref| / max |ref|), as tests/kernels/test_gemv_s8.py states them:
  - EMU_TOL = 1e-3 against `kutils.s8_reference` (the same int8 x, exact integer block sums): a wrong slot,
    block, scale, x-sum term or piece shows as an O(1) error; what is left is fp32 accumulation and the fp16 output.
  - S8_TOL = 1.5e-2 against CpuBackend's fp32 product with unquantized x (x's 8-bit rounding).
The kernel adds each output's chunk sums in fixed order, so its outputs do not depend on the ring's depth
(asserted).
"""

import pytest
import torch
from tests.kernels.kutils import (assert_nan_and_zero_blocks, assert_replay_equals_eager, backend_settings,
                                  launched_kernels, rel_err, repacked_weight, s8_reference)

pytestmark = pytest.mark.gpu
EMU_TOL = 1e-3
S8_TOL = 1.5e-2
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture
def tma_s8_backend(cuda_backend):
    """Quant weights stored repacked, one-row calls routed to gemv_tma_s8 (VOLTSERVE_GEMV_TMA_S8=on); SM90+."""
    if cuda_backend.loader.arch < 90:
        pytest.skip("gemv_tma_s8 needs cp.async.bulk (SM90+)")
    with backend_settings(cuda_backend, gemv_kernel="auto", quant_repack="on", gemv_s8="auto", gemv_tma_s8="on"):
        yield cuda_backend


def _x(k, seed):
    return torch.randn(1, k, generator=torch.Generator().manual_seed(seed)).half()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("nk", [(4096, 4096), (4096, 14336), (14336, 4096), (5, 1024), (1000, 2048),
                                (20000, 1024), (7, 4096)])
def test_gemv_tma_s8(tma_s8_backend, cpu_backend, fmt, nk):
    """Against the exact int8 emulation and the fp32 reference: 8B shapes (k = 14,336: stages of one row pair),
    fewer features than SMs (5, 7: a block of one row, its stage's second row unused), uneven features per block
    (1000: odd row counts), many short rows per block (20,000: the ring wraps many times)."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    n, k = nk
    quant, weight, lin = repacked_weight(tma_s8_backend, fmt, n, k, n + k)
    assert gemv_kernel_name(tma_s8_backend, lin, 1) == "gemv_tma_s8"
    x = _x(k, k + 1)
    with launched_kernels(tma_s8_backend) as names:
        got = tma_s8_backend.linear(x.cuda(), lin)
    assert names == ["gemv_tma_s8"] and got.shape == (1, n)
    assert rel_err(got, s8_reference(x, quant)) <= EMU_TOL
    if n >= 64:  # x's rounding: a statistical bound, loose on a handful of outputs (5 rows: 1.7e-2 measured)
        assert rel_err(got, cpu_backend.linear(x.float(), weight)) <= S8_TOL
    assert torch.equal(tma_s8_backend.linear(x.cuda(), lin), got)  # deterministic: fixed-order sums


@pytest.mark.parametrize("fmt", FORMATS)
def test_residual_and_agrees_with_gemv_s8w(tma_s8_backend, fmt):
    """y + residual (fp16 rounding of the product kept, as every fused residual) and the same products as gemv_s8w
    (VOLTSERVE_GEMV_TMA_S8=off), in another fp32 order."""
    n, k = 3000, 4096
    quant, _, lin = repacked_weight(tma_s8_backend, fmt, n, k, 5)
    x = _x(k, 6).cuda()
    res = torch.randn(1, n, generator=torch.Generator().manual_seed(7)).half().cuda()
    with launched_kernels(tma_s8_backend) as names:
        plain = tma_s8_backend.linear(x, lin)
        fused = tma_s8_backend.linear(x, lin, residual=res)
        with backend_settings(tma_s8_backend, gemv_tma_s8="off", gemv_s8="on", gemv_s8_m1="warp"):
            warp = tma_s8_backend.linear(x, lin)
    assert [name for name in names if name != "quantize_s8"] == ["gemv_tma_s8", "gemv_tma_s8", "gemv_s8w"]
    assert torch.equal(fused, (plain.float() + res.float()).half())
    assert rel_err(plain, warp) <= 2 * EMU_TOL
    assert rel_err(plain, s8_reference(x.cpu(), quant)) <= EMU_TOL


def test_ring_depth_does_not_change_outputs(tma_s8_backend, monkeypatch):
    """Other ring depths give the same outputs bit for bit (Q4_1 k = 14,336: stages of one row pair); other rows
    per stage change how a row's chunks are grouped into warp sums (the fp32 order), not the products."""
    from voltserve.backends.cuda import kernels_tma

    quant, _, lin = repacked_weight(tma_s8_backend, "Q4_1", 700, 14336, 9)
    x = _x(14336, 10).cuda()
    assert kernels_tma.gemv_tma_s8_ring("Q4_1", 14336)[1] == 2
    want = tma_s8_backend.linear(x, lin)
    assert rel_err(want, s8_reference(x.cpu(), quant)) <= EMU_TOL
    for ring in ((1, 2), (2, 2), (5, 2), (2, 4), (3, 6)):
        monkeypatch.setattr(kernels_tma, "gemv_tma_s8_ring", lambda fmt, k, ring=ring: ring)
        got = tma_s8_backend.linear(x, lin)
        assert torch.equal(got, want) if ring[1] == 2 else rel_err(got, want) <= 2 * EMU_TOL, ring


def test_nan_and_zero_blocks(tma_s8_backend):
    """A NaN in x makes every output NaN; an all-zero x block (d = 0) and blocks of very different magnitudes
    stay exact against the emulation (kutils.assert_nan_and_zero_blocks)."""
    assert_nan_and_zero_blocks(tma_s8_backend, EMU_TOL)


def test_graph_replay_equals_eager(tma_s8_backend):
    """gemv_tma_s8 captured in a CUDA graph replays what eager launches compute, bit for bit (plain, residual)."""
    from voltserve.backends.cuda.linear import launch_linear

    k, n = 4096, 512
    _, _, lin = repacked_weight(tma_s8_backend, "Q8_0", n, k, 41)
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(1, k, generator=gen).half().cuda()
    res = torch.randn(1, n, generator=gen).half().cuda()

    def step():
        return [launch_linear(tma_s8_backend, x, lin), launch_linear(tma_s8_backend, x, lin, residual=res)]

    assert_replay_equals_eager(tma_s8_backend, step, lambda: x.copy_(torch.randn(1, k, generator=gen).half()))
