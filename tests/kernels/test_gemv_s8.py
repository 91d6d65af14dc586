"""gemv_s8 (ptx/gemv_s8.cu): decode GEMV on repacked Q4_0 / Q4_1 / Q8_0 rows through int8 MMAs, x quantized per
32 elements like llama.cpp's Q8_1.

Bounds (max |got - ref| / max |ref|):
  - EMU_TOL = 1e-3 against `kutils.s8_reference` (the same int8 x, exact integer block sums in fp64): what is
    left is the kernel's fp32 accumulation and fp16 output rounding (<= 4.9e-4), so a wrong fragment, slot or
    scale shows as an O(1) error.
  - S8_TOL = 1.5e-2 against CpuBackend's fp32 product with unquantized x: x's 8-bit rounding (~0.4% of each
    block's max per element) measured 0.37-0.68% on these shapes on the CPU; 2e-2 where the fused RMSNorm and
    SwiGLU compound it (silu(gate) * up carries both products' errors).
"""

import pytest
import torch
from tests.kernels.kutils import (assert_replay_equals_eager, backend_settings, launched_builds, rel_err,
                                  repacked_weight, s8_reference)

pytestmark = pytest.mark.gpu
EMU_TOL = 1e-3
S8_TOL = 1.5e-2
FORMATS = ["Q4_0", "Q4_1", "Q8_0"]


@pytest.fixture(params=["block", "launch", "auto"])
def s8_backend(request, cuda_backend):
    """The backend storing quant weights repacked and routing every launch that fits to gemv_s8 ("on": the
    engine's "auto" takes Q4_0 / Q4_1 only, gemv_int8.gemv_s8_ok; one-row calls too: "mma", not gemv_s8w, which
    tests/kernels/test_gemv_s8w.py covers), with x quantized by every
    block ("block"), once per launch by quantize_s8 ("launch") or as the engine picks ("auto": per block at one
    row, per launch from two, so 9 rows are a launch of each). 8-warp blocks throughout (the bit-for-bit
    comparisons across row counts and x modes hold within one block shape); test_wide_block_where_one_block_fits
    takes the 16-warp block."""
    if cuda_backend.loader.arch < 80:
        pytest.skip("gemv_s8 is SM80+ (int8 mma.m16n8k32)")
    with backend_settings(cuda_backend, gemv_kernel="auto", quant_repack="on", gemv_s8="on",
                          gemv_s8_grid="persistent", gemv_s8_x=request.param, gemv_s8_m1="mma",
                          gemv_s8_tiles="auto", gemv_s8_rows="auto", quant_gemv_rows="auto", gemv_s8_warps="8"):
        yield cuda_backend


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("nk", [(4096, 4096), (1024, 14336), (45, 256), (70, 768)])
def test_gemv(s8_backend, cpu_backend, fmt, nk):
    """m = 1..8 (m = 1 is its own build, S8_M1), partial tiles (45, 70 rows), k ranges of one load group
    (256: one block per warp), 9 rows (one S8_NCOL = 2 launch where x is quantized per launch, else launches of
    8 and 1); every m's rows equal the m = 8 launch's bit for bit."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    n, k = nk
    quant, weight, lin = repacked_weight(s8_backend, fmt, n, k, n + k)
    for m in (1, 2, 8):
        assert gemv_kernel_name(s8_backend, lin, m) == "gemv_s8"
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(k)).half()
    full = s8_backend.linear(x.cuda(), lin)
    assert rel_err(full, s8_reference(x, quant)) <= EMU_TOL
    assert rel_err(full, cpu_backend.linear(x.float(), weight)) <= S8_TOL
    for m in (1, 2, 5):
        got = s8_backend.linear(x[:m].cuda(), lin)
        assert torch.equal(got, full[:m]), m
    twice = s8_backend.linear(torch.cat([x, x[:1]]).cuda(), lin)  # 9 rows
    assert torch.equal(twice[:8], full) and torch.equal(twice[8:], full[:1])


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_and_large_blocks(s8_backend, fmt):
    """An all-zero x block (d = 0: no NaN from 0 / 0) and blocks of very different magnitudes (each block has its
    own scale) in one row."""
    k, n = 1024, 64
    quant, _, lin = repacked_weight(s8_backend, fmt, n, k, 11)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(12)).half()
    x[:, 64:96] = 0
    x[0, 96:128] *= 1000
    x[1, 128:160] *= 1e-3
    got = s8_backend.linear(x.cuda(), lin)
    assert torch.isfinite(got.float()).all()
    assert rel_err(got, s8_reference(x, quant)) <= EMU_TOL


def test_nan_in_x_reaches_y(s8_backend):
    """A NaN in x makes its row's outputs NaN (as gemv_mma's fp16 products do), not a silent 0 from the int8
    rounding; the other rows stay finite."""
    quant, _, lin = repacked_weight(s8_backend, "Q4_1", 64, 512, 13)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(14)).half()
    x[1, 100] = float("nan")
    got = s8_backend.linear(x.cuda(), lin).float().cpu()
    assert torch.isnan(got[1]).all() and torch.isfinite(got[0]).all()
    assert rel_err(got[:1], s8_reference(x[:1], quant)) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_norm_swiglu_residual(s8_backend, cpu_backend, fmt):
    """The decoder block's fusions: RMSNorm + [gate; up] + SwiGLU at m = 1 and 8 (the one-pass 1/rms build), and
    a product + residual."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    k, inner = 2048, 3 * 32 + 5
    quant, weight, lin = repacked_weight(s8_backend, fmt, 2 * inner, k, 7)
    assert gemv_kernel_name(s8_backend, lin, 1, norm=True, silu=True) == "gemv_s8"
    gen = torch.Generator().manual_seed(8)
    norm = torch.rand(k, generator=gen) + 0.5
    nd = s8_backend.prepare_norm(norm)
    for m in (1, 8):
        x = torch.randn(m, k, generator=gen).half()
        got = s8_backend.norm_linear(x.cuda(), nd, 1e-5, lin, silu=True)
        ref = cpu_backend.norm_linear(x.float(), norm, 1e-5, weight, silu=True)
        assert got.shape == (m, inner) and rel_err(got, ref) <= 2e-2, m
        normed = s8_backend.rms_norm(x.cuda(), nd, 1e-5)[0]
        plain = s8_backend.linear(normed, lin)
        assert rel_err(s8_backend.norm_linear(x.cuda(), nd, 1e-5, lin), plain) <= EMU_TOL, m
        res = torch.randn(m, 2 * inner, generator=gen).half()
        got = s8_backend.linear(x.cuda(), lin, residual=res.cuda())
        assert rel_err(got, s8_reference(x, quant) + res.double()) <= EMU_TOL, m


def test_choices_pin_gemv_mma(s8_backend, cpu_backend):
    """gemv_s8 "off", or a forced gemv_kernel ("mma", "mma884"), run gemv_mma on the same repacked rows; "on"
    takes gemv_s8 even then. Both agree with the fp32 reference within gemv_s8's bound."""
    from voltserve.backends.cuda.linear import gemv_kernel_name

    quant, weight, lin = repacked_weight(s8_backend, "Q4_1", 256, 4096, 5)
    x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(6)).half()
    s8 = s8_backend.linear(x.cuda(), lin)
    s8_backend.gemv_s8 = "off"
    assert gemv_kernel_name(s8_backend, lin, 4) == "gemv_mma"
    mma = s8_backend.linear(x.cuda(), lin)
    s8_backend.gemv_s8 = "auto"
    assert gemv_kernel_name(s8_backend, lin, 1) == "gemv_s8" and gemv_kernel_name(s8_backend, lin, 4) == "gemv_s8"
    s8_backend.gemv_kernel = "mma"
    assert gemv_kernel_name(s8_backend, lin, 1) == "gemv_mma"
    s8_backend.gemv_s8 = "on"
    assert gemv_kernel_name(s8_backend, lin, 4) == "gemv_s8"
    assert torch.equal(s8_backend.linear(x.cuda(), lin), s8)
    ref = cpu_backend.linear(x.float(), weight)
    assert rel_err(mma, ref) <= 3e-3 and rel_err(s8, ref) <= S8_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_persistent_grid_equals_full(s8_backend, fmt):
    """More tiles than the GPU holds blocks at once (20,000 rows: 625 tiles; SwiGLU 1,250): the persistent grid's
    blocks loop over tiles with x quantized once, bit for bit the one-block-per-tile grid's outputs."""
    from voltserve.backends.cuda.linear import launch_linear

    k, n = 512, 20000
    quant, _, lin = repacked_weight(s8_backend, fmt, n, k, 21)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(22)).half().cuda()
    res = torch.randn(3, n, generator=torch.Generator().manual_seed(23)).half().cuda()
    got = {}
    for grid in ("persistent", "full"):
        s8_backend.gemv_s8_grid = grid
        got[grid] = [s8_backend.linear(x[:m], lin, residual=res[:m]) for m in (1, 3)]
        got[grid].append(launch_linear(s8_backend, x[:1], lin, silu=True))
    for a, b in zip(got["persistent"], got["full"]):
        assert torch.equal(a, b)
    ref = s8_reference(x.cpu(), quant)
    assert rel_err(got["persistent"][1].double().cpu() - res.double().cpu(), ref) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_16_row_tiles_equal_32(s8_backend, fmt):
    """gemv_s8's 16-row tile build (gemv_int8.gemv_s8_tile_rows: 3 blocks an SM where x fits) gives the 32-row
    build's y bit for bit (each row's k split over the warps and the reduction order are the same): 2-8 rows,
    partial tiles (45 rows), a persistent grid looping over tiles (20,000 rows), the fused RMSNorm, SwiGLU and
    residual; and both stay within EMU_TOL of the emulation."""
    from voltserve.backends.cuda.linear import launch_linear

    for n, k in ((45, 768), (20000, 512), (1024, 4096)):
        quant, _, lin = repacked_weight(s8_backend, fmt, n, k, n + 51)
        gen = torch.Generator().manual_seed(n + 52)
        x = torch.randn(8, k, generator=gen).half()
        res = torch.randn(8, n, generator=gen).half().cuda()
        nd = s8_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)
        got = {}
        for tiles in ("16", "32"):
            s8_backend.gemv_s8_tiles = tiles
            with launched_builds(s8_backend) as builds:
                got[tiles] = [s8_backend.linear(x[:m].cuda(), lin, residual=res[:m]) for m in (2, 5, 8)]
                got[tiles].append(launch_linear(s8_backend, x[:3].cuda(), lin, norm_weight=nd, eps=1e-5,
                                                silu=n % 2 == 0))
            ran = [spec.get("GM_TILE_ROWS", 32) for kernel, spec in builds if kernel == "gemv_s8"]
            assert ran == [int(tiles)] * 4, (tiles, ran)  # the knob picked the build
        for a, b in zip(got["16"], got["32"]):
            assert torch.equal(a, b), (n, k)
        assert rel_err(got["16"][2].double().cpu() - res.double().cpu(), s8_reference(x, quant)) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_early_load_groups_do_not_change_y(s8_backend, fmt):
    """gemv_s8's early loads (gemv_int8.gemv_s8_launch_spec; VOLTSERVE_GEMV_S8_PRELOAD auto / 1 / 2: one or both
    register buffers issued before the PDL wait and for a persistent block's next tile) give the same y bit for
    bit: one tile a block (1,024 rows), several (20,000 rows over the held blocks), 16 rows a launch (S8_NCOL =
    2), with the fused RMSNorm, SwiGLU and residual; the knob picked the build."""
    from voltserve.backends.cuda.linear import launch_linear

    for n, k in ((20000, 512), (1024, 4096)):
        quant, _, lin = repacked_weight(s8_backend, fmt, n, k, n + 61)
        gen = torch.Generator().manual_seed(n + 62)
        x = torch.randn(16, k, generator=gen).half()
        res = torch.randn(16, n, generator=gen).half().cuda()
        nd = s8_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)
        got = {}
        for choice in ("auto", "1", "2"):
            s8_backend.gemv_s8_preload = choice
            with launched_builds(s8_backend) as builds:
                got[choice] = [s8_backend.linear(x[:m].cuda(), lin, residual=res[:m]) for m in (2, 8, 16)]
                got[choice].append(launch_linear(s8_backend, x[:3].cuda(), lin, norm_weight=nd, eps=1e-5, silu=True))
            specs = [spec for kernel, spec in builds if kernel == "gemv_s8"]
            assert len(specs) >= 4  # 16 rows with x quantized in every block: two 8-row launches
            for spec in specs:  # n = 1,024: one tile a block (auto: one group, as "1"); 20,000: several
                one_tile = {"S8_NEXT_GROUPS": 1} if n == 1024 and spec.get("S8_XG") else {}
                want = {"auto": one_tile, "1": {"S8_NEXT_GROUPS": 1},
                        "2": {"S8_WAIT_GROUPS": 2} if spec.get("S8_XG") else {}}[choice]
                assert {key: spec[key] for key in ("S8_NEXT_GROUPS", "S8_WAIT_GROUPS") if key in spec} == want
        s8_backend.gemv_s8_preload = "auto"
        for choice in ("1", "2"):
            for a, b in zip(got["auto"], got[choice]):
                assert torch.equal(a, b), (n, k, choice)
        assert rel_err(got["auto"][1].double().cpu() - res[:8].double().cpu(), s8_reference(x[:8], quant)) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
def test_x_copied_per_warp_gives_the_same_y(s8_backend, fmt):
    """VOLTSERVE_GEMV_S8_XCOPY=warp (S8_XWARP: each warp copies its own k range of x, in two cp.async groups, no
    block barrier) gives the block copy's y bit for bit: one tile a block (1,024 x 4,096), a persistent block
    looping over tiles with several load groups a warp (20,000 x 4,096: the second half's wait on the first tile,
    a no-op after), one load group a warp (20,000 x 512, 45 x 256: the second group empty), 1 (S8_M1 where x is
    quantized per launch) / 2 / 8 / 16 / 32 rows (S8_NCOL 1 / 2 / 4), the fused RMSNorm, SwiGLU and residual; at
    k = 14,336 the 16-warp block (8 rows) and the S8_KSPLIT launches (24 rows, where the GPU splits them).
    "split" (S8_XWARP on S8_KSPLIT launches only) too. The knob picked the build: every gemv_s8 launch with x
    copied in has S8_XWARP under "warp" (under "split" those with S8_KSPLIT), no other has."""
    from voltserve.backends.cuda.linear import launch_linear

    if s8_backend.gemv_s8_x == "block":
        pytest.skip("S8_XWARP copies x quantized per launch")
    cases = [(1024, 4096, (1, 2, 8, 16, 32)), (20000, 4096, (2, 16)), (20000, 512, (2, 16)), (45, 256, (3, 32)),
             (256, 14336, (8, 24))]
    for n, k, row_counts in cases:
        quant, _, lin = repacked_weight(s8_backend, fmt, n, k, n + 91)
        gen = torch.Generator().manual_seed(n + k + 92)
        x = torch.randn(32, k, generator=gen).half().cuda()
        res = torch.randn(32, n, generator=gen).half().cuda()
        nd = s8_backend.prepare_norm((torch.rand(k, generator=gen) + 0.5) * 0.05)  # silu(gate) * up inside fp16
        got = {}
        for xcopy in ("block", "warp", "split"):
            with backend_settings(s8_backend, gemv_s8_xcopy=xcopy, gemv_s8_warps="auto" if k == 14336 else "8"):
                with launched_builds(s8_backend) as builds:
                    got[xcopy] = [s8_backend.linear(x[:m], lin, residual=res[:m]) for m in row_counts]
                    got[xcopy].append(launch_linear(s8_backend, x[:3], lin, norm_weight=nd, eps=1e-5, silu=True))
            specs = [spec for kernel, spec in builds if kernel == "gemv_s8"]
            picked = {"block": False, "warp": True, "split": None}[xcopy]
            assert specs and all(
                spec.get("S8_XWARP") == (1 if spec.get("S8_XG") and (picked or (picked is None and
                                                                                  spec.get("S8_KSPLIT"))) else None)
                for spec in specs), (xcopy, specs)
        for xcopy in ("warp", "split"):
            for m, a, b in zip(row_counts + (3,), got["block"], got[xcopy]):
                assert torch.equal(a, b), (n, k, m, xcopy)
        m = row_counts[1]
        want = s8_reference(x[:m].cpu(), quant) + res[:m].double().cpu()
        assert rel_err(got["warp"][1], want) <= EMU_TOL, (n, k)
        assert torch.isfinite(got["warp"][-1].float()).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_wide_block_where_one_block_fits(s8_backend, fmt):
    """2-8 rows whose x copy leaves room for one 8-warp block an SM (k = 14,336 at 8 rows: 143 KB) run 16 warps a
    block (gemv_int8.gemv_s8_wide_block, VOLTSERVE_GEMV_S8_WARPS=auto): within EMU_TOL of the emulation, with the
    residual and SwiGLU (x scaled so that no Q8_0 gate * up overflows fp16); "8" keeps the 8-warp build, whose y
    differs only in the fp32 order of the warps' sums."""
    from voltserve.backends.cuda.linear import launch_linear

    if s8_backend.gemv_s8_x == "block":
        pytest.skip("the 16-warp block takes x quantized per launch")
    k = 14336
    quant, _, lin = repacked_weight(s8_backend, fmt, 512, k, 71)
    gen = torch.Generator().manual_seed(72)
    x = torch.randn(8, k, generator=gen).half()
    res = torch.randn(8, 512, generator=gen).half().cuda()
    got = {}
    for warps in ("auto", "8"):
        s8_backend.gemv_s8_warps = warps
        with launched_builds(s8_backend) as builds:
            got[warps] = (s8_backend.linear(x.cuda(), lin, residual=res),
                          launch_linear(s8_backend, (x[:7].float() * 0.05).half().cuda(), lin, silu=True))
        ran = [spec.get("GM_WARPS", 8) for kernel, spec in builds if kernel == "gemv_s8"]
        assert ran == [16 if warps == "auto" else 8] * 2, (warps, builds)
    s8_backend.gemv_s8_warps = "8"
    y = got["auto"][0].double().cpu() - res.double().cpu()
    assert rel_err(y, s8_reference(x, quant)) <= EMU_TOL
    assert rel_err(got["auto"][1].double().cpu(), got["8"][1].double().cpu()) <= 1e-3


def _eight_row_slices(m: int) -> list[tuple[int, int]]:
    """[begin, end) row slices of m rows as launch_gemv_s8 chunks 8-row launches: 8 rows each, a 1-row remainder
    with the slice before it (that call then runs its own 8 + 1 chunks)."""
    starts = list(range(0, m, 8))
    if len(starts) > 1 and m - starts[-1] == 1:
        starts.pop()
    return list(zip(starts, starts[1:] + [m]))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("top,ncol", [(16, 2), (32, 4)])
def test_wide_launches_equal_8_row_launches(s8_backend, fmt, top, ncol):
    """gemv_s8's S8_NCOL = 2 / 4 builds (9-16 / 17-32 x rows in one launch, gemv_int8.gemv_s8_launch_rows) give
    what launches of <= 8 rows give, bit for bit (same int32 block sums, same scaling and reduction order): three
    row counts up to `top`, partial tiles (45 rows), a persistent grid looping over tiles (20,000 rows), the
    residual, the fused RMSNorm with SwiGLU; within EMU_TOL of the emulation (x of 32 rows fits the shared memory
    whole at these widths on the H200; the k split of wider rows: test_k_split_launches)."""
    from voltserve.backends.cuda.gemv_int8 import gemv_s8_fits
    from voltserve.backends.cuda.linear import launch_linear

    if s8_backend.gemv_s8_x == "block":
        pytest.skip("the wide builds read x quantized per launch")
    counts = (top // 2 + 1, top * 3 // 4, top)
    for n, k in ((45, 768), (20000, 512), (1024, 4096)):
        if not gemv_s8_fits(s8_backend, top, k):
            pytest.skip(f"x of {top} rows of {k} does not fit this GPU's shared memory")
        quant, _, lin = repacked_weight(s8_backend, fmt, n, k, n + 61)
        gen = torch.Generator().manual_seed(n + 62)
        x = torch.randn(top, k, generator=gen).half().cuda()
        res = torch.randn(top, n, generator=gen).half().cuda()
        nd = s8_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)
        got = {}
        for rows in ("auto", "8"):
            s8_backend.gemv_s8_rows = "16" if rows == "auto" and top == 16 else rows
            # under "8" no call of > 16 rows runs gemv_s8 (linear.gemv_max_rows): the same 8-row launches as
            # calls of <= 9 rows each (a 1-row remainder joins the slice before it, as launch_gemv_s8 chunks)
            pieces = (lambda m: [(0, m)]) if rows == "auto" else _eight_row_slices
            with launched_builds(s8_backend) as builds:
                got[rows] = [torch.cat([s8_backend.linear(x[a:b], lin, residual=res[a:b]) for a, b in pieces(m)])
                             for m in counts]
                got[rows].append(torch.cat([launch_linear(s8_backend, x[a:b], lin, norm_weight=nd, eps=1e-5,
                                                          silu=n % 2 == 0) for a, b in pieces(counts[0] + 2)]))
            ran = [spec.get("S8_NCOL", 1) for kernel, spec in builds if kernel == "gemv_s8"]
            launches_8 = sum(-(-m // 8) for m in counts) + -(-(counts[0] + 2) // 8)
            assert ran == ([ncol] * 4 if rows == "auto" else [1] * launches_8), (rows, k, ran)
        s8_backend.gemv_s8_rows = "auto"
        for a, b in zip(got["auto"], got["8"]):
            assert torch.equal(a, b), (n, k)
        assert rel_err(got["auto"][2] - res, s8_reference(x.cpu(), quant)) <= EMU_TOL


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,ncol,splits", [(16, 2, 2), (20, 4, 2), (32, 4, 3)])
def test_k_split_launches(s8_backend, fmt, rows, ncol, splits):
    """16 / 20 / 32 x rows whose x does not fit the shared memory whole (k = 14,336: 287 / 359 / 574 KB) run as
    S8_KSPLIT launches (S8_NCOL 2 / 4 / 4; 20 rows: a partial last 8-row group) of a half / half / third of the k
    each, each handing its fp32 sums on through a workspace:
    within EMU_TOL of the emulation and within one fp16 rounding of the 8-row launches (the same products, summed
    in another order); rows of two split calls (3/4 of the rows, and all) equal bit for bit; partial tiles (45
    rows), a persistent grid looping over tiles (8,192 rows: 256 tiles, one block an SM; compared with the 8-row
    launches only, the fp64 emulation of 117M weights being too large), the residual (added once, by the last
    launch); graph replay equals eager."""
    from voltserve.backends.cuda.gemv_int8 import gemv_s8_k_ranges, gemv_s8_launch_rows

    if s8_backend.gemv_s8_x == "block":
        pytest.skip("16-row launches need x quantized per launch")
    k = 14336
    if len(gemv_s8_k_ranges(s8_backend, fmt, rows, k) or ()) != splits or gemv_s8_launch_rows(
            s8_backend, fmt, k) < rows:
        pytest.skip(f"needs a GPU where {rows} rows of x fit in {splits} k ranges, not whole (H200: 227 KB)")
    for n in (45, 8192):
        quant, _, lin = repacked_weight(s8_backend, fmt, n, k, n + 81)
        gen = torch.Generator().manual_seed(n + 82)
        x = torch.randn(rows, k, generator=gen).half().cuda()
        res = torch.randn(rows, n, generator=gen).half().cuda()
        with launched_builds(s8_backend) as builds:
            got = s8_backend.linear(x, lin, residual=res)
        split = [spec for kernel, spec in builds if kernel == "gemv_s8"]
        assert len(split) == splits and all(spec.get("S8_KSPLIT") == 1 and spec["S8_NCOL"] == ncol
                                            for spec in split)
        if n < 1000:
            assert rel_err(got - res, s8_reference(x.cpu(), quant)) <= EMU_TOL
        eight = torch.cat([s8_backend.linear(x[a:b], lin, residual=res[a:b]) for a, b in _eight_row_slices(rows)])
        assert rel_err(got, eight) <= 1e-3
        part = rows * 3 // 4
        assert torch.equal(s8_backend.linear(x[:part], lin, residual=res[:part]), got[:part])
        assert_replay_equals_eager(s8_backend, lambda: [s8_backend.linear(x, lin, residual=res)],
                                   lambda: x.copy_(torch.randn(rows, k, generator=gen).half()))


def test_gemv_rows_past_16(s8_backend, cpu_backend):
    """On SM90+ calls of 17..quant_gemv_max_rows x rows on repacked rows run gemv_s8 launches (one S8_NCOL = 4
    launch for 24 rows at k = 4,096), whose rows equal those of smaller calls bit for bit; one row more takes the
    GEMM."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.linear import gemv_max_rows

    if s8_backend.gemv_s8_x == "block":
        pytest.skip("16-row launches need x quantized per launch")
    quant, weight, lin = repacked_weight(s8_backend, "Q4_1", 256, 4096, 71)
    top = gemv_max_rows(s8_backend, lin)
    assert top == (kernels.QUANT_GEMV_MAX_ROWS_SM90["Q4_1"] if s8_backend.loader.compile_arch >= 90 else 16)
    x = torch.randn(top + 1, 4096, generator=torch.Generator().manual_seed(72)).half().cuda()
    with launched_builds(s8_backend) as builds:
        got = s8_backend.linear(x[:24], lin)
    if top >= 24:
        assert [(k, s.get("S8_NCOL", 1)) for k, s in builds if k == "gemv_s8"] == [("gemv_s8", 4)]
        assert torch.equal(got[16:], s8_backend.linear(x[16:24], lin))
        assert torch.equal(got[:16], s8_backend.linear(x[:16], lin))
    assert rel_err(got, s8_reference(x[:24].cpu(), quant)) <= EMU_TOL
    with launched_builds(s8_backend) as builds:
        past = s8_backend.linear(x, lin)
    assert not any(k == "gemv_s8" for k, _ in builds)
    # the GEMM multiplies fp16 x (no 8-bit rounding) with fp32 accumulation: fp16 output rounding is what is left
    assert rel_err(past, cpu_backend.linear(x.float().cpu(), weight)) <= 5e-3


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [4096, 14336, 768])
def test_x_per_launch_equals_per_block(s8_backend, fmt, k):
    """x quantized once by quantize_s8 equals every block's own quantization bit for bit (same values, same
    order), with the fused RMSNorm and SwiGLU too, at 1, 2 and 8 rows. The widths: quantize_s8's 1 / rms pass
    (4 loads a thread in flight) in one batch, in two with a partial second (14,336), and with idle threads
    (768)."""
    from voltserve.backends.cuda.linear import launch_linear

    n = 512
    _, _, lin = repacked_weight(s8_backend, fmt, n, k, 31)
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(8, k, generator=gen).half().cuda()
    nd = s8_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)
    got = {}
    for mode in ("block", "launch"):
        s8_backend.gemv_s8_x = mode
        got[mode] = [launch_linear(s8_backend, x[:m], lin, norm_weight=nd, eps=1e-5, silu=silu)
                     for m in (1, 2, 8) for silu in (False, True)]
    for a, b in zip(got["block"], got["launch"]):
        assert torch.equal(a, b)


def test_graph_replay_equals_eager(s8_backend):
    """gemv_s8 captured in a CUDA graph (quantize_s8's workspace from torch's graph pool when x is quantized per
    launch) replays bit for bit what eager launches compute, at 1, 2, 8 and 9 rows, fused norm + SwiGLU too."""
    from voltserve.backends.cuda.linear import launch_linear

    k, n = 4096, 256
    _, _, lin = repacked_weight(s8_backend, "Q4_1", n, k, 41)
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(9, k, generator=gen).half().cuda()
    nd = s8_backend.prepare_norm(torch.rand(k, generator=gen) + 0.5)

    def step():
        return [launch_linear(s8_backend, x[:m], lin, norm_weight=nd if m % 2 else None, eps=1e-5, silu=m == 2)
                for m in (1, 2, 8, 9)]

    assert_replay_equals_eager(s8_backend, step, lambda: x.copy_(torch.randn(9, k, generator=gen).half()))
