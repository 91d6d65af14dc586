"""gemv_s8w (ptx/gemv_s8.cu): the one-row decode GEMV on repacked Q4_0 / Q4_1 / Q8_0 rows, a warp per weight row
with dp4a, x quantized per 32 elements as gemv_s8 does (llama.cpp's Q8_1). gemv_s8's one-row build computes the
same int8 products, so the tests record which kernel launched (`kutils.launched_kernels`).

Bounds (max |got - ref| / max |ref|), as tests/kernels/test_gemv_s8.py states them:
  - EMU_TOL = 1e-3 against `kutils.s8_reference` (the same int8 x, exact integer block sums): a wrong piece, slot,
    scale or x-sum term shows as an O(1) error; what is left is fp32 accumulation and the fp16 output.
  - S8_TOL = 1.5e-2 against CpuBackend's fp32 product with unquantized x (x's 8-bit rounding); 2e-2 where the fused
    RMSNorm and SwiGLU compound it.
"""

import pytest
import torch
from tests.kernels.kutils import (assert_nan_and_zero_blocks, assert_replay_equals_eager, backend_settings,
                                  launched_kernels, rel_err, repacked_weight, s8_reference)

pytestmark = pytest.mark.gpu
EMU_TOL = 1e-3
S8_TOL = 1.5e-2
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


def _s8w_settings(backend, **extra):
    """Quant weights stored repacked and every one-row call routed to gemv_s8w (gemv_s8 "on"; the engine's "auto"
    takes it as well, gemv_int8.gemv_s8w_ok); SM80+ only (skips below)."""
    if backend.loader.arch < 80:
        pytest.skip("repacked rows and the int8 decode kernels are SM80+ (gemv_int8.gemv_s8_enabled)")
    return backend_settings(backend, gemv_kernel="auto", quant_repack="on", gemv_s8="on", gemv_s8_m1="warp", **extra)


@pytest.fixture(params=["block", "launch"])
def s8w_backend(request, cuda_backend):
    """`_s8w_settings` with x quantized by every block or once per launch (quantize_s8)."""
    with _s8w_settings(cuda_backend, gemv_s8_x=request.param):
        yield cuda_backend


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("nk", [(4096, 4096), (1000, 14336), (45, 256), (71, 768), (20000, 512)])
def test_gemv_s8w(s8w_backend, cpu_backend, fmt, nk):
    """Against the exact int8 emulation and the fp32 reference: 16-byte pieces of whole and partial 32-lane steps
    (k = 256: 8 Q4 pieces; 14,336: Q4 14 steps, a partial S8W_UNROLL item), row counts that leave a block's last
    warps idle (45, 71), more rows than the grid's warps (20,000: each warp loops over several)."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    n, k = nk
    quant, weight, lin = repacked_weight(s8w_backend, fmt, n, k, n + k)
    assert gemv_kernel_name(s8w_backend, lin, 1) == "gemv_s8w"
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k)).half()
    with launched_kernels(s8w_backend) as names:
        got = s8w_backend.linear(x.cuda(), lin)
    assert names[-1] == "gemv_s8w" and got.shape == (1, n)
    assert rel_err(got, s8_reference(x, quant)) <= EMU_TOL
    assert rel_err(got, cpu_backend.linear(x.float(), weight)) <= S8_TOL
    assert torch.equal(s8w_backend.linear(x.cuda(), lin), got)  # deterministic: fixed-order sums


@pytest.mark.parametrize("fmt", FORMATS)
def test_agrees_with_gemv_s8(s8w_backend, fmt):
    """The same products as gemv_s8's one-row build (VOLTSERVE_GEMV_S8_M1=mma), in another fp32 order."""
    quant, _, lin = repacked_weight(s8w_backend, fmt, 512, 4096, 3)
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(4)).half().cuda()
    with launched_kernels(s8w_backend) as names:
        warp = s8w_backend.linear(x, lin)
        with backend_settings(s8w_backend, gemv_s8_m1="mma"):
            mma = s8w_backend.linear(x, lin)
    assert [n for n in names if n != "quantize_s8"] == ["gemv_s8w", "gemv_s8"]
    assert rel_err(warp, mma) <= 2 * EMU_TOL
    assert rel_err(warp, s8_reference(x.cpu(), quant)) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_norm_swiglu_residual(s8w_backend, cpu_backend, fmt):
    """RMSNorm + [gate; up] + SwiGLU (an odd number of outputs: 101 gate / up pairs), and a product + residual."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    k, inner = 2048, 101
    quant, weight, lin = repacked_weight(s8w_backend, fmt, 2 * inner, k, 7)
    assert gemv_kernel_name(s8w_backend, lin, 1, norm=True, silu=True) == "gemv_s8w"
    gen = torch.Generator().manual_seed(8)
    norm = torch.rand(k, generator=gen) + 0.5
    nd = s8w_backend.prepare_norm(norm)
    x = torch.randn(1, k, generator=gen).half()
    with launched_kernels(s8w_backend) as names:
        got = s8w_backend.norm_linear(x.cuda(), nd, 1e-5, lin, silu=True)
    assert names[-1] == "gemv_s8w"
    ref = cpu_backend.norm_linear(x.float(), norm, 1e-5, weight, silu=True)
    assert got.shape == (1, inner) and rel_err(got, ref) <= 2e-2
    normed = s8w_backend.rms_norm(x.cuda(), nd, 1e-5)[0]
    plain = s8w_backend.linear(normed, lin)
    assert rel_err(s8w_backend.norm_linear(x.cuda(), nd, 1e-5, lin), plain) <= EMU_TOL
    res = torch.randn(1, 2 * inner, generator=gen).half()
    got = s8w_backend.linear(x.cuda(), lin, residual=res.cuda())
    assert rel_err(got, s8_reference(x, quant) + res.double()) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_x_per_launch_equals_per_block(cuda_backend, fmt):
    """x quantized once by quantize_s8 or by every block, with the fused RMSNorm and SwiGLU: bit for bit where the
    block has quantize_s8's 256 threads (Q8_0), whose partial sums of x's squares add in the same order; Q4's
    16-warp blocks add them in another fp32 order, so 1 / rms and then the fp16 normalized x may differ in its
    last bit (within the emulation bound)."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.linear import launch_linear

    with _s8w_settings(cuda_backend):
        _, _, lin = repacked_weight(cuda_backend, fmt, 300, 4096, 31)
        gen = torch.Generator().manual_seed(32)
        x = torch.randn(1, 4096, generator=gen).half().cuda()
        nd = cuda_backend.prepare_norm(torch.rand(4096, generator=gen) + 0.5)
        got = {}
        for mode in ("block", "launch"):
            with backend_settings(cuda_backend, gemv_s8_x=mode), launched_kernels(cuda_backend) as names:
                got[mode] = [launch_linear(cuda_backend, x, lin, norm_weight=nd, eps=1e-5, silu=silu)
                             for silu in (False, True)]
            want = ["gemv_s8w"] if mode == "block" else ["quantize_s8", "gemv_s8w"]
            assert names == 2 * want, (mode, names)
    for a, b in zip(got["block"], got["launch"]):
        if kernels.GEMV_S8W_WARPS[fmt] == 8:
            assert torch.equal(a, b)
        else:
            assert rel_err(a, b) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_full_grid_equals_persistent(s8w_backend, cpu_backend, fmt):
    """VOLTSERVE_GEMV_S8_GRID=full (a block per S8W_WARPS outputs) against the persistent grid on more rows than
    the persistent grid has warps (20,000): each output is one warp's sum in one order either way, so bit for bit,
    plain and with the fused norm + SwiGLU (every block then quantizes x itself or reads quantize_s8's x)."""
    n, k = 20000, 512
    quant, weight, lin = repacked_weight(s8w_backend, fmt, n, k, 51)
    gen = torch.Generator().manual_seed(52)
    x = torch.randn(1, k, generator=gen).half()
    nd = s8w_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)
    got = {}
    for grid in ("persistent", "full"):
        with backend_settings(s8w_backend, gemv_s8_grid=grid), launched_kernels(s8w_backend) as names:
            got[grid] = (s8w_backend.linear(x.cuda(), lin),
                         s8w_backend.norm_linear(x.cuda(), nd, 1e-5, lin, silu=True))
        assert "gemv_s8w" in names and "gemv_s8" not in names
    assert rel_err(got["full"][0], s8_reference(x, quant)) <= EMU_TOL
    assert rel_err(got["full"][0], cpu_backend.linear(x.float(), weight)) <= S8_TOL
    for a, b in zip(got["persistent"], got["full"]):
        assert torch.equal(a, b)


def test_nan_and_zero_blocks(s8w_backend):
    """A NaN in x makes every output NaN; an all-zero x block (d = 0) and blocks of very different magnitudes
    stay exact against the emulation (kutils.assert_nan_and_zero_blocks)."""
    assert_nan_and_zero_blocks(s8w_backend, EMU_TOL)


def test_graph_replay_equals_eager(s8w_backend):
    """gemv_s8w captured in a CUDA graph (with quantize_s8 before it when x is quantized per launch) replays what
    eager launches compute, bit for bit: plain, residual, and fused norm + SwiGLU."""
    from voltserve.backends.cuda.linear import launch_linear

    k, n = 4096, 256
    _, _, lin = repacked_weight(s8w_backend, "Q4_1", n, k, 41)
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(1, k, generator=gen).half().cuda()
    res = torch.randn(1, n, generator=gen).half().cuda()
    nd = s8w_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)

    def step():
        return [launch_linear(s8w_backend, x, lin), launch_linear(s8w_backend, x, lin, residual=res),
                launch_linear(s8w_backend, x, lin, norm_weight=nd, eps=1e-5, silu=True)]

    assert_replay_equals_eager(s8w_backend, step, lambda: x.copy_(torch.randn(1, k, generator=gen).half()))
