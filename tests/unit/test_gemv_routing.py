"""Which decode GEMV kernel a launch runs (backends/cuda/linear.py): pure Python, no GPU.

SM70 (V100) gets gemv_mma's m8n8k4 path but never gemv_mma_sb (cp.async and m16n8k16 are SM80+; its SM70 build is
an empty stub), and the shapes the mma kernels cannot take (k % 32, unaligned x or weights) fall back to gemv /
gemv_q. The int8 kernels on repacked quant rows (gemv_s8, gemv_s8w, gemv_tma_s8): test_gemv_int8_routing.py.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from tests.unit.gemv_fakes import fake_backend, fake_linear, recording_backend, repacked_linear
from voltserve.backends.cuda import kernels, kernels_tma
from voltserve.backends.cuda.linear import (GEMV_MMA_MIN_ROWS, GEMV_MMA_SM70_MIN_ROWS, CudaLinear, gemv_kernel_name,
                                           launch_linear)


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 8])
def test_sm70_routing(fmt, rows):
    """V100: gemv_mma's m8n8k4 path from max(GEMV_MMA_MIN_ROWS, GEMV_MMA_SM70_MIN_ROWS) rows, never gemv_mma_sb
    (cp.async is SM80+), never at m = 1 (the m = 1 exceptions were measured on SM80+ only)."""
    w, big = fake_linear(fmt, 64, 4096), fake_linear(fmt, 4096, 4096)
    scalar = "gemv_q" if fmt != "F16" and rows >= 3 else "gemv"
    want = "gemv_mma" if rows >= max(GEMV_MMA_MIN_ROWS[fmt], GEMV_MMA_SM70_MIN_ROWS) else scalar
    assert gemv_kernel_name(fake_backend(70), w, rows) == want
    assert gemv_kernel_name(fake_backend(70), big, rows, norm=True) == want
    assert gemv_kernel_name(fake_backend(70, "scalar"), w, rows) == scalar
    assert gemv_kernel_name(fake_backend(70, "mma"), w, rows) == "gemv_mma"
    assert gemv_kernel_name(fake_backend(60, "mma"), w, rows) == scalar  # no tensor cores: not a target


@pytest.mark.parametrize("fmt", ["F16", "Q4_1", "Q8_0"])
def test_turing_keeps_the_scalar_kernels(fmt):
    """SM75 would run the m8n8k4 path, native only on SM70/72 and not measured elsewhere: auto keeps gemv/gemv_q."""
    w = fake_linear(fmt, 64, 4096)
    assert not gemv_kernel_name(fake_backend(75), w, 8).startswith("gemv_mma")
    assert gemv_kernel_name(fake_backend(75, "mma"), w, 8) == "gemv_mma"  # forced: allowed (tests, A/B)


@pytest.mark.parametrize("arch,smem_kb,q8_sb", [(80, 163, False), (86, 99, False), (89, 99, False), (90, 227, True)])
def test_superblocks_only_where_the_stages_fit(arch, smem_kb, q8_sb):
    """gemv_mma_sb's Q8_0 stages need 212 KB of shared memory per block, Q4_1's 96 KB: on A100 / SM86 / SM89
    Q8_0 takes gemv_mma's direct loads instead (a launch there would fail to set its shared memory)."""
    be = fake_backend(arch, smem_kb=smem_kb)
    assert (gemv_kernel_name(be, fake_linear("Q8_0", 64, 4096), 8) == "gemv_mma_sb") == q8_sb
    assert gemv_kernel_name(be, fake_linear("Q4_1", 64, 4096), 8) == "gemv_mma_sb"
    assert gemv_kernel_name(fake_backend(arch, smem_kb=64), fake_linear("Q4_1", 64, 4096), 8) == "gemv_mma"


def test_compile_arch_decides():
    """The kernels' __CUDA_ARCH__ is the loader's compile_arch (an NVRTC that does not know the device builds for
    an older arch): a pre-SM80 build must not be sent gemv_mma_sb (its stub would trap)."""
    be = fake_backend(90)
    be.loader.compile_arch = 75
    assert not gemv_kernel_name(be, fake_linear("Q4_1", 64, 4096), 8).startswith("gemv_mma")


def test_mma884_forces_the_sm70_path_on_newer_gpus():
    w = fake_linear("Q4_1", 64, 4096)
    assert gemv_kernel_name(fake_backend(90, "mma"), w, 1) == "gemv_mma_sb"
    assert gemv_kernel_name(fake_backend(90, "mma884"), w, 1) == "gemv_mma"


@pytest.mark.parametrize("fmt", ["F16", "Q4_0", "Q4_1", "Q8_0"])
def test_sm90_routing(fmt):
    w = fake_linear(fmt, 64, 4096)
    big = fake_linear(fmt, 4096, 4096)  # >= GEMV_MMA_M1_MIN_BYTES: bandwidth-bound at m = 1
    for rows in (1, 2, 4, 8):
        auto = gemv_kernel_name(fake_backend(90), w, rows)
        scalar = "gemv_q" if fmt != "F16" and rows >= 3 else "gemv"
        mma = "gemv_mma" if fmt == "F16" else "gemv_mma_sb"  # k = 4096: whole 16-byte-aligned superblocks
        assert auto == (mma if rows >= GEMV_MMA_MIN_ROWS[fmt] else scalar), rows
        if rows == 1:  # m = 1: mma only on large weights (quant superblocks; fp16 with the fused norm, no SwiGLU)
            assert gemv_kernel_name(fake_backend(90), big, 1) == ("gemv" if fmt == "F16" else "gemv_mma_sb")
            assert gemv_kernel_name(fake_backend(90), big, 1, silu=True) == "gemv"  # SwiGLU at m = 1: gemv's
            assert gemv_kernel_name(fake_backend(90), w, 1, norm=True) == "gemv"  # small: launch-bound
            if fmt == "F16":
                assert gemv_kernel_name(fake_backend(90), big, 1, norm=True) == "gemv_mma"
                assert gemv_kernel_name(fake_backend(90), big, 1, norm=True, silu=True) == "gemv"
        assert gemv_kernel_name(fake_backend(90, "mma"), w, rows) == mma
        assert not gemv_kernel_name(fake_backend(90, "scalar"), w, rows).startswith("gemv_mma")
    assert not gemv_kernel_name(fake_backend(90), w, 8, vec_ok=0).startswith("gemv_mma")  # unaligned x rows


def test_sm90_shapes_mma_cannot_take():
    assert gemv_kernel_name(fake_backend(90, "mma"), fake_linear("F16", 64, 4104), 8) == "gemv"  # k % 32 != 0
    for fmt, takes in (("Q4_1", False), ("Q4_0", True), ("Q8_0", True)):  # weights 2 bytes off 4-byte alignment
        w = fake_linear(fmt, 64, 4096)
        buf = torch.zeros(w.data.numel() + 2, dtype=torch.uint8)
        w.data = buf[2:].view(64, w.row_bytes)
        assert (gemv_kernel_name(fake_backend(90, "mma"), w, 8) == "gemv_mma") == takes, fmt  # not _sb: unaligned


def test_gemv_mma_norm_one_pass_build():
    """The one-pass 1/rms has a build of its own (GM_NORM_ONE_PASS), compiled ahead of time for every format
    next to the per-row build that m = 1 and unfused launches keep."""
    from voltserve.backends.cuda import kernels

    assert kernels.gemv_mma_spec("F16", False) == {"WTYPE": kernels.WTYPES["F16"], "SILU": 0}
    assert kernels.gemv_mma_spec("F16", True, norm_one_pass=True)["GM_NORM_ONE_PASS"] == 1
    built = [spec for op, spec in kernels.engine_specializations() if op == "gemv_mma"]
    for fmt in kernels.WTYPES:
        for silu in (False, True):
            assert kernels.gemv_mma_spec(fmt, silu) in built
            assert kernels.gemv_mma_spec(fmt, silu, norm_one_pass=True) in built


@pytest.mark.parametrize("rows,row_bytes,arch,sms,per_sm,tile", [
    (4096, 8192, 90, 132, 2, 16),      # Llama-3-8B fp16 o_proj on an H200: 32 MB, 256 blocks of 16 <= 264
    (4096, 28672, 90, 132, 2, 16),     # down (4096x14336)
    (6144, 8192, 90, 132, 2, 32),      # qkv: 384 blocks of 16 would need a second wave (25.2 vs 19.4 us)
    (6144, 8192, 90, 132, 3, 16),      # ... unless 3 fit per SM
    (28672, 8192, 90, 132, 2, 32),     # gate_up [gate; up]: many waves either way
    (4224, 8192, 90, 132, 2, 16),      # exactly 264 blocks of 16: one wave
    (4240, 8192, 90, 132, 2, 32),      # 265 blocks: one too many
    (2048, 8192, 90, 132, 2, 32),      # exactly 16 MB: a PDL launch -> 32
    (2049, 8192, 90, 132, 2, 16),      # just over
    (4096, 8192, 80, 108, 2, 32),      # A100: 256 blocks of 16 > 108 x 2 resident
    (2048, 8192, 80, 108, 2, 32),      # 16 MB on an A100: a PDL launch
    (4096, 8192, 70, 80, 4, 32),       # V100 (m8n8k4 path): not measured there, keeps 32
])
def test_gemv_mma_tile_rows(rows, row_bytes, arch, sms, per_sm, tile):
    """gemv_mma takes 16-row blocks on SM80+ for weights larger than GEMV_PDL_MAX_WEIGHT_BYTES whose 16-row
    blocks all fit on the GPU at once, else 32-row ones."""
    from voltserve.backends.cuda import kernels

    assert kernels.GEMV_PDL_MAX_WEIGHT_BYTES == 16 << 20
    assert kernels.gemv_mma_tile_rows(rows, rows * row_bytes, arch, sms, lambda: per_sm) == tile


def test_gemv_mma_tile_rows_asks_occupancy_only_when_needed():
    """The occupancy query compiles the 16-row build: small weights and SM70 never ask for it."""
    from voltserve.backends.cuda import kernels

    def never():
        raise AssertionError("occupancy asked")

    assert kernels.gemv_mma_tile_rows(576, 576 * 360, 90, 132, never) == 32
    assert kernels.gemv_mma_tile_rows(4096, 32 << 20, 70, 80, never) == 32
    with pytest.raises(ValueError, match="num_sms"):
        kernels.gemv_mma_tile_rows(4096, 32 << 20, 90, 0, lambda: 2)
    with pytest.raises(ValueError, match="blocks_per_sm"):
        kernels.gemv_mma_tile_rows(4096, 32 << 20, 90, 132, lambda: 0)
    with pytest.raises(ValueError, match="tile_rows"):
        kernels.gemv_mma_spec("F16", False, tile_rows=8)
    assert "GM_TILE_ROWS" not in kernels.gemv_mma_spec("F16", False, tile_rows=32)
    assert kernels.gemv_mma_spec("Q4_1", True, True, 16)["GM_TILE_ROWS"] == 16


def test_gemv_mma_tile_launcher_choice():
    """linear.gemv_mma_tile: a forced height wins; else the rule, at the 16-row build's occupancy; the SM70
    path forced on a newer GPU ("mma884") keeps 32 as a V100 would."""
    from voltserve.backends.cuda.linear import gemv_mma_tile

    asked = []

    def occupancy(op, kernel, spec, smem, threads):
        asked.append((op, kernel, spec.get("GM_TILE_ROWS"), threads))
        return 2

    be = SimpleNamespace(gemv_mma_tile=0, gemv_kernel="auto", num_sms=132, _occupancy=occupancy,
                         loader=SimpleNamespace(compile_arch=90))
    assert gemv_mma_tile(be, fake_linear("F16", 4096, 4096), False, False) == 16
    assert asked == [("gemv_mma", "gemv_mma", 16, 256)]
    assert gemv_mma_tile(be, fake_linear("F16", 6144, 4096), False, True) == 32
    assert gemv_mma_tile(be, fake_linear("Q4_1", 576, 576), False, False) == 32 and len(asked) == 2
    be.gemv_kernel = "mma884"
    assert gemv_mma_tile(be, fake_linear("F16", 4096, 4096), False, False) == 32
    be.gemv_mma_tile = 16
    assert gemv_mma_tile(be, fake_linear("Q4_1", 576, 576), False, False) == 16


def test_bench_decode_env_sweep(monkeypatch):
    """`bench_decode.py --env NAME=V1|V2` crosses every value of every variable; '-' is a value (unset), which
    apply_env removes from the environment."""
    from tools.bench_decode import apply_env, env_settings

    monkeypatch.setenv("VOLTSERVE_TEST_B", "old")
    monkeypatch.delenv("VOLTSERVE_TEST_A", raising=False)
    apply_env({"VOLTSERVE_TEST_A": "1", "VOLTSERVE_TEST_B": "-"})
    assert os.environ["VOLTSERVE_TEST_A"] == "1" and "VOLTSERVE_TEST_B" not in os.environ
    monkeypatch.delenv("VOLTSERVE_TEST_A")

    assert env_settings([]) == [{}]
    assert env_settings(["A=1|-", "B=x|y"]) == [{"A": "1", "B": "x"}, {"A": "1", "B": "y"},
                                                 {"A": "-", "B": "x"}, {"A": "-", "B": "y"}]
    for bad in ("A", "=1", "A="):
        with pytest.raises(SystemExit):
            env_settings([bad])


@pytest.mark.parametrize("fmt", ["F16", "Q4_1"])
def test_fused_norm_rule(fmt):
    """"auto" takes a separate rms_norm launch only for fp16 weights over GEMV_NORM_FUSED_MAX_BYTES, at every row
    count (measured at the 8B shapes); "on" / "off" force it either way."""
    from voltserve.backends.cuda.linear import GEMV_NORM_FUSED_MAX_BYTES, fuses_norm

    small, big = fake_linear(fmt, 1024, 4096), fake_linear(fmt, 6144, 4096)
    assert small.out_features * small.row_bytes <= GEMV_NORM_FUSED_MAX_BYTES
    assert (big.out_features * big.row_bytes > GEMV_NORM_FUSED_MAX_BYTES) == (fmt == "F16")
    auto = SimpleNamespace(fuse_norm="auto")
    assert fuses_norm(auto, small)
    assert fuses_norm(auto, big) == (fmt != "F16")
    for choice in ("on", "off"):
        assert fuses_norm(SimpleNamespace(fuse_norm=choice), big) == (choice == "on")


def test_backend_knobs_read_from_the_environment(monkeypatch):
    """The CUDA backend's A/B knobs (VOLTSERVE_GEMV_KERNEL, ...): the first choice when unset, a listed value as
    given, anything else refused with the variable named."""
    from voltserve.backends.cuda.backend import _env_choice

    monkeypatch.delenv("VOLTSERVE_FUSE_NORM", raising=False)
    assert _env_choice("VOLTSERVE_FUSE_NORM", ("auto", "on", "off")) == "auto"
    monkeypatch.setenv("VOLTSERVE_FUSE_NORM", "off")
    assert _env_choice("VOLTSERVE_FUSE_NORM", ("auto", "on", "off")) == "off"
    monkeypatch.setenv("VOLTSERVE_GEMV_MMA_TILE", "24")
    with pytest.raises(ValueError, match=r"VOLTSERVE_GEMV_MMA_TILE='24': expected 0, 16 or 32"):
        _env_choice("VOLTSERVE_GEMV_MMA_TILE", ("0", "16", "32"))


def test_gemv_pdl_rule():
    """"auto": PDL for every one-row decode GEMV, and for launches of more rows except a large one right after
    another large GEMV (the launch before it streamed > GEMV_PDL_MAX_WEIGHT_BYTES); "small": only small weights
    (the rule of sessions <= 11), whatever the rows; "on" / "off"; never without the backend's PDL (pre-SM90,
    --no-pdl)."""
    from voltserve.backends.cuda.kernels import GEMV_PDL_MAX_WEIGHT_BYTES
    from voltserve.backends.cuda.gemv_launch import gemv_pdl

    small, big = fake_linear("F16", 1024, 4096), fake_linear("F16", 6144, 4096)
    big_bytes = big.out_features * big.row_bytes
    assert small.out_features * small.row_bytes <= GEMV_PDL_MAX_WEIGHT_BYTES < big_bytes

    def backend(choice, last, pdl=True):
        return SimpleNamespace(pdl=pdl, gemv_pdl=choice, last_launch_weight_bytes=last)

    for last in (0, 1 << 20, big_bytes):
        for rows in (2, 8):
            assert gemv_pdl(backend("auto", last), small, rows)
            assert gemv_pdl(backend("auto", last), big, rows) == (last <= GEMV_PDL_MAX_WEIGHT_BYTES)
        assert gemv_pdl(backend("auto", last), big, 1) and gemv_pdl(backend("auto", last), small, 1)
        for rows in (1, 4):
            assert gemv_pdl(backend("small", last), small, rows) and not gemv_pdl(backend("small", last), big, rows)
            assert gemv_pdl(backend("on", last), big, rows) and not gemv_pdl(backend("off", last), small, rows)
            assert not gemv_pdl(backend("auto", last, pdl=False), small, rows)
            assert not gemv_pdl(backend("auto", last, pdl=False), big, 1)


def test_gemv_prefetch_bytes():
    """gemv's L2 prefetch under PDL: whole first rows while they fit the budget together, else an equal share in
    128-byte lines; a zero budget prefetches nothing (VOLTSERVE_GEMV_PREFETCH_MB=0)."""
    from voltserve.backends.cuda.kernels import GEMV_PREFETCH_L2_BYTES, gemv_prefetch_bytes

    assert GEMV_PREFETCH_L2_BYTES == 8 << 20
    assert gemv_prefetch_bytes(4096, 8192) == 2048  # 8B o_proj: a quarter of each row
    assert gemv_prefetch_bytes(4096, 8192, 32 << 20) == 8192  # the whole 32 MB weight
    assert gemv_prefetch_bytes(3000, 8192) == (8 << 20) // 3000 // 128 * 128 == 2688
    assert gemv_prefetch_bytes(100, 1152) == 1152 and gemv_prefetch_bytes(4096, 8192, 0) == 0


def test_gemv_pdl_is_decided_per_launch():
    """A 12-row call on a large fp16 weight is two 8-row gemv_mma launches: the first may start early after a
    short kernel, the second follows the first (a large GEMV) and does not; after a large GEMV neither does, but a
    one-row launch does. Every GEMV launch records its weight bytes for the next decision."""
    from voltserve.backends.cuda.linear import launch_linear

    big = fake_linear("F16", 6144, 4096)
    launches = []

    def record(op, kernel, spec, grid, block, smem, params, pdl=None):
        launches.append((kernel, pdl))
        backend.last_launch_weight_bytes = 0  # as CudaBackend._launch does

    backend = SimpleNamespace(pdl=True, gemv_pdl="auto", gemv_kernel="auto", gemv_mma_tile=0, gemv_s8="auto",
                              fuse_norm="auto", num_sms=132, last_launch_weight_bytes=0, _launch=record,
                              _occupancy=lambda *a, **k: 2,
                              loader=SimpleNamespace(compile_arch=90, max_smem_optin=227 * 1024))
    x = torch.zeros(12, 4096, dtype=torch.float16)
    launch_linear(backend, x, big)
    assert launches == [("gemv_mma", True), ("gemv_mma", False)]
    assert backend.last_launch_weight_bytes == 6144 * 4096 * 2
    launches.clear()
    launch_linear(backend, x, big)  # right after the large GEMV above
    assert launches == [("gemv_mma", False), ("gemv_mma", False)]
    launches.clear()
    launch_linear(backend, x[:1], big)  # one row: early start even after a large GEMV (session 39)
    assert launches == [("gemv", True)]


@pytest.mark.parametrize("case", ["f16_gemv", "f16_mma", "f16_tma", "f16_tma_pair", "s8w", "s8_m1", "s8",
                                  "s8_m1_launch", "tma_s8"])
def test_every_gemv_launcher_runs_on_arecording_backend(case):
    """Each decode-GEMV launcher (gemv, gemv_mma, gemv_tma, gemv_s8w, gemv_s8 with quantize_s8, gemv_tma_s8) goes
    through launch_linear on CPU tensors: the kernel gemv_kernel_name names is launched, with the grid, block and
    params its launcher computes (x, y and weight pointers, shape, row stride)."""
    k = 4096
    x1, x8 = torch.zeros(1, k, dtype=torch.float16), torch.zeros(8, k, dtype=torch.float16)
    knobs, rows = {}, 1
    if case.startswith("f16"):
        w = fake_linear("F16", 4096 if case != "f16_gemv" else 64, k)
        if case == "f16_gemv":  # gemv under PDL prefetches its first rows into L2 within the budget
            knobs = {"gemv_prefetch_budget": 64 * 1024}
        rows = 8 if case == "f16_mma" else 1
        if case.startswith("f16_tma"):
            knobs = {"gemv_tma": "on"}
        if case == "f16_tma_pair":
            knobs["gemv_tma_blocks"], knobs["gemv_tma_ring"] = 2, (8, 4)
    else:
        fmt = {"s8w": "Q8_0", "s8_m1": "Q4_0"}.get(case, "Q4_1")
        w = repacked_linear(fmt, 4096, 14336 if case == "s8_m1_launch" else k)
        rows = 8 if case == "s8" else 1
        if case == "s8_m1":  # gemv_s8's one-row build (S8_M1) under VOLTSERVE_GEMV_S8_M1=mma
            knobs = {"gemv_s8_m1": "mma"}
        if case == "tma_s8":
            knobs = {"gemv_tma_s8": "on"}
        if case == "s8_m1_launch":  # gemv_s8w with x quantized per launch (k > GEMV_S8W_BLOCK_MAX_X)
            x1 = torch.zeros(1, 14336, dtype=torch.float16)
    backend, launches = recording_backend(**knobs)
    x = x1 if rows == 1 else x8
    want = gemv_kernel_name(backend, w, rows)
    y = launch_linear(backend, x, w)
    kernels_run = [launch.kernel for launch in launches]
    expected = {"s8": ["quantize_s8", "gemv_s8"], "s8_m1_launch": ["quantize_s8", "gemv_s8w"]}.get(case, [want])
    assert kernels_run == expected and want == expected[-1]
    assert {"f16_gemv": "gemv", "f16_mma": "gemv_mma", "f16_tma": "gemv_tma", "f16_tma_pair": "gemv_tma",
            "s8w": "gemv_s8w", "s8_m1": "gemv_s8", "s8": "gemv_s8", "s8_m1_launch": "gemv_s8w",
            "tma_s8": "gemv_tma_s8"}[case] == want
    last = launches[-1]
    p = last.params
    assert (p.x, p.w, p.y) == (x.data_ptr(), w.data.data_ptr(), y.data_ptr()) and y.shape == (rows, w.out_features)
    assert (p.m, p.n, p.k, p.x_stride) == (rows, w.out_features, x.shape[1], x.shape[1])
    assert last.grid[0] >= 1 and last.block[0] % 32 == 0
    if want == "gemv_s8w":  # the block of the format's S8W_WARPS; smem: x's int8 copy and the tail pad
        warps = kernels.GEMV_S8W_WARPS[w.fmt]
        assert last.block[0] == 32 * warps and last.spec["S8W_WARPS"] == warps
        assert last.smem == kernels.gemv_s8w_smem_bytes(x.shape[1])
    if case == "f16_gemv":  # 64 rows of 8 KB share a 64 KB budget: 1 KB each
        assert last.pdl and p.prefetch_bytes == 1024
    if want == "gemv_tma":
        blocks = knobs.get("gemv_tma_blocks", 1)
        assert last.spec == ({"TMA_MIN_BLOCKS": 2} if blocks == 2 else {})
        assert (p.stages, p.stage_spans) == knobs.get("gemv_tma_ring", kernels_tma.GEMV_TMA_RING)
        assert 227 * 1024 // (blocks + 1) < last.smem <= 227 * 1024 // blocks  # at most `blocks` an SM


def test_folds_norm_rule():
    """The RMSNorm is folded into fp16 weights (auto: those over GEMV_NORM_FUSED_MAX_BYTES, whose norm would
    otherwise be its own rms_norm launch); never into a weight that stays quantized; "on" / "off" force it."""
    from voltserve.backends.cuda.linear import GEMV_NORM_FUSED_MAX_BYTES, folds_norm

    quant = SimpleNamespace(qtype="Q4_1")
    big = (GEMV_NORM_FUSED_MAX_BYTES // 8192 + 1, 4096)  # one row over the bound at fp16
    small = (GEMV_NORM_FUSED_MAX_BYTES // 8192, 4096)    # exactly the bound: keeps the fused prologue
    auto, on, off = (SimpleNamespace(norm_fold=c) for c in ("auto", "on", "off"))
    assert folds_norm(auto, big, None) and not folds_norm(auto, small, None)
    assert folds_norm(on, small, None) and not folds_norm(off, big, None)
    assert not folds_norm(on, big, quant) and not folds_norm(auto, big, quant)
    # a quant type without kernels, or rows not whole 32-wide blocks, is uploaded as fp16: then it may fold
    assert folds_norm(on, small, SimpleNamespace(qtype="Q6_K"))
    assert folds_norm(on, (64, 96 + 8), quant)


def test_norm_post_specs():
    """gemv's NORM_POST builds exist for fp16 only and are among the engine's specialisations (CI compiles
    them)."""
    from voltserve.backends.cuda import kernels

    built = kernels.engine_specializations()
    for silu in (False, True):
        for m in kernels.GEMV_ROW_BUCKETS:
            spec = kernels.gemv_spec("F16", m, silu, norm_post=True)
            assert spec == {"WTYPE": kernels.WTYPES["F16"], "MROWS": m, **({"SILU": 1} if silu else {}),
                            "NORM_POST": 1}
            assert ("gemv", spec) in built
    assert kernels.gemv_spec("Q4_1", 2, False) == {"WTYPE": kernels.WTYPES["Q4_1"], "MROWS": 2}
    with pytest.raises(ValueError):
        kernels.gemv_spec("Q4_1", 1, False, norm_post=True)


def test_folded_upload_on_cpu():
    """CudaLinear.upload with a norm weight stores fp16(W diag(g)) rounded once from fp32 (checked on the CPU
    device; the rows go through in 4096-row pieces) and the unit norm for the GEMM path."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(5000, 64, generator=gen)
    g = torch.rand(64, generator=gen) + 0.5
    lin = CudaLinear.upload(w, None, torch.device("cpu"), norm=g)
    assert lin.norm_folded and lin.fmt == "F16" and lin.data.dtype == torch.float16
    assert torch.equal(lin.data, (w * g).half())
    assert torch.equal(lin.unit_norm, torch.ones(64))
    assert not CudaLinear.upload(w, None, torch.device("cpu")).norm_folded
    with pytest.raises(ValueError):
        CudaLinear.upload(w, None, torch.device("cpu"), norm=g[:32])


def test_gemv_tma_routing():
    """gemv_tma takes one-row calls on fp16 weights of k % 1024 == 0 on SM90+ when VOLTSERVE_GEMV_TMA asks for it
    ("folded", the default: folded-norm weights of >= GEMV_TMA_MIN_BYTES without SwiGLU; "off"; "on": all), without
    a fused norm weight, where its ring fits the opt-in shared memory; a forced gemv_kernel, 2+ rows, unaligned x
    or weights, other row strides or older GPUs keep the kernels before."""
    from voltserve.backends.cuda.gemv_tma import GEMV_TMA_MIN_BYTES, gemv_tma_ok

    big, small = fake_linear("F16", 4096, 4096), fake_linear("F16", 64, 4096)
    assert small.out_features * small.row_bytes < GEMV_TMA_MIN_BYTES <= big.out_features * big.row_bytes
    folded, folded_small = fake_linear("F16", 4096, 4096), fake_linear("F16", 64, 4096)
    folded.unit_norm = folded_small.unit_norm = torch.ones(4096)
    be = fake_backend(90)  # no gemv_tma attribute: the default, "folded"
    assert gemv_kernel_name(be, folded, 1) == "gemv_tma"
    assert gemv_kernel_name(be, folded, 1, silu=True) == "gemv"
    assert gemv_kernel_name(be, folded_small, 1) == "gemv" and gemv_kernel_name(be, big, 1) == "gemv"
    be.gemv_tma = "off"
    assert gemv_kernel_name(be, folded, 1) == "gemv"
    be.gemv_tma = "on"
    for w in (big, small, folded):
        assert gemv_kernel_name(be, w, 1) == "gemv_tma" and gemv_kernel_name(be, w, 1, silu=True) == "gemv_tma"
    assert gemv_kernel_name(be, big, 1, norm=True) == "gemv_mma"  # a fused norm weight: not gemv_tma's
    assert gemv_kernel_name(be, big, 2) == "gemv_mma"
    assert gemv_kernel_name(be, big, 1, vec_ok=0) == "gemv"
    assert gemv_kernel_name(be, fake_linear("F16", 64, 4104), 1) == "gemv"  # k % 1024 != 0
    padded = CudaLinear("F16", torch.zeros(64, 4104, dtype=torch.float16), 64, 4096, 8208)  # row stride != 2k
    assert not gemv_tma_ok(be, padded, 1)
    unaligned = fake_linear("F16", 64, 4096)
    unaligned.data = torch.zeros(64 * 4096 + 1, dtype=torch.float16)[1:].view(64, 4096)
    assert not gemv_tma_ok(be, unaligned, 1)
    assert not gemv_tma_ok(be, fake_linear("Q4_1", 4096, 4096), 1)
    forced = fake_backend(90, "scalar")
    forced.gemv_tma = "on"
    assert gemv_kernel_name(forced, big, 1) == "gemv"
    old_gpu = fake_backend(80)
    old_gpu.gemv_tma = "on"
    assert gemv_kernel_name(old_gpu, big, 1) == "gemv"
    tight = fake_backend(90, smem_kb=100)
    tight.gemv_tma = "on"
    assert not gemv_tma_ok(tight, big, 1)  # a 128 KB ring does not fit
    # lm_head-sized weights: the partials of ~1,000 rows per block still fit beside the ring
    lm_head = CudaLinear("F16", torch.zeros(8, dtype=torch.float16), 128256, 4096, 8192)  # only the shape counts
    assert gemv_tma_ok(be, lm_head, 1)
    ring_bytes = kernels_tma.GEMV_TMA_RING[0] * kernels_tma.GEMV_TMA_RING[1] * 2048
    assert kernels_tma.gemv_tma_plan(128256, 4096, False, 132) == (132, ring_bytes + 4096 * 2 + 972 * 4 * 4)
    assert kernels_tma.gemv_tma_plan(3, 1024, True, 132) == (3, ring_bytes + 1024 * 2 + 2 * 4)
    assert kernels_tma.gemv_tma_plan(4096, 4096, False, 132, (24, 2)) == (132, 24 * 2 * 2048 + 4096 * 2 + 32 * 4 * 4)
    for ring in ((12, 4), (40, 1), (8, 0), (8, 5)):  # depth a multiple of the 8 consumer warps, <= 32; spans >= 1
        with pytest.raises(ValueError, match="ring"):
            kernels_tma.gemv_tma_plan(4096, 4096, False, 132, ring)
    with pytest.raises(ValueError, match="k % 1024"):
        kernels_tma.gemv_tma_plan(4096, 4000, False, 132)
    # two blocks an SM (VOLTSERVE_GEMV_TMA_BLOCKS=2): the ring must fit half the opt-in smem, the build caps registers
    pair = fake_backend(90)
    pair.gemv_tma, pair.gemv_tma_blocks = "on", 2
    assert not gemv_tma_ok(pair, big, 1)  # 128 KB ring + x: more than half of 227 KB
    pair.gemv_tma_ring = (8, 4)
    assert gemv_tma_ok(pair, big, 1) and gemv_tma_ok(pair, lm_head, 1)
    # the bound counts the 1 KB the GPU reserves per block: two blocks of 115,200 dynamic bytes do not fit an SM
    # (2 x (115,200 + 1,024 static + 1,024) > 227 KB + 1 KB), one does
    from voltserve.backends.cuda.gemv_tma import gemv_tma_fits
    edge = 227 * 1024 + 1024
    assert gemv_tma_fits(pair, edge // 2 - 2048) and not gemv_tma_fits(pair, edge // 2 - 2048 + 1)
    assert not gemv_tma_fits(pair, 115200) and gemv_tma_fits(fake_backend(90), 115200)
    assert gemv_tma_fits(fake_backend(90), 227 * 1024 - 1024) and not gemv_tma_fits(fake_backend(90), 227 * 1024 - 1023)
    assert kernels_tma.gemv_tma_spec(False, True, 2) == {"NORM_POST": 1, "TMA_MIN_BLOCKS": 2}
    assert kernels_tma.gemv_tma_spec(True, False) == {"SILU": 1}


@pytest.mark.parametrize("grid_knob", ["persistent", "full"])
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_gemv_s8w_grid(grid_knob, fmt):
    """gemv_s8w's grid (VOLTSERVE_GEMV_S8_GRID): a block per S8W_WARPS outputs, capped under "persistent" at the
    blocks the GPU holds at once (132 SMs x the fake's 2 blocks an SM)."""
    backend, launches = recording_backend(gemv_s8_grid=grid_knob)
    w = repacked_linear(fmt, 14336, 4096)
    launch_linear(backend, torch.zeros(1, 4096, dtype=torch.float16), w)
    warps = kernels.GEMV_S8W_WARPS[fmt]
    assert [launch.kernel for launch in launches] == ["gemv_s8w"]
    assert launches[0].grid == ((14336 // warps if grid_knob == "full" else 132 * 2), 1, 1)
