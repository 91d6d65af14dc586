"""The int8 decode GEMVs on repacked quant rows (ptx/gemv_s8.cu, SM80+): gemv_s8 (int8 MMAs, 1-32 x rows) and
gemv_s8w (one x row, a warp per weight row, dp4a), their routing rules and launchers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from voltserve.backends.cuda import kernels
from voltserve.backends.cuda import params as P
from voltserve.backends.cuda.gemv_launch import gemv_params, gemv_pdl, launched_gemv

if TYPE_CHECKING:
    from voltserve.backends.cuda.linear import CudaLinear

# gemv_s8 (int8 MMAs on repacked rows, x quantized per 32 like llama.cpp's Q8_1) replaces gemv_mma under
# VOLTSERVE_GEMV_S8=auto on GEMV_S8_AUTO_FORMATS (gemv_s8_ok), with x quantized by every block at one x row of
# k <= GEMV_S8_BLOCK_MAX_X and once per launch (quantize_s8) otherwise (gemv_s8_x_per_launch). H200,
# bench_kernels.py decode_gemv rows, gemv_mma -> gemv_s8 (docs/performance.md), Q4_1: m = 1 (x per block)
# 14336x4096 21.7 -> 16.4 us, 4096x4096 7.2 -> 6.2, 4096x14336 21.9 -> 20.7, fused RMSNorm + qkv 13.7 -> 8.9,
# RMSNorm + gate_up + SwiGLU (the GGUF pair's scalar gemv before) 45.1 -> 29.0; m = 8 (x per launch) 14336x4096
# 24.4 -> 18.1, 4096x14336 23.6 -> 19.4, 4096x4096 8.5 -> 8.5. Q8_0's kernel rows gained nowhere by more than
# ~5% (session 3), but its whole step did once its weights were repacked (session 11): 8B Q8_0, gemv_mma ->
# gemv_s8 at 2 / 4 / 8 rows 4.21 -> 3.50, 4.39 -> 3.70, 4.61 -> 3.85 ms (one row: gemv_s8w either way).
GEMV_S8_AUTO_FORMATS = ("Q4_0", "Q4_1", "Q8_0")

# gemv_s8w (one x row, a warp per weight row, dp4a) serves the one-row calls of repacked rows under
# VOLTSERVE_GEMV_S8_M1=warp (gemv_s8w_ok; x quantized once per launch for k > GEMV_S8W_BLOCK_MAX_X), where it
# measured faster than gemv_s8 / gemv_mma. H200, bench_kernels decode rows at m = 1 (docs/performance.md, session
# 7): Q4_1 4096x14336 20.3-20.7 -> 15.3-15.5 us, down + residual 20.6-20.8 -> 15.0-15.5; Q8_0 4096x4096 9.3-9.9
# -> 8.3, 14336x4096 22.6-23.6 -> 20.4-20.5 (gemv_mma before). Q4 rows of k = 4096 stayed on gemv_s8 until
# gemv_s8w scaled each block once (session 16: then Q4_1, 8B step 2.26 -> 2.21 ms) and lost its per-item index
# divisions (session 17: then Q4_0 too, 8B Q4_0 step 2.157 -> 2.067 ms with k = 4096 moved to gemv_s8w).
GEMV_S8W_BLOCK_MAX_X = 4096

# one-row gemv_s8 launches of k <= this quantize x in every block (an extra launch measured 1.7% slower per 8B
# step at batch 1: 2.755 vs 2.709 ms); wider ones (not measured) and all launches of >= 2 rows take quantize_s8
GEMV_S8_BLOCK_MAX_X = 16384
# widest k whose launches take gemv_s8's 16-row tiles, per format (others: any k whose x fits; gemv_s8_tile_rows)
GEMV_S8_NARROW_MAX_K = {"Q8_0": 4096}


@dataclass(frozen=True)
class PendingXq:
    """x already quantized for the next GEMV on `weight` by the kernel that wrote x (attn_decode for o_proj,
    `linear.attention_xq`): `xq` holds what quantize_s8 would write for `source` viewed as [rows, k] (`shape`).
    The next launch_linear takes it (`backend.xq_pending`) and uses it only if it runs that weight on that x;
    holding `source` keeps its memory from being reused by another tensor meanwhile."""

    source: torch.Tensor
    shape: tuple[int, int]
    weight: Any
    xq: torch.Tensor

    def matches(self, x: torch.Tensor, w: Any) -> bool:
        return (w is self.weight and x.data_ptr() == self.source.data_ptr() and tuple(x.shape) == self.shape
                and x.stride(0) == x.shape[1])


def gemv_s8_enabled(backend: Any) -> bool:
    """Whether this backend may run gemv_s8 at all: SM80+ (int8 mma.m16n8k32), `backend.gemv_s8` not "off",
    and the decode GEMV choice "auto" (the forced choices "mma" / "mma884" pin gemv_mma) unless gemv_s8 is "on"."""
    choice = getattr(backend, "gemv_s8", "auto")
    if choice == "off" or backend.loader.compile_arch < kernels.GEMV_S8_MIN_ARCH:
        return False
    return choice == "on" or getattr(backend, "gemv_kernel", "auto") == "auto"


def gemv_s8_ok(backend: Any, w: CudaLinear, rows: int) -> bool:
    """Whether a GEMV launch of `rows` (1..8) x rows on repacked rows `w` runs gemv_s8 (ptx/gemv_s8.cu) instead
    of gemv_mma: `gemv_s8_enabled`, under "auto" a format in GEMV_S8_AUTO_FORMATS (where it measured faster),
    and `gemv_s8_fits`."""
    if w.layout != "repacked" or not gemv_s8_enabled(backend):
        return False
    if getattr(backend, "gemv_s8", "auto") == "auto" and w.fmt not in GEMV_S8_AUTO_FORMATS:
        return False
    return gemv_s8_fits(backend, rows, w.in_features)


def gemv_s8w_ok(backend: Any, w: CudaLinear, rows: int) -> bool:
    """Whether a GEMV call of `rows` x rows on repacked rows `w` runs gemv_s8w (gemv_s8.cu: a warp per weight row,
    dp4a): one row only (a call of 9 rows runs the kernel of its first launch, gemv_s8 or gemv_mma, for both, so a
    call's rows share one kernel), `backend.gemv_s8_m1` "warp", and x's int8 copy (with GEMV_S8W_SMEM_PAD)
    fits the opt-in shared memory; under gemv_s8 "auto" every repacked format, gemv_s8 "on" wherever gemv_s8
    could run."""
    if rows != 1 or getattr(backend, "gemv_s8_m1", "warp") != "warp" or w.layout != "repacked":
        return False
    fits = _smem_fits(backend, kernels.gemv_s8w_smem_bytes(w.in_features))
    if getattr(backend, "gemv_s8", "auto") != "auto":
        return fits and gemv_s8_ok(backend, w, 1)
    return fits and gemv_s8_enabled(backend)


def gemv_s8_fits(backend: Any, rows: int, k: int) -> bool:
    """Whether x's int8 copy for `rows` x rows of width k fits the blocks' opt-in shared memory (Llama-3-8B's
    down_proj at 8 rows: 143 KB; SM86/89 allow 99 KB, A100 163 KB)."""
    return _smem_fits(backend, kernels.gemv_s8_smem_bytes(rows, k))


def _smem_fits(backend: Any, dynamic_smem: int) -> bool:
    """Whether `dynamic_smem` bytes and gemv_s8's static shared memory fit a block's opt-in limit."""
    return dynamic_smem + kernels.GEMV_MMA_STATIC_SMEM <= backend.loader.max_smem_optin


def gemv_s8_tile_rows(backend: Any, fmt: str, rows: int, k: int, x_per_launch: bool) -> int:
    """Weight rows per gemv_s8 block for a launch of `rows` x rows of width k on `fmt` rows, x quantized per launch
    or by every block: 32 at one row (the S8_M1 build), at 9-16 rows 16 (GEMV_S8_WIDE_TILE) or, for a k split, 32
    unless forced (GEMV_S8_KSPLIT_TILE), at 17-32 GEMV_S8_WIDE4_TILE's (k split too) unless forced and, under
    `backend.gemv_s8_tiles` "auto", 16 (kernels.GEMV_S8_NARROW_TILE: 3 blocks an SM, 24 warps, instead of 2 blocks
    of 32-row tiles) from 2 rows where x is quantized per launch (the builds that quantize x in every block spill at
    3 blocks' registers), 3 blocks' x copies and the 32-row build's static smem fit an SM (Llama-3-8B on the H200: k
    = 4,096 at every m, 14,336 at m = 2) and k <= GEMV_S8_NARROW_MAX_K[fmt], else 32; "32" / "16" force it from 2
    rows. H200 rows, session 18: at k = 4,096 16-row tiles 0-11% faster (Q8_0 14336x4096 at m = 8: 3% slower), at k
    = 14,336 and m = 2 Q4 2-6% faster, Q8_0 4% slower; at m = 8, k = 14,336 (x 143 KB: one block an SM) 12-25%
    slower. Both give y bit for bit."""
    choice = getattr(backend, "gemv_s8_tiles", "auto")
    wide, narrow = kernels.GEMV_MMA_TILES
    if rows < 2:
        return wide
    if rows > kernels.GEMV_S8_WIDE_ROWS:  # S8_NCOL = 4, one block an SM
        return kernels.GEMV_S8_WIDE4_TILE["GM_TILE_ROWS"] if choice == "auto" else int(choice)
    if rows > kernels.GEMV_MAX_ROWS:  # S8_NCOL = 2: 16-row tiles, or with a k split (one block an SM) 32
        if gemv_s8_fits(backend, rows, k):
            return kernels.GEMV_S8_WIDE_TILE["GM_TILE_ROWS"]
        return kernels.GEMV_S8_KSPLIT_TILE["GM_TILE_ROWS"] if choice == "auto" else int(choice)
    if choice != "auto":
        return int(choice)
    if not x_per_launch or k > GEMV_S8_NARROW_MAX_K.get(fmt, k):
        return wide
    fits = kernels.blocks_fit_sm(backend.loader.max_smem_optin,
                                 kernels.gemv_s8_smem_bytes(rows, k) + kernels.GEMV_MMA_STATIC_SMEM,
                                 kernels.GEMV_S8_NARROW_BLOCKS)
    return narrow if fits else wide


def gemv_s8_launch_rows(backend: Any, fmt: str, k: int, silu: bool = False) -> int:
    """x rows per gemv_s8 launch of a call on `fmt` rows of width k, where x is quantized per launch
    (`backend.gemv_s8_x` not "block"): GEMV_S8_MAX_ROWS (32, the S8_NCOL = 4 build), else GEMV_S8_WIDE_ROWS (16,
    S8_NCOL = 2: the weights read once for 16 rows instead of twice), each where its rows of x fit the opt-in
    shared memory whole or, without SwiGLU, in k ranges (`gemv_s8_k_ranges`), else GEMV_MAX_ROWS (8).
    `backend.gemv_s8_rows` (A/B runs): "auto" as above, "16" no 32-row launches, "whole" no k ranges, "8" 8-row
    launches only. Llama-3-8B on the H200: 32 at k = 4,096 (164 KB of x) and at k = 14,336 in three launches of a
    third of the k each (195 KB)."""
    choice = getattr(backend, "gemv_s8_rows", "auto")
    if choice == "8" or not gemv_s8_x_per_launch(backend, kernels.GEMV_S8_WIDE_ROWS, k):
        return kernels.GEMV_MAX_ROWS
    split_ok = not silu and choice != "whole"
    widths = (kernels.GEMV_S8_WIDE_ROWS,) if choice == "16" else (kernels.GEMV_S8_MAX_ROWS, kernels.GEMV_S8_WIDE_ROWS)
    for rows in widths:
        ranges = gemv_s8_k_ranges(backend, fmt, rows, k)
        if ranges is not None and (len(ranges) == 1 or split_ok):
            return rows
    return kernels.GEMV_MAX_ROWS


def gemv_s8_k_ranges(backend: Any, fmt: str, rows: int, k: int) -> list[tuple[int, int]] | None:
    """The ranges of 32-weight blocks [begin, end) of a gemv_s8 call's launches for `rows` x rows of width k on
    `fmt` rows: [(0, k / 32)] where x fits the shared memory whole; above 8 rows the fewest (<=
    GEMV_S8_MAX_KSPLITS) equal ranges of whole load groups (REPACK_GROUP_BLOCKS) whose x fits (the S8_KSPLIT
    launches, partial sums handed on in fp32); None where none does."""
    nb = k // 32
    if gemv_s8_fits(backend, rows, k):
        return [(0, nb)]
    if not kernels.GEMV_MAX_ROWS < rows <= kernels.GEMV_S8_MAX_ROWS:
        return None
    group = kernels.REPACK_GROUP_BLOCKS[fmt]
    for splits in range(2, kernels.GEMV_S8_MAX_KSPLITS + 1):
        per = -(-(nb // group) // splits) * group
        if gemv_s8_fits(backend, rows, per * 32):
            return [(b, min(nb, b + per)) for b in range(0, nb, per)]
    return None


def gemv_s8_x_per_launch(backend: Any, rows: int, k: int, block_max_x: int = GEMV_S8_BLOCK_MAX_X) -> bool:
    """Whether a gemv_s8 launch of `rows` x rows of width k has x quantized once by a quantize_s8 launch before
    it (S8_XG) rather than by every block: `backend.gemv_s8_x` "launch" / "block" force it; "auto" for >= 2
    rows or k > GEMV_S8_BLOCK_MAX_X (every block's quantization then costs more than the extra launch: Q4_1
    4096x14336 at m = 8 51.3 us per block vs 19.4 us per launch); gemv_s8w passes its own `block_max_x`."""
    choice = getattr(backend, "gemv_s8_x", "auto")
    if choice != "auto":
        return choice == "launch"
    return rows > 1 or k > block_max_x


def x_per_launch_of(backend: Any, kernel: str, rows: int, k: int) -> bool:
    """Whether the `kernel` ("gemv_s8w" or "gemv_s8") launch of `rows` x rows of width k reads x quantized
    once per launch (quantize_s8, or the kernel that wrote x: linear.attention_xq): gemv_s8_x_per_launch with
    gemv_s8w's own GEMV_S8W_BLOCK_MAX_X."""
    if kernel == "gemv_s8w":
        return gemv_s8_x_per_launch(backend, 1, k, GEMV_S8W_BLOCK_MAX_X)
    return gemv_s8_x_per_launch(backend, rows, k)


def s8_quantized_x(backend: Any, xr: torch.Tensor, spec: dict[str, int], smem: int,
                   norm_weight: torch.Tensor | None, eps: float, vec_ok: int,
                   per_launch: bool, ready: torch.Tensor | None = None) -> tuple[torch.Tensor | None,
                                                                                  torch.Tensor | None]:
    """(xq, norm) of a gemv_s8 / gemv_s8w launch on x rows `xr`: with `per_launch`, a quantize_s8 launch
    quantizes x (the norm with it) into a workspace the GEMV's blocks copy, and the GEMV gets no norm, or, given
    `ready` (x's bytes written by the kernel that produced x, `PendingXq`; never with a norm), that workspace;
    else (None, norm_weight): every block quantizes x itself."""
    if not per_launch:
        return None, norm_weight
    if ready is not None and norm_weight is None:
        return ready, None
    rows, k = xr.shape
    xq = torch.empty(smem, dtype=torch.uint8, device=xr.device)
    q = P.GemvParams(xr.data_ptr(), None, None, None, norm_weight.data_ptr() if norm_weight is not None else None,
                     xr.stride(0), 0, 0, rows, 0, k, vec_ok, eps, 0, xq.data_ptr())
    backend._launch("gemv_s8", "quantize_s8", spec, (-(-k // 2048), rows, 1), (256, 1, 1), 0, q)
    return xq, None


def gemv_s8_wide_block(backend: Any, spec: dict[str, int], smem: int, rows: int, per_launch: bool,
                       split: bool) -> bool:
    """Whether a gemv_s8 launch of `rows` x rows (build `spec`, `smem` bytes of x) runs 16 warps a block
    (kernels.GEMV_S8_WIDE_BLOCK) instead of 8: 2-8 rows quantized per launch in 32-row tiles, no k split, only
    one 8-warp block fits an SM (x's copy: Llama-3-8B's down at 6-8 rows), and x's copy fits beside the 16-warp
    block's larger static smem (kernels.GEMV_S8_WIDE_STATIC_SMEM: not Llama-3-8B's down at 4 rows on an SM86/89
    GPU's 99 KB), under `backend.gemv_s8_warps` "auto" (VOLTSERVE_GEMV_S8_WARPS; "8" never)."""
    if getattr(backend, "gemv_s8_warps", "auto") != "auto" or not 2 <= rows <= kernels.GEMV_MAX_ROWS:
        return False
    if not per_launch or split or spec.get("GM_TILE_ROWS", kernels.GEMV_MMA_TILES[0]) != kernels.GEMV_MMA_TILES[0]:
        return False
    if smem + kernels.GEMV_S8_WIDE_STATIC_SMEM > backend.loader.max_smem_optin:
        return False
    return backend._occupancy("gemv_s8", "gemv_s8", spec, smem, 32 * kernels.GEMV_MMA_WARPS) == 1


def gemv_s8_launch_spec(backend: Any, spec: dict[str, int], one_tile: bool = False) -> dict[str, int]:
    """The gemv_s8 launch's build: `spec`, whose load groups issued early are gemv_s8.cu's defaults (where x is
    copied in, 2-8 rows: both register buffers' of the next tile during a persistent block's epilogue, and of the
    first tile before the PDL wait where a block has several tiles) except on a grid of one tile a block
    (`one_tile`), which takes the build of one group (S8_NEXT_GROUPS 1: before session 46, whose loop order the
    two-group build changes: Q8_0 4096x14336 at 2 rows 34.4 against 32.0 us, H100); or under
    VOLTSERVE_GEMV_S8_PRELOAD (`backend.gemv_s8_preload`, A/B runs) "1" one everywhere, "2" both before the wait
    on every grid. The S8_KSPLIT launches (9-32 rows whose x does not fit whole) take S8_XWARP (each warp copies
    its own k range of x, no block barrier before the weight loop): `backend.gemv_s8_xcopy` "split"
    (VOLTSERVE_GEMV_S8_XCOPY; H100, session 48: 8B Q4_1 at batch 16 / 32 -1.4%, the k-split rows 3-7% faster),
    "warp" every launch copying x in (2-8 rows: the 8B step 1.9-3.7% slower), "block" none."""
    xg = bool(spec.get("S8_XG"))
    xcopy = getattr(backend, "gemv_s8_xcopy", "split")
    if xg and (xcopy == "warp" or (xcopy == "split" and spec.get("S8_KSPLIT"))):
        spec = {**spec, "S8_XWARP": 1}
    choice = getattr(backend, "gemv_s8_preload", "auto")
    if choice == "1" or (choice == "auto" and one_tile and xg):
        return {**spec, "S8_NEXT_GROUPS": 1}
    if choice == "2" and xg:
        return {**spec, "S8_WAIT_GROUPS": 2}
    return spec


def launch_gemv_s8w(backend: Any, x: torch.Tensor, w: CudaLinear, y: torch.Tensor,
                    norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, silu: bool,
                    vec_ok: int, ready: torch.Tensor | None = None, xq_for: CudaLinear | None = None) -> None:
    """The gemv_s8w launch of one x row (fusions as gemv_s8; x quantized as gemv_s8_x_per_launch picks, or
    `ready` as s8_quantized_x takes it): a grid of one output feature per warp, under `backend.gemv_s8_grid`
    "persistent" capped at the blocks the GPU holds at once (its warps then loop over the rest; x quantized once
    per block, not per 16 outputs), "full" uncapped (the hardware hands out the blocks as earlier ones finish).
    `xq_for` (SwiGLU only; `linear.swiglu_xq_target` picked it): the weight of the one-row gemv_s8w launch that
    reads y next, for which the launch also writes y quantized (`backend.xq_pending`, which that launch takes
    instead of its quantize_s8); its blocks then take 32 outputs at a time, at most GEMV_S8W_OUT_SLOTS times."""
    k = x.shape[1]
    n_out = y.shape[1]
    per_launch = x_per_launch_of(backend, "gemv_s8w", 1, k)
    pdl = gemv_pdl(backend, w, 1)  # against the launch before quantize_s8: the pair counts as one GEMV
    spec = kernels.gemv_s8_spec(w.fmt, silu, 1, False, per_launch)
    xq, norm = s8_quantized_x(backend, x, spec, kernels.gemv_s8_smem_bytes(1, k), norm_weight, eps, vec_ok,
                              per_launch, ready)
    smem = kernels.gemv_s8w_smem_bytes(k)
    warps = spec["S8W_WARPS"]
    threads = 32 * warps
    cap = backend.num_sms * backend._occupancy("gemv_s8", "gemv_s8w", spec, smem, threads) \
        if getattr(backend, "gemv_s8_grid", "persistent") == "persistent" else None
    if xq_for is not None and (not silu or n_out % 32 or cap is not None and
                               -(-n_out // (32 * cap)) > kernels.GEMV_S8W_OUT_SLOTS):
        xq_for = None  # more 32-output chunks a block than its smem slots: down quantizes x itself
    chunk = warps if xq_for is None else 32  # outputs a block takes at a time
    grid = -(-n_out // chunk) if cap is None else min(-(-n_out // chunk), cap)
    p = gemv_params(x, 0, w, y, residual, norm, eps, vec_ok, xq=xq)
    if xq_for is not None:
        xq_out = torch.empty(kernels.gemv_s8_smem_bytes(1, n_out), dtype=torch.uint8, device=y.device)
        p.xq_out, p.xq_out_fmt = xq_out.data_ptr(), kernels.WTYPES[xq_for.fmt]
    backend._launch("gemv_s8", "gemv_s8w", spec, (grid, 1, 1), (threads, 1, 1), smem, p, pdl)
    launched_gemv(backend, w)
    if xq_for is not None:
        backend.xq_pending = PendingXq(y, (1, n_out), xq_for, xq_out)


def launch_gemv_s8(backend: Any, x: torch.Tensor, w: CudaLinear, y: torch.Tensor,
                   norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, silu: bool,
                   vec_ok: int, one_pass: bool, ready: torch.Tensor | None = None) -> None:
    """gemv_s8 launches of <= gemv_s8_launch_rows x rows each (8, 16 or 32; fusions as gemv_mma), a 9-32-row
    launch whose x does not fit whole as one launch per k range (`gemv_s8_k_ranges`: each adds its fp32 sums to the
    previous ones' in a workspace, the last stores y with the residual); `residual` has y's row stride; `ready`: x
    [m, k] already quantized (s8_quantized_x) for a call of one launch. The grid: one block per tile, or under
    `backend.gemv_s8_grid` "persistent" at most the blocks the GPU holds at once, each looping over tiles (x
    quantized once per block instead of once per tile)."""
    m, k = x.shape
    n_out = y.shape[1]
    step = gemv_s8_launch_rows(backend, w.fmt, k, silu)
    for r0 in range(0, m, step):
        rows = min(step, m - r0)
        xr = x[r0:r0 + rows]
        per_launch = x_per_launch_of(backend, "gemv_s8", rows, k)
        pdl = gemv_pdl(backend, w, rows)  # against the launch before quantize_s8: the pair counts as one GEMV
        ranges = gemv_s8_k_ranges(backend, w.fmt, rows, k)
        assert ranges is not None, "gemv_s8_ok and gemv_s8_launch_rows pick only launches whose x fits"
        split = len(ranges) > 1
        tile = gemv_s8_tile_rows(backend, w.fmt, rows, k, per_launch)
        spec = kernels.gemv_s8_spec(w.fmt, silu, rows, one_pass, per_launch, tile, split)
        tiles = math.ceil(n_out / (tile // 2 if silu else tile))
        threads = 32 * kernels.GEMV_MMA_WARPS
        smem = kernels.gemv_s8_smem_bytes(rows, (ranges[0][1] - ranges[0][0]) * 32)  # the first range is the widest
        if gemv_s8_wide_block(backend, spec, smem, rows, per_launch, split):
            spec = kernels.gemv_s8_spec(w.fmt, silu, rows, one_pass, per_launch, tile, wide_block=True)
            threads = 32 * kernels.GEMV_S8_WIDE_BLOCK["GM_WARPS"]
        xq, norm = s8_quantized_x(backend, xr, spec, kernels.gemv_s8_smem_bytes(rows, k), norm_weight, eps, vec_ok,
                                  per_launch, ready if rows == m else None)
        grid = tiles
        if getattr(backend, "gemv_s8_grid", "persistent") == "persistent":
            grid = min(tiles, backend.num_sms * backend._occupancy("gemv_s8", "gemv_s8", spec, smem, threads))
        part = torch.empty(rows, n_out, dtype=torch.float32, device=x.device) if split else None
        for i, (kb0, kb1) in enumerate(ranges):
            p = gemv_params(xr, r0, w, y, residual, norm, eps, vec_ok, xq=xq)
            if split:
                p.part, p.kb_begin, p.kb_end = part.data_ptr(), kb0, kb1
                p.part_in, p.part_out = int(i > 0), int(i < len(ranges) - 1)
                pdl = gemv_pdl(backend, w, rows) if i else pdl
            backend._launch("gemv_s8", "gemv_s8", gemv_s8_launch_spec(backend, spec, grid >= tiles), (grid, 1, 1),
                            (threads, 1, 1), smem, p, pdl)
            launched_gemv(backend, w)
