"""gemv_tma (ptx/gemv_tma.cu): the one-row fp16 decode GEMV streaming its weights through a shared-memory ring
of bulk asynchronous copies (SM90+), with its fusions (residual, SwiGLU, the folded RMSNorm's 1 / rms).

Bounds (max |got - ref| / max |ref|):
  - TOL = 4e-3 against CpuBackend's fp32 reference (test_fused.py's bound: fp32 accumulation, the fp16 roundings of
    the unfused ops, and for folded weights fp16(W g) where the reference rounds the normalized x).
  - GEMV_TOL = 1e-3 against `gemv` on the same weight (VOLTSERVE_GEMV_TMA=off): the same exact fp16 x fp16
    products, summed in another order (gemv_tma's on tensor cores, whose fp32 accumulation truncates rather than
    rounds), one fp16 output rounding apart.
The kernel adds each output's 1024-wide spans in fixed order, so the ring depth and the grid do not change a bit
of it (asserted).
"""

import pytest
import torch
from tests.kernels.kutils import assert_replay_equals_eager, backend_settings, launched_kernels, rel_err

from voltserve.backends.cuda import kernels_tma
from voltserve.backends.cuda.gemv_tma import ring_block_smem

pytestmark = pytest.mark.gpu
TOL = 4e-3
GEMV_TOL = 1e-3
# (n, k): 8B shapes (o_proj, qkv, down: ~109 stages of 8 KB per block, the 16-stage ring wraps ~7 times), fewer
# features than SMs, uneven features per block, many short rows (~38 stages per block)
SHAPES = [(4096, 4096), (6144, 4096), (4096, 14336), (5, 1024), (1000, 2048), (20000, 1024)]


@pytest.fixture
def tma_backend(cuda_backend):
    """gemv_tma on every fp16 weight it can take (VOLTSERVE_GEMV_TMA=on; the engine's default is "folded"); SM90+
    only."""
    if cuda_backend.loader.arch < 90:
        pytest.skip("gemv_tma needs cp.async.bulk (SM90+)")
    with backend_settings(cuda_backend, gemv_kernel="auto", gemv_tma="on"):
        yield cuda_backend


def _case(n, k, seed, silu=False, norm=False):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=gen) * 0.05).half().float()
    x = (torch.randn(1, k, generator=gen) * (3 if norm else 1)).half()
    norm_w = torch.rand(k, generator=gen) + 0.5 if norm else None
    res = torch.randn(1, n // 2 if silu else n, generator=gen).half()
    return weight, x, norm_w, res


def _run(backend, x, w, norm_w=None, silu=False, residual=None):
    with launched_kernels(backend) as names:
        if norm_w is not None:
            got = backend.norm_linear(x.cuda(), backend.prepare_norm(norm_w), 1e-5, w, silu=silu)
        else:
            got = backend.linear(x.cuda(), w, residual=None if residual is None else residual.cuda())
    return got, names


@pytest.mark.parametrize("nk", SHAPES)
def test_linear_and_residual(tma_backend, cpu_backend, nk):
    """y = x W^T and y = x W^T + r against the CPU reference and against gemv."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    n, k = nk
    weight, x, _, res = _case(n, k, n + k)
    w = tma_backend.prepare_linear(weight)
    assert gemv_kernel_name(tma_backend, w, 1) == "gemv_tma"
    for residual in (None, res):
        got, names = _run(tma_backend, x, w, residual=residual)
        assert names == ["gemv_tma"] and got.shape == (1, n)
        ref = cpu_backend.linear(x.float(), weight, None if residual is None else residual.float())
        assert rel_err(got, ref) <= TOL
        with backend_settings(tma_backend, gemv_tma="off"):
            old, old_names = _run(tma_backend, x, w, residual=residual)
        assert old_names == ["gemv"] and rel_err(got, old) <= GEMV_TOL


@pytest.mark.parametrize("nk", [(4096, 4096), (2 * 14336, 4096), (6, 1024), (2000, 2048)])
@pytest.mark.parametrize("silu", [False, True])
def test_norm_folded_and_swiglu(tma_backend, cpu_backend, nk, silu):
    """The norm folded into W (NORM_POST: 1 / rms from x, once per block; norm_linear ignores the norm weight it
    is given, whose g is in W) with and without SwiGLU ([gate; up]: each block streams its gate rows, then the
    matching up rows)."""
    n, k = nk
    weight, x, norm_w, _ = _case(n, k, 3 * n + k + silu, silu=silu, norm=True)
    with backend_settings(tma_backend, norm_fold="on"):
        w = tma_backend.prepare_linear(weight, None, swiglu=silu, norm=norm_w)
    assert w.norm_folded
    got, names = _run(tma_backend, x, w, norm_w=norm_w, silu=silu)
    assert names == ["gemv_tma"] and got.shape == (1, n // 2 if silu else n)
    ref = cpu_backend.norm_linear(x.float(), norm_w, 1e-5, weight, silu=silu)
    assert rel_err(got, ref) <= TOL
    with backend_settings(tma_backend, gemv_tma="off"):
        old, old_names = _run(tma_backend, x, w, norm_w=norm_w, silu=silu)
    assert old_names == ["gemv"] and rel_err(got, old) <= GEMV_TOL


def test_swiglu_unfolded(tma_backend, cpu_backend):
    """SwiGLU without a folded norm (rms_norm, then gemv_tma's SILU build)."""
    n, k = 2 * 3000, 4096
    weight, x, norm_w, _ = _case(n, k, 17, silu=True, norm=True)
    w = tma_backend.prepare_linear(weight, None, swiglu=True)
    with launched_kernels(tma_backend) as names:
        got = tma_backend.norm_linear(x.cuda(), tma_backend.prepare_norm(norm_w), 1e-5, w, silu=True)
    assert names[-1] == "gemv_tma" and got.shape == (1, n // 2)
    assert rel_err(got, cpu_backend.norm_linear(x.float(), norm_w, 1e-5, weight, silu=True)) <= TOL


@pytest.mark.parametrize("ring", [(8, 1), (16, 2), (24, 4)])
def test_ring_and_grid_do_not_change_results(tma_backend, ring):
    """Every output is its spans' fixed-order sum: the same bits for any ring (stages x 2 KB spans: 8 x 2 KB,
    16 x 4 KB, 24 x 8 KB) and any grid (7 blocks here, 132 on the H200)."""
    weight, x, _, _ = _case(3000, 4096, 5)
    w = tma_backend.prepare_linear(weight)
    base, names = _run(tma_backend, x, w)
    with backend_settings(tma_backend, gemv_tma_ring=ring, num_sms=7):
        got, small_names = _run(tma_backend, x, w)
    assert names == small_names == ["gemv_tma"] and torch.equal(got, base)


@pytest.mark.parametrize("silu", [False, True])
def test_two_blocks_per_sm_build_is_bit_identical(tma_backend, silu):
    """VOLTSERVE_GEMV_TMA_BLOCKS=2 (registers capped for two blocks an SM, smem sized for two) with an 8 x 8 KB
    ring: the same products in the same order, so the same bits as the default build, folded norm and SwiGLU
    included, and with a residual."""
    weight, x, norm_w, res = _case(6144, 4096, 31 + silu, silu=silu, norm=True)
    with backend_settings(tma_backend, norm_fold="on"):
        w = tma_backend.prepare_linear(weight, None, swiglu=silu, norm=norm_w)
    base, _ = _run(tma_backend, x, w, norm_w=norm_w, silu=silu)
    plain = tma_backend.prepare_linear(weight[:3000])
    base_res, _ = _run(tma_backend, x, plain, residual=res[:, :3000])
    with backend_settings(tma_backend, gemv_tma_ring=(8, 4), gemv_tma_blocks=2):
        got, names = _run(tma_backend, x, w, norm_w=norm_w, silu=silu)
        got_res, res_names = _run(tma_backend, x, plain, residual=res[:, :3000])
    assert names == res_names == ["gemv_tma"] and torch.equal(got, base) and torch.equal(got_res, base_res)
    # two blocks of this build and smem are resident on an SM at once
    n_out = 3072 if silu else 6144
    _, smem = kernels_tma.gemv_tma_plan(n_out, 4096, silu, tma_backend.num_sms, (8, 4))
    smem = ring_block_smem(tma_backend, smem, 2)  # what the launcher asks for
    spec = kernels_tma.gemv_tma_spec(silu, True, 2)
    assert tma_backend._occupancy("gemv_tma", "gemv_tma", spec, smem, kernels_tma.GEMV_TMA_THREADS) == 2


def test_nan_row_stays_in_its_output(tma_backend):
    """A NaN weight poisons its own output only (no cross-row leakage through the partials)."""
    weight, x, _, _ = _case(512, 2048, 9)
    weight[100, 7] = float("nan")
    got = tma_backend.linear(x.cuda(), tma_backend.prepare_linear(weight)).float().cpu()
    assert torch.isnan(got[0, 100]) and torch.isfinite(torch.cat([got[0, :100], got[0, 101:]])).all()


def test_graph_replay_equals_eager(tma_backend):
    """Captured in a CUDA graph (PDL launch, mbarriers re-initialised per launch) = eager on new inputs."""
    weight, x, _, res = _case(4096, 4096, 21)
    w = tma_backend.prepare_linear(weight)
    xd, rd = x.cuda(), res.cuda()

    def step():
        return [tma_backend.linear(xd, w, residual=rd)]

    def change():
        xd.copy_(torch.randn_like(xd, dtype=torch.float32).half())
        rd.mul_(-1)

    assert_replay_equals_eager(tma_backend, step, change)


def test_folded_rule(cuda_backend):
    """VOLTSERVE_GEMV_TMA=folded (the default): folded-norm fp16 weights of >= GEMV_TMA_MIN_BYTES at one row, not
    SwiGLU pairs, not unfolded weights; "off" keeps gemv."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    if cuda_backend.loader.arch < 90:
        pytest.skip("gemv_tma needs SM90+")
    norm = torch.rand(4096) + 0.5
    with backend_settings(cuda_backend, gemv_kernel="auto", gemv_tma="folded", norm_fold="on"):
        folded = cuda_backend.prepare_linear(torch.zeros(1024, 4096), norm=norm)  # 8 MB
        pair = cuda_backend.prepare_linear(torch.zeros(2048, 4096), swiglu=True, norm=norm)
        plain = cuda_backend.prepare_linear(torch.zeros(1024, 4096))
        small = cuda_backend.prepare_linear(torch.zeros(256, 4096), norm=norm)  # 2 MB
        assert gemv_kernel_name(cuda_backend, folded, 1) == "gemv_tma"
        assert gemv_kernel_name(cuda_backend, pair, 1, silu=True) == "gemv"
        assert gemv_kernel_name(cuda_backend, plain, 1) == "gemv"
        assert gemv_kernel_name(cuda_backend, small, 1) == "gemv"
        assert gemv_kernel_name(cuda_backend, folded, 2) != "gemv_tma"
    with backend_settings(cuda_backend, gemv_kernel="auto", gemv_tma="off"):
        assert gemv_kernel_name(cuda_backend, folded, 1) == "gemv"
