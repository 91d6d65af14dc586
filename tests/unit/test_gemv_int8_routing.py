"""Which decode GEMV kernel a launch on quant rows runs (backends/cuda/linear.py, gemv_int8.py, gemv_tma.py): the
load-time repack of Q4_0 / Q4_1 / Q8_0 rows and the int8 kernels on them (gemv_s8 for 1-32 x rows a launch, gemv_s8w
for one, gemv_tma_s8 on request), their builds and shared-memory fits. Pure Python, no GPU.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.unit.gemv_fakes import fake_backend, fake_linear, recording_backend, repacked_linear
from voltserve.backends.cuda.linear import gemv_kernel_name


def test_repack_policy_and_routing():
    """Which quant weights are stored repacked (linear.repack_wanted) and that they always run gemv_s8 or gemv_mma
    (never gemv_mma_sb, gemv_q or gemv, which read GGUF blocks), whatever `gemv_kernel` asks: gemv_s8 under
    "auto" on SM80+, gemv_mma under the forced choices or with gemv_s8 off."""
    from voltserve.backends.cuda.gemv_int8 import GEMV_S8_AUTO_FORMATS
    from voltserve.backends.cuda.linear import repack_wanted

    big, small = 4096 * 4096 // 2, 1 << 20
    assert repack_wanted("auto", 90, "Q4_1", 4096, big) and repack_wanted("auto", 80, "Q8_0", 4096, big)
    assert not repack_wanted("auto", 90, "Q4_1", 4096, small)      # launch-bound: stays GGUF
    assert not repack_wanted("auto", 70, "Q4_1", 4096, big)        # SM70 / Turing: never (unmeasured; spills)
    assert not repack_wanted("on", 70, "Q4_1", 4096, big) and not repack_wanted("on", 75, "Q4_1", 4096, big)
    assert repack_wanted("on", 80, "Q4_1", 4096, small)
    assert not repack_wanted("auto", 90, "Q4_1", 576, big)         # k % 256 != 0
    assert not repack_wanted("auto", 90, "F16", 4096, big) and not repack_wanted("off", 90, "Q4_0", 4096, big)
    assert not repack_wanted("auto", 90, "Q4_1", 4096, big, swiglu=True)  # the scalar gemv's SwiGLU is faster
    assert repack_wanted("on", 90, "Q4_1", 4096, big, swiglu=True)
    assert not repack_wanted("auto", 90, "Q8_0", 14336, big) and repack_wanted("on", 90, "Q8_0", 14336, big)
    assert repack_wanted("auto", 86, "Q8_0", 14336, big, superblocks=False)  # no gemv_mma_sb there to prefer
    # with gemv_s8: every Q4 weight of >= 4 MB, SwiGLU pairs too
    assert repack_wanted("auto", 90, "Q4_1", 4096, big, swiglu=True, s8=True)
    # Q8_0 too since session 11 (SwiGLU pairs, k = 14,336), not below 4 MB or SM80
    assert repack_wanted("auto", 90, "Q8_0", 14336, big, swiglu=True, s8=True)
    assert repack_wanted("auto", 80, "Q8_0", 4096, big, swiglu=True, s8=True)
    assert not repack_wanted("auto", 90, "Q8_0", 14336, small, s8=True)
    assert not repack_wanted("auto", 70, "Q8_0", 4096, big, s8=True)
    assert not repack_wanted("auto", 90, "Q4_1", 4096, small, s8=True)
    assert repack_wanted("auto", 90, "Q4_1", 16640, big, swiglu=True, s8=True)
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        w = repacked_linear(fmt, 4096, 4096)
        for arch in (80, 90):
            for choice in ("auto", "scalar", "mma"):
                for rows in (1, 3, 8):
                    s8 = choice == "auto" and fmt in GEMV_S8_AUTO_FORMATS
                    want = "gemv_s8" if s8 else "gemv_mma"
                    if choice == "auto" and rows == 1:
                        want = "gemv_s8w"  # every repacked format at one row (gemv_s8w_ok)
                    assert gemv_kernel_name(fake_backend(arch, choice), w, rows, silu=rows == 1) == want
                    off = fake_backend(arch, choice)
                    off.gemv_s8 = "off"
                    assert gemv_kernel_name(off, w, rows) == "gemv_mma"
        with pytest.raises(ValueError, match="16-byte aligned"):
            gemv_kernel_name(fake_backend(90), w, 1, vec_ok=0)


@pytest.mark.parametrize("arch,smem_kb,rows,k,takes", [
    (90, 227, 8, 14336, True),    # Llama-3-8B down_proj at 8 rows: 143 KB + the static 9 KB
    (86, 99, 8, 14336, False),    # SM86 / 89: 99 KB opt-in -> gemv_mma
    (86, 99, 4, 14336, True),     # 71 KB
    (86, 99, 8, 4096, True),
    (75, 64, 1, 4096, False),     # no int8 mma.m16n8k32 below SM80
])
def test_gemv_s8_fits(arch, smem_kb, rows, k, takes):
    """gemv_s8 keeps x quantized in shared memory (kernels.gemv_s8_smem_bytes): launches whose copy does not fit
    the device's opt-in limit run gemv_mma; "on" forces it under any gemv_kernel but never past the limit."""
    from voltserve.backends.cuda import kernels

    w = repacked_linear("Q4_1", 4096, k)
    be = fake_backend(arch, smem_kb=smem_kb)
    be.gemv_s8 = "on"
    assert (gemv_kernel_name(be, w, rows) == "gemv_s8") == takes
    be.gemv_s8 = "auto"  # Q4: every row count whose x fits
    assert (gemv_kernel_name(be, w, rows) == "gemv_s8") == takes
    q8 = repacked_linear("Q8_0", 4096, k)
    assert (gemv_kernel_name(be, q8, rows) == "gemv_s8") == takes  # Q8_0 as Q4 from 2 rows, gemv_s8w at 1
    assert gemv_kernel_name(be, q8, 1) == ("gemv_s8w" if arch >= 80 else "gemv_mma")
    forced = fake_backend(arch, "mma", smem_kb=smem_kb)
    forced.gemv_s8 = "on"
    assert (gemv_kernel_name(forced, w, rows) == "gemv_s8") == takes
    nb = k // 32
    assert kernels.gemv_s8_smem_bytes(1, k) == nb * 32 + 16 + nb * 8
    assert kernels.gemv_s8_smem_bytes(rows, k) == (rows * (nb * 32 + 16) + nb * 64 if rows > 1 else nb * 40 + 16)


def test_gemv_s8_specs_are_built():
    """Every gemv_s8 build a launch may ask for is compiled ahead of time (tools/build_ptx.py): S8_M1 for one row,
    the general build with and without the one-pass 1/rms; fp16 has none."""
    from voltserve.backends.cuda import kernels

    built = [spec for op, spec in kernels.engine_specializations() if op == "gemv_s8"]
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        for silu in (False, True):
            for rows in range(1, 9):
                for one_pass in (False, True):
                    for per_launch in (False, True):
                        assert kernels.gemv_s8_spec(fmt, silu, rows, one_pass, per_launch) in built
                        if rows > 1 and per_launch:  # gemv_int8.gemv_s8_tile_rows: 16-row tiles under auto
                            assert kernels.gemv_s8_spec(fmt, silu, rows, one_pass, per_launch, 16) in built
    # one row: gemv_s8w's block per format (kernels.GEMV_S8W_WARPS), 32 warps an SM
    assert kernels.gemv_s8_spec("Q4_1", False, 1, True) == {"WTYPE": 2, "SILU": 0, "S8_M1": 1, "S8W_WARPS": 16}
    assert kernels.gemv_s8_spec("Q8_0", True, 1) == {"WTYPE": kernels.WTYPES["Q8_0"], "SILU": 1, "S8_M1": 1,
                                                     "S8W_WARPS": 8, "S8W_OUT_SLOTS": kernels.GEMV_S8W_OUT_SLOTS}
    for rows in (1, 8):  # x quantized per launch: the norm is quantize_s8's, no one-pass build
        for silu in (False, True):
            assert kernels.gemv_s8_spec("Q4_0", silu, rows, True, True) in built
            assert kernels.gemv_s8_spec("Q4_0", silu, rows, True, True).get("GM_NORM_ONE_PASS") is None
    with pytest.raises(ValueError, match="quant weights"):
        kernels.gemv_s8_spec("F16", False, 1)
    for rows in range(9, kernels.GEMV_S8_MAX_ROWS + 1):  # gemv_int8.gemv_s8_launch_rows: x per launch only
        for silu in (False, True):
            assert kernels.gemv_s8_spec("Q4_1", silu, rows, True, True, 16) in built
    assert kernels.gemv_s8_spec("Q8_0", False, 12, False, True, 16) == {
        "WTYPE": 3, "SILU": 0, "S8_XG": 1, "GM_TILE_ROWS": 16, "GM_MIN_BLOCKS": 2, "S8_NCOL": 2}
    with pytest.raises(ValueError, match="per launch"):
        kernels.gemv_s8_spec("Q8_0", False, 9, tile_rows=16)
    with pytest.raises(ValueError, match="16-row tiles"):
        kernels.gemv_s8_spec("Q8_0", False, 9, x_per_launch=True)
    with pytest.raises(ValueError, match="1..32"):
        kernels.gemv_s8_spec("Q8_0", False, 33, x_per_launch=True, tile_rows=16)
    assert kernels.gemv_s8_spec("Q4_1", True, 17, False, True, 32) == {
        "WTYPE": 2, "SILU": 1, "GM_TILE_ROWS": 32, "GM_MIN_BLOCKS": 1, "S8_NCOL": 4, "S8_XG": 1}
    with pytest.raises(ValueError, match="per launch"):
        kernels.gemv_s8_spec("Q4_1", False, 20, tile_rows=32)

    for f in ("Q4_0", "Q4_1", "Q8_0"):  # k split (gemv_int8.gemv_s8_k_ranges): 16 / 32 rows, no SwiGLU, 32 or 16 tiles
        for tile in (32, 16):
            for rows in (16, 32):  # as gemv_int8.gemv_s8_launch_spec launches them: x copied per warp
                assert {**kernels.gemv_s8_spec(f, False, rows, False, True, tile, True), "S8_XWARP": 1} in built
    assert kernels.gemv_s8_spec("Q4_1", False, 12, False, True, 32, True) == {
        "WTYPE": 2, "SILU": 0, "GM_TILE_ROWS": 32, "GM_MIN_BLOCKS": 1, "S8_NCOL": 2, "S8_KSPLIT": 1, "S8_XG": 1}
    assert kernels.gemv_s8_spec("Q8_0", False, 17, False, True, 32, True) == {
        "WTYPE": 3, "SILU": 0, "GM_TILE_ROWS": 32, "GM_MIN_BLOCKS": 1, "S8_NCOL": 4, "S8_KSPLIT": 1, "S8_XG": 1}
    for rows, silu in ((8, False), (16, True), (32, True)):
        with pytest.raises(ValueError, match="k split"):
            kernels.gemv_s8_spec("Q4_1", silu, rows, False, True, 32, True)
    nb = 4096 // 32
    assert kernels.gemv_s8_smem_bytes(9, 4096) == 9 * (nb * 32 + 16) + nb * 8 * 16  # scales [nb][16]
    assert kernels.gemv_s8_smem_bytes(17, 4096) == 17 * (nb * 32 + 16) + nb * 8 * 32  # scales [nb][32]


def test_gemv_s8_tile_rows_rule_and_launch():
    """gemv_s8 takes its 16-row tile build (kernels.GEMV_S8_NARROW_TILE, 3 blocks an SM) from 2 x rows where x is
    quantized per launch (the per-block builds spill at its register cap) and 3 blocks' x copies fit an SM's
    shared memory (H200, 227 KB: k = 4,096 at every m, 14,336 at m = 2 only, not for Q8_0; A100, 163 KB: k =
    4,096; SM86, 99 KB: k = 4,096 at m <= 3), 32-row tiles elsewhere and always at one row (S8_M1); "32" / "16"
    force either from 2 rows. The launch's spec, tiles and grid follow (SwiGLU: half a tile's rows are outputs;
    the persistent grid caps at the resident blocks), per launch of a call of more than 8 rows."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.gemv_int8 import gemv_s8_tile_rows
    from voltserve.backends.cuda.linear import launch_linear

    h200, a100, sm86 = fake_backend(90), fake_backend(80, smem_kb=163), fake_backend(86, smem_kb=99)
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        assert [gemv_s8_tile_rows(h200, fmt, m, 4096, True) for m in (1, 2, 5, 8)] == [32, 16, 16, 16]
        assert [gemv_s8_tile_rows(h200, fmt, m, 4096, False) for m in (1, 2, 5, 8)] == [32, 32, 32, 32]
        wide = 32 if fmt == "Q8_0" else 16  # GEMV_S8_NARROW_MAX_K: Q8_0 measured slower there
        assert [gemv_s8_tile_rows(h200, fmt, m, 14336, True) for m in (1, 2, 3, 8)] == [32, wide, 32, 32]
        assert [gemv_s8_tile_rows(a100, fmt, m, k, True) for m, k in ((8, 4096), (2, 14336))] == [16, 32]
        assert [gemv_s8_tile_rows(sm86, fmt, m, 4096, True) for m in (2, 3, 4, 8)] == [16, 16, 32, 32]
    for choice in ("32", "16"):
        h200.gemv_s8_tiles = choice
        assert gemv_s8_tile_rows(h200, "Q8_0", 8, 14336, True) == int(choice)
        assert gemv_s8_tile_rows(h200, "Q4_1", 2, 4096, False) == int(choice)
        assert gemv_s8_tile_rows(h200, "Q4_1", 1, 4096, True) == 32  # one row: the S8_M1 build's tiles
    assert kernels.gemv_s8_spec("Q4_1", False, 8, False, True, 16) == {
        "WTYPE": 2, "SILU": 0, "S8_XG": 1, "GM_TILE_ROWS": 16, "GM_MIN_BLOCKS": 3}
    with pytest.raises(ValueError, match="tile_rows"):
        kernels.gemv_s8_spec("Q4_1", False, 8, tile_rows=8)

    x = torch.zeros(9, 4096, dtype=torch.float16)
    for n, tiles, silu, want_tile, want_grid in ((4096, "auto", False, 16, 256), (4096, "auto", True, 16, 256),
                                                 (4096, "32", False, 32, 128), (4096, "32", True, 32, 128),
                                                 (16384, "auto", False, 16, 264), (16384, "32", True, 32, 264)):
        w = repacked_linear("Q4_1", n, 4096)
        backend, launches = recording_backend(gemv_s8_tiles=tiles)  # _occupancy: 2 blocks an SM, 132 SMs
        y = launch_linear(backend, x[:8], w, silu=silu)
        assert [launch.kernel for launch in launches] == ["quantize_s8", "gemv_s8"] and y.shape == (8, n >> silu)
        s8 = launches[-1]
        assert s8.spec.get("GM_TILE_ROWS", 32) == want_tile and s8.grid[0] == want_grid
        assert s8.block[0] == 32 * kernels.GEMV_MMA_WARPS and s8.smem == kernels.gemv_s8_smem_bytes(8, 4096)
    backend, launches = recording_backend(gemv_s8_rows="8")  # 9 rows: launches of 8 (16-row tiles) and 1 (S8_M1)
    launch_linear(backend, x, w)
    s8 = [launch for launch in launches if launch.kernel == "gemv_s8"]
    assert [launch.spec.get("GM_TILE_ROWS", 32) for launch in s8] == [16, 32] and "S8_M1" in s8[1].spec
    backend, launches = recording_backend()  # 9 rows under "auto": one launch of the S8_NCOL = 2 build
    launch_linear(backend, x, w)
    assert [launch.kernel for launch in launches] == ["quantize_s8", "gemv_s8"]
    assert launches[1].spec == kernels.gemv_s8_spec("Q4_1", False, 9, False, True, 16)
    assert launches[0].smem == 0 and launches[1].smem == kernels.gemv_s8_smem_bytes(9, 4096)
    assert launches[1].params.m == 9


def test_gemv_s8_launch_rows_and_gemv_max_rows():
    """Calls on repacked quant rows: gemv_s8 launches of 32 x rows (S8_NCOL = 4), else of 16 (S8_NCOL = 2), where
    that many rows of x fit the shared memory whole or in <= 4 k ranges (not with SwiGLU), else of 8 (x quantized
    per launch; H200: 32 at k = 4,096, and at 14,336 in three k ranges); on SM90+ such calls stay
    GEMVs up to kernels.QUANT_GEMV_MAX_ROWS_SM90[fmt] rows (then the dequant GEMM), below SM90 up to 16 (then
    gemm_tc); fp16 and GGUF rows up to 16. The recorded launches of one call follow."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.gemv_int8 import gemv_s8_k_ranges, gemv_s8_launch_rows
    from voltserve.backends.cuda.linear import gemv_max_rows, launch_linear

    h200, sm86 = fake_backend(90), fake_backend(86, smem_kb=99)
    assert gemv_s8_launch_rows(h200, "Q4_1", 4096) == 32  # 164 KB of x
    # k = 14,336: 32 rows of x (574 KB) only in three k ranges (195 KB each), which SwiGLU builds lack
    assert gemv_s8_launch_rows(h200, "Q4_1", 14336) == 32 and gemv_s8_launch_rows(h200, "Q4_1", 14336, True) == 8
    assert gemv_s8_launch_rows(h200, "Q8_0", 4096, True) == 32
    # SM86's 99 KB, as the function answers (no call there reaches 17 rows, linear.gemv_max_rows, nor 9 at k =
    # 14,336, gemv_s8_fits for 8 rows): 32 rows at k = 4,096 in two ranges (82 KB), 16 at 14,336 in four (72 KB)
    assert gemv_s8_launch_rows(sm86, "Q4_1", 4096) == 32 and gemv_s8_launch_rows(sm86, "Q4_1", 4096, True) == 16
    assert gemv_s8_launch_rows(sm86, "Q4_1", 14336) == 16 and gemv_s8_launch_rows(sm86, "Q4_1", 14336, True) == 8
    assert gemv_s8_launch_rows(sm86, "Q4_1", 28672) == 8  # a quarter of the k for 16 rows is 143 KB
    assert gemv_s8_launch_rows(SimpleNamespace(loader=h200.loader, gemv_s8_rows="8"), "Q4_1", 4096) == 8
    no32 = SimpleNamespace(loader=h200.loader, gemv_s8_rows="16")
    assert gemv_s8_launch_rows(no32, "Q4_1", 4096) == 16 and gemv_s8_launch_rows(no32, "Q4_1", 14336) == 16
    whole = SimpleNamespace(loader=h200.loader, gemv_s8_rows="whole")
    assert gemv_s8_launch_rows(whole, "Q4_1", 4096) == 32 and gemv_s8_launch_rows(whole, "Q4_1", 14336) == 8
    assert gemv_s8_launch_rows(SimpleNamespace(loader=h200.loader, gemv_s8_x="block"), "Q4_1", 4096) == 8
    assert gemv_s8_k_ranges(h200, "Q4_1", 16, 4096) == [(0, 128)]
    assert gemv_s8_k_ranges(h200, "Q4_1", 16, 14336) == [(0, 224), (224, 448)]
    assert gemv_s8_k_ranges(h200, "Q8_0", 16, 14336) == [(0, 224), (224, 448)]
    assert gemv_s8_k_ranges(h200, "Q4_1", 32, 14336) == [(0, 152), (152, 304), (304, 448)]  # Q4 groups of 4 blocks
    assert gemv_s8_k_ranges(h200, "Q8_0", 32, 14336) == [(0, 150), (150, 300), (300, 448)]  # Q8_0 groups of 2
    assert gemv_s8_k_ranges(h200, "Q4_1", 32, 4 * 14336) is None  # more than GEMV_S8_MAX_KSPLITS ranges
    assert gemv_s8_k_ranges(h200, "Q4_1", 8, 14336) == [(0, 448)]  # 143 KB: fits whole
    assert gemv_s8_k_ranges(sm86, "Q4_1", 8, 14336) is None  # <= 8 rows never split: gemv_mma
    assert gemv_s8_k_ranges(sm86, "Q4_1", 16, 28672) is None and gemv_s8_k_ranges(sm86, "Q4_1", 16, 8192) == [
        (0, 128), (128, 256)]
    q4 = repacked_linear("Q4_1", 4096, 4096)
    assert gemv_max_rows(h200, q4) == kernels.QUANT_GEMV_MAX_ROWS_SM90["Q4_1"] == 64
    q8 = repacked_linear("Q8_0", 4096, 4096)
    assert gemv_max_rows(h200, q8) == 32  # Q8_0 measured slower at 64 rows
    assert gemv_max_rows(fake_backend(80, smem_kb=163), q4) == 16
    assert gemv_max_rows(SimpleNamespace(**vars(h200), quant_gemv_rows="48"), q4) == 48
    off = fake_backend(90)
    off.gemv_s8 = "off"
    assert gemv_max_rows(off, q4) == 16  # gemv_mma: 8-row launches only
    assert gemv_max_rows(h200, fake_linear("Q4_1", 4096, 4096)) == 16  # GGUF rows
    # 8-row launches (each reading the whole weight) never serve more than 16 rows: SwiGLU rows whose 16 rows of
    # x fit only in k ranges, x quantized by every block, or VOLTSERVE_GEMV_S8_ROWS=8
    wide_k = repacked_linear("Q4_1", 4096, 14336)
    assert gemv_max_rows(h200, wide_k) == 64 and gemv_max_rows(h200, wide_k, silu=True) == 16
    for knob in ({"gemv_s8_x": "block"}, {"gemv_s8_rows": "8"}):
        assert gemv_max_rows(SimpleNamespace(**vars(h200), **knob), q4) == 16, knob
    assert gemv_max_rows(h200, fake_linear("F16", 4096, 4096)) == 16

    def kernels_of(m, k, n=4096, silu=False):
        w = repacked_linear("Q4_1", n, k)
        backend, launches = recording_backend()
        y = launch_linear(backend, torch.zeros(m, k, dtype=torch.float16), w, silu=silu)
        assert y.shape == (m, n >> silu)
        return launches, [(launch.kernel, launch.params.m if launch.kernel == "gemv_s8" else None)
                          for launch in launches]

    launches, names = kernels_of(24, 4096)
    assert names == [("quantize_s8", None), ("gemv_s8", 24)]
    # one tile a block: the one-group build (gemv_int8.gemv_s8_launch_spec)
    assert launches[1].spec == {**kernels.gemv_s8_spec("Q4_1", False, 24, False, True, 32), "S8_NEXT_GROUPS": 1}
    assert launches[1].spec["S8_NCOL"] == 4 and launches[1].smem == kernels.gemv_s8_smem_bytes(24, 4096)
    assert kernels_of(32, 4096)[1] == [("quantize_s8", None), ("gemv_s8", 32)]
    def split_of(launch):
        return launch.params.kb_begin, launch.params.kb_end, launch.params.part_in, launch.params.part_out

    launches, names = kernels_of(20, 14336)  # 20 rows (S8_NCOL = 4) in two k ranges (S8_KSPLIT)
    assert names == [("quantize_s8", None), ("gemv_s8", 20), ("gemv_s8", 20)]
    first, second = launches[1], launches[2]
    # one tile a block: the one-group build; a k split: x copied per warp (gemv_int8.gemv_s8_launch_spec)
    assert first.spec == second.spec == {**kernels.gemv_s8_spec("Q4_1", False, 20, False, True, 32, True),
                                         "S8_NEXT_GROUPS": 1, "S8_XWARP": 1}
    assert first.spec["S8_KSPLIT"] == 1 and first.spec["S8_NCOL"] == 4
    assert split_of(first) == (0, 224, 0, 1) and split_of(second) == (224, 448, 1, 0)
    assert first.params.part == second.params.part != 0 and first.params.xq == second.params.xq != 0
    assert first.smem == kernels.gemv_s8_smem_bytes(20, 224 * 32)
    launches, names = kernels_of(36, 14336)  # 32 rows in three k ranges, then 4 rows whole
    assert names == [("quantize_s8", None)] + [("gemv_s8", 32)] * 3 + [("quantize_s8", None), ("gemv_s8", 4)]
    assert [split_of(launch) for launch in launches[1:4]] == [(0, 152, 0, 1), (152, 304, 1, 1), (304, 448, 1, 0)]
    assert launches[1].spec == {**kernels.gemv_s8_spec("Q4_1", False, 32, False, True, 32, True), "S8_NEXT_GROUPS": 1,
                                "S8_XWARP": 1}
    assert "S8_XWARP" not in launches[5].spec  # x whole: the block's copy
    assert launches[1].smem == kernels.gemv_s8_smem_bytes(32, 152 * 32)
    assert len({launch.params.part for launch in launches[1:4]}) == 1 and "S8_KSPLIT" not in launches[5].spec
    assert launches[5].smem == kernels.gemv_s8_smem_bytes(4, 14336)
    launches, names = kernels_of(16, 14336)  # 16 rows: S8_NCOL = 2 in two k ranges
    assert [launch.spec.get("S8_NCOL") for launch in launches[1:]] == [2, 2] and names[1:] == [("gemv_s8", 16)] * 2
    assert kernels_of(16, 14336, 4096, silu=True)[1] == [("quantize_s8", None), ("gemv_s8", 8)] * 2
    assert kernels_of(40, 4096)[1] == [("quantize_s8", None), ("gemv_s8", 32), ("quantize_s8", None), ("gemv_s8", 8)]
    assert kernels_of(64, 4096)[1] == [("quantize_s8", None), ("gemv_s8", 32)] * 2
    assert kernels_of(65, 4096)[1] == [("dequant_f16", None)]  # the GEMM: dequant_f16, then torch.mm


def test_gemv_s8_x_per_launch_rule():
    """x is quantized once per launch (quantize_s8) under "auto" for >= 2 rows or one row wider than
    GEMV_S8_BLOCK_MAX_X; "block" / "launch" force either."""
    from voltserve.backends.cuda.gemv_int8 import GEMV_S8_BLOCK_MAX_X, gemv_s8_x_per_launch

    auto = SimpleNamespace(gemv_s8_x="auto")
    assert not gemv_s8_x_per_launch(auto, 1, GEMV_S8_BLOCK_MAX_X)
    assert gemv_s8_x_per_launch(auto, 1, GEMV_S8_BLOCK_MAX_X + 256) and gemv_s8_x_per_launch(auto, 2, 256)
    assert not gemv_s8_x_per_launch(auto, 1, 14336)  # Llama-3-8B down_proj at batch 1
    assert not gemv_s8_x_per_launch(SimpleNamespace(gemv_s8_x="block"), 8, 14336)
    assert gemv_s8_x_per_launch(SimpleNamespace(gemv_s8_x="launch"), 1, 256)
    from voltserve.backends.cuda.gemv_int8 import GEMV_S8W_BLOCK_MAX_X  # gemv_s8w: x per launch above k = 4096
    assert gemv_s8_x_per_launch(auto, 1, 14336, GEMV_S8W_BLOCK_MAX_X)
    assert not gemv_s8_x_per_launch(auto, 1, 4096, GEMV_S8W_BLOCK_MAX_X)


def test_gemv_s8w_takes_one_row_calls_only():
    """gemv_s8w (a warp per weight row) serves calls of exactly one x row on repacked rows: under auto every
    repacked format at every width, where it measured faster; a 9-row call's second launch (1 row) keeps its first
    launch's kernel (gemv_s8w_ok(9) is False); VOLTSERVE_GEMV_S8_M1=mma, gemv_s8 "off", a forced gemv_kernel or
    SM < 80 give the kernels before; gemv_s8 "on" takes it wherever gemv_s8 may; a k whose x copy and
    GEMV_S8W_SMEM_PAD overflow the opt-in shared memory, never."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.gemv_int8 import gemv_s8w_ok

    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        w = repacked_linear(fmt, 4096, 14336)
        be = fake_backend(90)
        assert gemv_kernel_name(be, w, 1) == "gemv_s8w" and gemv_s8w_ok(be, w, 1)
        assert not gemv_s8w_ok(be, w, 2) and not gemv_s8w_ok(be, w, 9)
        narrow = repacked_linear(fmt, 4096, 4096)
        assert gemv_kernel_name(be, narrow, 1) == "gemv_s8w"
        be.gemv_s8 = "on"
        assert gemv_kernel_name(be, narrow, 1) == "gemv_s8w"
        be.gemv_s8_m1 = "mma"
        assert gemv_kernel_name(be, w, 1) == "gemv_s8"
        be.gemv_s8 = "auto"
        assert gemv_kernel_name(be, w, 1) == "gemv_s8"
        for attr, value in (("gemv_s8", "off"), ("gemv_kernel", "mma")):
            other = fake_backend(90)
            setattr(other, attr, value)
            assert gemv_kernel_name(other, w, 1) == "gemv_mma"
        forced = fake_backend(90, "mma")
        forced.gemv_s8 = "on"  # "on" takes the int8 kernels even under a forced gemv_kernel
        assert gemv_kernel_name(forced, w, 1) == "gemv_s8w"
        assert gemv_kernel_name(fake_backend(75), w, 1) == "gemv_mma"
        gguf = fake_linear(fmt, 4096, 14336)  # GGUF rows: never (gemv_s8w reads the repacked layout)
        assert not gemv_s8w_ok(fake_backend(90), gguf, 1)
        tight = fake_backend(90)  # room for gemv_s8's x copy of one row, not for gemv_s8w's padded one
        tight.loader.max_smem_optin = kernels.gemv_s8_smem_bytes(1, 14336) + kernels.GEMV_MMA_STATIC_SMEM
        assert kernels.gemv_s8w_smem_bytes(14336) == tight.loader.max_smem_optin - kernels.GEMV_MMA_STATIC_SMEM + 1024
        assert not gemv_s8w_ok(tight, w, 1) and gemv_kernel_name(tight, w, 1) == "gemv_s8"


def test_gemv_tma_s8_routing_and_plan():
    """gemv_tma_s8 runs only under VOLTSERVE_GEMV_TMA_S8=on (the default "off": it measured slower), on one-row
    calls without a fused norm or SwiGLU, on repacked rows of whole chunks, SM90+, where its ring fits; its ring
    holds whole row pairs in one bulk copy per stage, and the plan sizes the smem as ring + x + partials."""
    from voltserve.backends.cuda import kernels, kernels_tma
    from voltserve.backends.cuda.gemv_tma import gemv_tma_s8_ok

    w = repacked_linear("Q4_1", 4096, 4096)
    be = fake_backend(90)
    assert not gemv_tma_s8_ok(be, w, 1) and gemv_kernel_name(be, w, 1) == "gemv_s8w"
    be.gemv_tma_s8 = "on"
    assert gemv_tma_s8_ok(be, w, 1) and gemv_kernel_name(be, w, 1) == "gemv_tma_s8"
    assert gemv_kernel_name(be, w, 2) == "gemv_s8"
    assert not gemv_tma_s8_ok(be, w, 1, norm=True) and not gemv_tma_s8_ok(be, w, 1, silu=True)
    assert not gemv_tma_s8_ok(be, fake_linear("Q4_1", 4096, 4096), 1)  # GGUF rows
    narrow = repacked_linear("Q4_1", 64, 512)  # Q4 rows need whole 1,024-weight chunks
    assert not gemv_tma_s8_ok(be, narrow, 1)
    old_gpu = fake_backend(80)
    old_gpu.gemv_tma_s8 = "on"
    assert not gemv_tma_s8_ok(old_gpu, w, 1)
    tight = fake_backend(90, smem_kb=100)
    tight.gemv_tma_s8 = "on"
    assert not gemv_tma_s8_ok(tight, w, 1)  # a 160 KB ring does not fit
    # Q4_1 k = 4096: 2,560-byte rows, 12 a stage (30 KB), 5 stages; k = 14336: one row pair (17.5 KB), 8 stages
    assert kernels_tma.gemv_tma_s8_ring("Q4_1", 4096) == (5, 12)
    assert kernels_tma.gemv_tma_s8_ring("Q4_1", 14336) == (8, 2)
    assert kernels_tma.gemv_tma_s8_ring("Q8_0", 14336) == (5, 2) and kernels_tma.gemv_tma_s8_chunk("Q8_0") == 512
    x_bytes = kernels.gemv_s8_smem_bytes(1, 4096)
    assert kernels_tma.gemv_tma_s8_plan("Q4_1", 4096, 4096, 132, (5, 12)) == (132, 5 * 12 * 2560 + x_bytes + 32 * 4 * 4)
    assert kernels_tma.gemv_tma_s8_plan("Q8_0", 5, 1024, 132, (2, 2)) == (5, 2 * 2 * 1088 + kernels.gemv_s8_smem_bytes(
        1, 1024) + 1 * 2 * 4)
    for ring in ((0, 2), (9, 2), (2, 3), (2, 0)):
        with pytest.raises(ValueError, match="ring"):
            kernels_tma.gemv_tma_s8_plan("Q4_1", 4096, 4096, 132, ring)
    with pytest.raises(ValueError, match="whole chunks"):
        kernels_tma.gemv_tma_s8_ring("Q4_1", 512)


def test_attention_xq_rule_and_handoff():
    """linear.attention_xq: attn_decode writes its output quantized for the o_proj launch after it exactly where
    that launch would quantize x once per launch (gemv_s8 at 2-8 rows, gemv_s8w above k = 4,096) and the writers
    hold whole blocks; the next launch_linear takes the handoff (gemv_s8 reads it: no quantize_s8), and drops one
    it cannot use (another x or weight), which then quantizes its own x."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.linear import attention_xq, launch_linear

    be, launches = recording_backend()
    w = repacked_linear("Q4_1", 4096, 4096)
    out = torch.zeros(8, 32, 128, dtype=torch.float16)
    ptr, fmt, rows = attention_xq(be, w, out, 4)
    pending = be.xq_pending
    assert (fmt, rows) == (2, 8) and ptr == pending.xq.data_ptr()
    assert pending.xq.numel() == kernels.gemv_s8_smem_bytes(8, 4096) and pending.shape == (8, 4096)
    launch_linear(be, out.view(8, 4096), w)
    assert [launch.kernel for launch in launches] == ["gemv_s8"] and launches[0].params.xq == ptr
    assert be.xq_pending is None
    launches.clear()
    launch_linear(be, out.view(8, 4096), w)  # nothing pending: quantize_s8 again
    assert [launch.kernel for launch in launches] == ["quantize_s8", "gemv_s8"]
    for x, weight in ((out.view(8, 4096).clone(), w), (out.view(8, 4096), repacked_linear("Q4_1", 4096, 4096))):
        launches.clear()
        attention_xq(be, w, out, 4)
        launch_linear(be, x, weight)  # another x, or another weight: dropped
        assert [launch.kernel for launch in launches] == ["quantize_s8", "gemv_s8"] and be.xq_pending is None
        assert launches[0].params.xq == launches[1].params.xq  # gemv_s8 reads quantize_s8's bytes
    # one row: gemv_s8w quantizes x per block at k = 4,096 (no handoff), per launch above it (handoff)
    assert attention_xq(be, w, torch.zeros(1, 32, 128, dtype=torch.float16), 4) == (None, 0, 0)
    wide = repacked_linear("Q8_0", 64, 14336)
    ptr, fmt, rows = attention_xq(be, wide, torch.zeros(1, 112, 128, dtype=torch.float16), 14)
    assert (fmt, rows) == (3, 1) and be.xq_pending.xq.numel() == kernels.gemv_s8_smem_bytes(1, 14336)
    launches.clear()
    launch_linear(be, torch.zeros(1, 14336, dtype=torch.float16), wide)  # another x: dropped
    assert [launch.kernel for launch in launches] == ["quantize_s8", "gemv_s8w"]
    be.xq_pending = None
    none = (None, 0, 0)
    assert attention_xq(be, fake_linear("F16", 4096, 4096), out, 4) == none  # fp16: no int8 x
    assert attention_xq(be, fake_linear("Q4_1", 4096, 4096), out, 4) == none  # GGUF rows: gemv_mma
    assert attention_xq(be, w, torch.zeros(9, 32, 128, dtype=torch.float16), 4) == none  # two launches
    assert attention_xq(be, w, torch.zeros(2, 64, 64, dtype=torch.float16), 1) == none  # group x head_dim 64
    assert attention_xq(be, w, torch.zeros(2, 16, 128, dtype=torch.float16), 4) == none  # k != in_features
    be.gemv_s8_x = "block"
    assert attention_xq(be, w, out, 4) == none  # every block quantizes x itself
    be.gemv_s8_x, be.attn_xq = "auto", "off"
    assert attention_xq(be, w, out, 4) == none and be.xq_pending is None


def test_gemv_s8_wide_block_rule():
    """gemv_int8.gemv_s8_wide_block: a gemv_s8 launch of 2-8 x rows quantized per launch in 32-row tiles whose
    8-warp block fits an SM once (Llama-3-8B's down at 8 rows: 143 KB of x) runs the 16-warp build (512 threads);
    not where two blocks fit, at 9-16 rows, under VOLTSERVE_GEMV_S8_WARPS=8, or where x is quantized per block."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.linear import launch_linear

    down = repacked_linear("Q4_1", 4096, 14336)
    limit = 227 * 1024
    # the blocks an SM: as the driver's occupancy would give from the x copy (no register limit for 8 warps)
    be, launches = recording_backend(_occupancy=lambda op, kernel, spec, smem, threads: max(1, limit // (smem + 8192)))

    def launched(rows, **knobs):
        for name, value in knobs.items():
            setattr(be, name, value)
        launches.clear()
        launch_linear(be, torch.zeros(rows, 14336, dtype=torch.float16), down)
        be.gemv_s8_warps, be.gemv_s8_x = "auto", "auto"
        return [(launch.kernel, launch.spec.get("GM_WARPS", 8), launch.block[0]) if launch.kernel == "gemv_s8"
                else launch.kernel for launch in launches]

    assert launched(8) == ["quantize_s8", ("gemv_s8", 16, 512)]
    assert launches[1].spec == {**kernels.gemv_s8_spec("Q4_1", False, 8, False, True, 32, wide_block=True),
                                "S8_NEXT_GROUPS": 1}  # one tile a block
    assert launches[1].grid == (128, 1, 1)  # 128 tiles, one block an SM
    assert launched(8, gemv_s8_warps="8") == ["quantize_s8", ("gemv_s8", 8, 256)]
    assert launched(3) == ["quantize_s8", ("gemv_s8", 8, 256)]  # x 72 KB: 2-3 blocks fit
    # 16-row launches (S8_NCOL = 2): not this build
    assert all(launch[1] == 8 for launch in launched(12) if launch != "quantize_s8")
    assert launched(8, gemv_s8_x="block") == [("gemv_s8", 8, 256)]
    # x's copy fits beside the 8-warp block's static smem but not the 16-warp block's: 8 warps (99 KB: SM86/89)
    be.loader.max_smem_optin = 99 * 1024
    assert kernels.gemv_s8_smem_bytes(4, 14336) + kernels.GEMV_MMA_STATIC_SMEM <= be.loader.max_smem_optin
    assert kernels.gemv_s8_smem_bytes(4, 14336) + kernels.GEMV_S8_WIDE_STATIC_SMEM > be.loader.max_smem_optin
    assert launched(4) == ["quantize_s8", ("gemv_s8", 8, 256)]
    be.loader.max_smem_optin = 227 * 1024
    with pytest.raises(ValueError, match="16-warp"):
        kernels.gemv_s8_spec("Q4_1", False, 8, x_per_launch=True, tile_rows=16, wide_block=True)
    with pytest.raises(ValueError, match="16-warp"):
        kernels.gemv_s8_spec("Q4_1", False, 12, x_per_launch=True, tile_rows=16, wide_block=True)
    built = [spec for op, spec in kernels.engine_specializations() if op == "gemv_s8"]
    for fmt in ("Q4_0", "Q4_1", "Q8_0"):
        for silu in (False, True):
            assert kernels.gemv_s8_spec(fmt, silu, 5, False, True, wide_block=True) in built


def test_gemv_s8_early_loads_by_grid():
    """gemv_int8.gemv_s8_launch_spec: under "auto" a gemv_s8 launch with x quantized per launch takes the two-group
    build (gemv_s8.cu's default) where a block loops over several tiles and the one-group build (S8_NEXT_GROUPS 1,
    as before session 46) on a grid of one tile a block; "1" one group everywhere, "2" both before the PDL wait on
    every grid; builds quantizing x in every block are left as they are."""
    from voltserve.backends.cuda import kernels
    from voltserve.backends.cuda.gemv_int8 import gemv_s8_launch_spec
    from voltserve.backends.cuda.linear import launch_linear

    xg, block = kernels.gemv_s8_spec("Q4_1", False, 8, False, True), kernels.gemv_s8_spec("Q4_1", False, 8)
    be = SimpleNamespace(gemv_s8_preload="auto")
    assert gemv_s8_launch_spec(be, xg, one_tile=False) == xg
    assert gemv_s8_launch_spec(be, xg, one_tile=True) == {**xg, "S8_NEXT_GROUPS": 1}
    assert gemv_s8_launch_spec(be, block, one_tile=True) == block
    be.gemv_s8_preload = "1"
    assert gemv_s8_launch_spec(be, xg) == {**xg, "S8_NEXT_GROUPS": 1}
    be.gemv_s8_preload = "2"
    assert gemv_s8_launch_spec(be, xg, one_tile=True) == {**xg, "S8_WAIT_GROUPS": 2}
    assert gemv_s8_launch_spec(be, block) == block
    be.gemv_s8_xcopy = "warp"  # VOLTSERVE_GEMV_S8_XCOPY: x copied in per warp, with either preload choice
    # (the namespace had no gemv_s8_xcopy above: the default "split" leaves launches without a k split alone)
    assert gemv_s8_launch_spec(be, xg, one_tile=True) == {**xg, "S8_XWARP": 1, "S8_WAIT_GROUPS": 2}
    assert gemv_s8_launch_spec(be, block) == block
    be.gemv_s8_preload = "auto"
    assert gemv_s8_launch_spec(be, xg, one_tile=True) == {**xg, "S8_XWARP": 1, "S8_NEXT_GROUPS": 1}
    assert gemv_s8_launch_spec(be, xg) == {**xg, "S8_XWARP": 1}
    be.gemv_s8_xcopy = "split"  # only the k-split launches
    assert gemv_s8_launch_spec(be, xg) == xg
    split = kernels.gemv_s8_spec("Q4_1", False, 32, False, True, 32, True)
    assert split["S8_KSPLIT"] == 1 and gemv_s8_launch_spec(be, split) == {**split, "S8_XWARP": 1}
    rec, launches = recording_backend(gemv_s8_preload="auto")
    for n, want in ((1024, {"S8_NEXT_GROUPS": 1}), (20000, {})):  # 16-row tiles: 64 / 1,250 tiles, 396 blocks
        launches.clear()
        launch_linear(rec, torch.zeros(4, 4096, dtype=torch.float16), repacked_linear("Q4_1", n, 4096))
        spec = launches[1].spec
        assert {key: spec[key] for key in ("S8_NEXT_GROUPS",) if key in spec} == want, n
