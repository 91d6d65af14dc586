"""Kernel registry: which source, params mirror and `-D` specialisations each op compiles with.

One place decides the defines (with kernels_tma.py, the SM90 TMA-ring GEMVs' part, which `engine_specializations`
imports), so the launchers (ops.py) and the AOT check (tools/build_ptx.py) compile exactly the same modules. No
cuda-python or torch import here.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

from voltserve.backends.cuda import params as P

WTYPES = {"F16": 0, "Q4_0": 1, "Q4_1": 2, "Q8_0": 3}
# bytes of one 32-weight GGUF block (ggml-common.h)
QUANT_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
GEMV_MAX_ROWS = 8          # x rows per GEMV launch (gemv_s8: up to GEMV_S8_MAX_ROWS); from GEMM_MIN_ROWS a GEMM runs
                           # (repacked quant rows on SM90+: past quant_gemv_max_rows)
GEMM_MIN_ROWS = 17
GEMV_ROW_BUCKETS = (1, 2, 4, 8)
SAMPLE_MAX_LOGPROBS = 20   # top alternatives per row of sample_topk_topp (SAMPLE_MAX_TOP in the .cu)
SAMPLE_MAX_VOCAB = 1 << 23  # fixed-point headroom of the top-p weights
SAMPLE_CHUNK = 1024 * 8  # sample_chunks: vocabulary entries a block (SAMPLE_THREADS x SAMPLE_UNROLL)
SAMPLE_CHUNK_PART_FLOATS = 8  # sample_chunks: a SampleChunk's 32 bytes
SAMPLE_MAX_CHUNKED_ROWS = 4096  # rows with arrival counters; more rows run one sample_chunks block a row
SAMPLE_BINS = 2048  # sample_chunks: a top-p row's weight histogram (2 x SAMPLE_THREADS)
SAMPLE_CANDIDATES = 2048  # sample_chunks: the crossing bin's tokens a top-p row lists (more: the row is read again)
GEMV_Q_WARPS = 8           # gemv_q: warps per block (they split k), 32 output features per block
GEMV_Q_PIECE = 2048        # gemv_q: k staged in shared memory at a time (GEMV_Q_WARPS * 256)
GEMV_Q_SUPERBLOCK = 256    # gemv_q needs k % 256 == 0 (rows of whole 16-byte-aligned 8-block superblocks)
GEMV_NORM_MAX_SMEM = 48 * 1024  # gemv's fused RMSNorm keeps m * k fp16 in smem; larger x takes rms_norm + gemv
GEMV_NORM_BLOCKS_PER_SM = 16  # gemv grid with a fused RMSNorm: each block normalizes x once, then grid-strides
GEMV_MMA_MIN_ARCH = 70     # gemv_mma: mma.sync.m8n8k4 on SM70, m16n8k16 on SM80+
GEMV_MMA_SB_MIN_ARCH = 80  # gemv_mma_sb: cp.async and m16n8k16
GEMV_MMA_CHUNK = 32        # gemv_mma needs k % 32 == 0 (whole GGUF blocks / 64-byte pieces of fp16 rows)
GEMV_MMA_TILES = (32, 16)  # gemv_mma: weight rows per block (SwiGLU: half gate rows, half the matching up rows)
GEMV_MMA_WARPS = 8         # gemv_mma(_sb): warps per block; they split k


# shared memory the GPU reserves per resident block (SM80+: 1 KB; an SM holds the opt-in maximum plus one reserve)
SMEM_RESERVED_PER_BLOCK = 1024


def blocks_fit_sm(max_smem_optin: int, smem_per_block: int, blocks: int) -> bool:
    """Whether `blocks` resident blocks of `smem_per_block` bytes (static + dynamic; the per-block reserve is added
    here) fit one SM's shared memory: the opt-in maximum per block plus one reserve."""
    return (smem_per_block + SMEM_RESERVED_PER_BLOCK) * blocks <= max_smem_optin + SMEM_RESERVED_PER_BLOCK


# gemv_s8's 16-row tile build: 2 weight rows a lane, registers capped for 3 blocks an SM (78-80 used, by NVRTC
# version) instead of 127 and 2 blocks (gemv_int8.gemv_s8_tile_rows picks it; performance.md session 18)
GEMV_S8_NARROW_TILE = {"GM_TILE_ROWS": 16, "GM_MIN_BLOCKS": 3}
GEMV_S8_NARROW_BLOCKS = GEMV_S8_NARROW_TILE["GM_MIN_BLOCKS"]
# gemv_s8's launches of 9-16 x rows (S8_NCOL = 2: each weight fragment meets two 8-row groups of x, so the
# weights are read once for 16 rows; x quantized per launch only): 16-row tiles, 2 blocks an SM (106 registers for
# Q4_1 without spills on sm_90; the 32-row build spills at 128)
GEMV_S8_WIDE_ROWS = 16
GEMV_S8_WIDE_TILE = {"GM_TILE_ROWS": 16, "GM_MIN_BLOCKS": 2, "S8_NCOL": 2}
# ... and of 17-32 rows (S8_NCOL = 4: four 8-row groups of x per weight fragment) where 32 rows of x fit whole
# (k = 4,096: 164 KB, one block an SM; sm_90 registers: Q4 254 / Q8_0 177 with 32-row tiles, 141 / 105 with 16)
# or in k ranges (below)
GEMV_S8_MAX_ROWS = 32
GEMV_S8_WIDE4_TILE = {"GM_TILE_ROWS": 32, "GM_MIN_BLOCKS": 1, "S8_NCOL": 4}
# ... where 16 / 32 rows of x do not fit (Llama-3-8B's down_proj, k = 14,336: 287 / 574 KB), launches that each
# take a k range of whole load groups (S8_KSPLIT: fp32 partial sums handed on through a workspace, the last launch
# adds them and stores y): one block an SM, so 32-row tiles (registers up to 255), S8_NCOL 2 / 4
GEMV_S8_KSPLIT_TILE = {"GM_TILE_ROWS": 32, "GM_MIN_BLOCKS": 1, "S8_NCOL": 2, "S8_KSPLIT": 1}
GEMV_S8_KSPLIT4_TILE = {**GEMV_S8_KSPLIT_TILE, "S8_NCOL": 4}
GEMV_S8_MAX_KSPLITS = 4
# gemv_mma(_sb)'s static smem, at most: red + scratch (GM_NORM_ONE_PASS build) + inv_rms
GEMV_MMA_STATIC_SMEM = 4 * (GEMV_MMA_WARPS * 32 * 8 + 8 * 32 + 8)


def sample_chunk_count(vocab: int) -> int:
    """sample_chunks' blocks a row: ceil(vocab / SAMPLE_CHUNK)."""
    return -(-vocab // SAMPLE_CHUNK)


def gemv_mma_spec(fmt: str, silu: bool, norm_one_pass: bool = False,
                  tile_rows: int = GEMV_MMA_TILES[0], repacked: bool = False) -> dict[str, int]:
    """The -D set of gemv_mma.cu for a weight format; `norm_one_pass`: the build whose fused RMSNorm takes 1/rms
    of all x rows in one pass (GM_NORM_ONE_PASS, for norm launches of >= 2 rows); `tile_rows`: weight rows per
    block (GEMV_MMA_TILES; gemv_mma_sb has 32-row tiles only). Quant builds also get GM_SB_SMEM, which the .cu
    checks against its own stage layout (a drift between gemv_mma_sb_smem_bytes and SB_PITCH / SB_STAGES fails
    to compile). `repacked`: the build for repacked quant rows (WREPACK, backends/cuda/repack.py; its
    gemv_mma_sb is a stub, so it has no GM_SB_SMEM).

    Raises:
        ValueError: `tile_rows` not in GEMV_MMA_TILES, or `repacked` with fp16.
    """
    if tile_rows not in GEMV_MMA_TILES:
        raise ValueError(f"gemv_mma tile_rows must be one of {GEMV_MMA_TILES}, got {tile_rows}")
    spec = {"WTYPE": WTYPES[fmt], "SILU": int(silu)}
    if norm_one_pass:
        spec["GM_NORM_ONE_PASS"] = 1
    if tile_rows != GEMV_MMA_TILES[0]:
        spec["GM_TILE_ROWS"] = tile_rows
    if repacked:
        if fmt == "F16":
            raise ValueError("fp16 weights have no repacked layout")
        spec["WREPACK"] = 1
    elif fmt != "F16":
        spec["GM_SB_SMEM"] = gemv_mma_sb_smem_bytes(fmt)
    return spec


def gemv_spec(fmt: str, mrows: int, silu: bool, norm_post: bool = False) -> dict[str, int]:
    """The -D set of gemv.cu's kernels for a weight format and row bucket; `silu`: the SwiGLU build (gemv);
    `norm_post`: the fp16 build for weights with the RMSNorm folded in (NORM_POST, `CudaLinear.norm_folded`).

    Raises:
        ValueError: `norm_post` with a quant format.
    """
    spec = {"WTYPE": WTYPES[fmt], "MROWS": mrows, **({"SILU": 1} if silu else {})}
    if norm_post:
        if fmt != "F16":
            raise ValueError("norm_post is an fp16 build")
        spec["NORM_POST"] = 1
    return spec


def gemv_mma_tile_rows(weight_rows: int, weight_bytes: int, arch: int, num_sms: int,
                       blocks_per_sm: Callable[[], int]) -> int:
    """gemv_mma's block height for a weight of `weight_rows` rows ([gate; up] for SwiGLU: both halves) and
    `weight_bytes` bytes on an SM `arch` GPU: 16 on SM80+ (the m16n8k16 path, where it was measured) when the
    weight streams long enough to be bandwidth-bound (> GEMV_PDL_MAX_WEIGHT_BYTES)
    and its 16-row blocks all fit on the GPU at once (`num_sms` x `blocks_per_sm()`, the 16-row build's
    occupancy, asked only then: it compiles that build), else 32.

    Measured on the H200 (132 SMs, 2 blocks per SM), same process against the 32-row kernel: fp16 4096x4096
    m = 2 / 8 11.9 -> 10.7 / 12.3 -> 11.2 us, 4096x14336 + residual 32.1 -> 31.3 / 32.6 -> 32.0 us; Llama-3-8B
    steps at 2 / 8 sequences 5.25 -> 5.18 / 5.61 -> 5.55 ms. Where the 16-row blocks need a second wave they
    lose (6144-row qkv 19.4 -> 25.2 us, 28672-row gate_up 77 -> 85 us). On the default model's small weights
    (PDL launches) the single kernels got faster (Q4_1 576x576 m = 8 2.2 -> 1.6 us) but the 8-sequence step
    slower (10,370 -> 9,830 tok/s), so they keep 32. Resident warps, not balance, pay: 16-row blocks at 3 per SM
    (all resident, the same per-SM imbalance as 32-row) measured the same as 32-row on qkv. SM70 (V100, m8n8k4)
    keeps 32: not measured there.

    Raises:
        ValueError: `num_sms` or `blocks_per_sm()` < 1.
    """
    if num_sms < 1:
        raise ValueError(f"num_sms must be >= 1, got {num_sms}")
    if arch < GEMV_MMA_SB_MIN_ARCH or weight_bytes <= GEMV_PDL_MAX_WEIGHT_BYTES:
        return 32
    per_sm = blocks_per_sm()
    if per_sm < 1:
        raise ValueError(f"blocks_per_sm must be >= 1, got {per_sm}")
    return 16 if math.ceil(weight_rows / 16) <= num_sms * per_sm else 32


# repacked rows (repack.py): (scale bytes, quant bytes) of a block per format, and the blocks per 64-byte load
# group (quant.cuh RP_GROUP)
REPACK_FORMATS = {"Q4_0": (2, 16), "Q4_1": (4, 16), "Q8_0": (2, 32)}
REPACK_GROUP_BLOCKS = {f: 64 // qb for f, (_, qb) in REPACK_FORMATS.items()}


GEMV_S8_MIN_ARCH = 80  # gemv_s8: mma.m16n8k32 on int8
# decode calls on repacked quant rows run gemv_s8 launches (of <= GEMV_S8_MAX_ROWS rows each) up to this many x
# rows on SM90+ before the GEMM (dequant_f16 + cuBLAS) takes them (linear.gemv_max_rows); below SM90 the GEMM
# takes them from GEMM_MIN_ROWS as before (not measured there). H200, 8B step through CUDA graphs (session 21,
# performance.md), GEMV (32-row launches at k = 4,096, 16-row k-split pairs at 14,336) vs GEMM: Q4_1 32 rows
# 5.93-5.96 vs 10.65-10.67 ms, 64 rows 10.84 vs 11.25; Q8_0 32 rows 7.50-7.54 vs 10.67, 64 rows 13.99 vs 11.24
# (slower: Q8_0 stops at 32); Q4_0 follows Q4_1 (32 rows 6.57 vs 10.41 with 16-row launches; 64 not measured)
QUANT_GEMV_MAX_ROWS_SM90 = {"Q4_0": 64, "Q4_1": 64, "Q8_0": 32}


def quant_gemv_max_rows(arch: int, fmt: str) -> int:
    """The most x rows a call on repacked `fmt` rows (Q4_0 / Q4_1 / Q8_0) runs as gemv_s8 launches on a GPU of
    compute capability `arch` before the GEMM takes it: QUANT_GEMV_MAX_ROWS_SM90[fmt] on SM90+, GEMM_MIN_ROWS - 1
    below (and for any other format)."""
    return QUANT_GEMV_MAX_ROWS_SM90.get(fmt, GEMM_MIN_ROWS - 1) if arch >= 90 else GEMM_MIN_ROWS - 1
# gemv_s8w's warps per block (gemv_s8.cu S8W_WARPS; 32 warps an SM either way, 64 registers): Q4 rows in blocks
# of 16 quantize x in half as many blocks (session 17, H200: 8B Q4_1 step 2.110 / 2.129 -> 2.061 / 2.062 ms,
# 4096x4096 rows 5.9-6.1 -> 5.1 us); Q8_0 in 16-warp blocks measured 1-2% slower (step 2.650 / 2.698 -> 2.708 /
# 2.708 ms)
GEMV_S8W_WARPS = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 8}
# gemv_s8w's shared memory past x's int8 copy: a lane past its row's last piece (k / 32 not a multiple of 32 for
# Q4, of 16 for Q8_0) reads x at its piece's constant offset there and drops the product (<= 1,000 bytes past)
GEMV_S8W_SMEM_PAD = 1024
# gemv_s8 at 2-8 rows where one 8-warp block fits an SM (x's copy is large: Llama-3-8B's down at 6-8 rows): 16
# warps split k instead, one block an SM (126-127 registers, no spills), twice the loads in flight
GEMV_S8_WIDE_BLOCK = {"GM_WARPS": 16, "GM_MIN_BLOCKS": 1}
# its static smem: gemv_mma's with red[] for 16 warps (8 KB more)
GEMV_S8_WIDE_STATIC_SMEM = GEMV_MMA_STATIC_SMEM + 4 * (GEMV_S8_WIDE_BLOCK["GM_WARPS"] - GEMV_MMA_WARPS) * 32 * 8
# gemv_s8w SILU builds writing down's quantized x (linear.swiglu_xq_target): the most 32-output chunks a block may
# take (its smem slots, S8W_OUT_SLOTS)
GEMV_S8W_OUT_SLOTS = 8


def gemv_s8_spec(fmt: str, silu: bool, rows: int, norm_one_pass: bool = False,
                 x_per_launch: bool = False, tile_rows: int = GEMV_MMA_TILES[0],
                 k_split: bool = False, wide_block: bool = False) -> dict[str, int]:
    """The -D set of gemv_s8.cu (repacked quant rows, int8 MMAs) for a launch of `rows` x rows: S8_M1 for one
    row (with gemv_s8w's block, S8W_WARPS, from GEMV_S8W_WARPS), else GM_NORM_ONE_PASS with
    `norm_one_pass` (as gemv_mma_spec); `x_per_launch`: S8_XG, x quantized once by quantize_s8 (which then applies
    the norm: no one-pass build); `tile_rows` 16: GEMV_S8_NARROW_TILE (16-row tiles, 3 blocks an SM).

    9..GEMV_S8_WIDE_ROWS rows: GEMV_S8_WIDE_TILE (two 8-row groups of x per weight fragment, 16-row tiles);
    up to GEMV_S8_MAX_ROWS: GEMV_S8_WIDE4_TILE (four groups, `tile_rows` either); with `k_split`
    GEMV_S8_KSPLIT_TILE / GEMV_S8_KSPLIT4_TILE (a k range per launch, no SwiGLU; `tile_rows` 16 keeps its one
    block an SM with 16-row tiles); above 8 rows x is quantized per launch only. `wide_block` (2-8 rows, x per
    launch, 32-row tiles): GEMV_S8_WIDE_BLOCK, 16 warps splitting k in one block an SM, for launches whose x
    copy leaves room for one 8-warp block an SM only (gemv_int8.gemv_s8_wide_block).

    Raises:
        ValueError: fp16 weights (no int8 path), `rows` outside 1..GEMV_S8_MAX_ROWS, `tile_rows` not in
            GEMV_MMA_TILES, > 8 rows without `x_per_launch`, 9-16 rows (no k split) with 32-row tiles, or a
            k split of <= 8 rows or with SwiGLU, or `wide_block` outside 2-8 rows, without x per launch or
            with 16-row tiles.
    """
    if fmt not in QUANT_BLOCK_BYTES:
        raise ValueError(f"gemv_s8 takes quant weights, got {fmt}")
    if not 1 <= rows <= GEMV_S8_MAX_ROWS:
        raise ValueError(f"gemv_s8 launches take 1..{GEMV_S8_MAX_ROWS} x rows, got {rows}")
    if tile_rows not in GEMV_MMA_TILES:
        raise ValueError(f"gemv_s8 tile_rows must be one of {GEMV_MMA_TILES}, got {tile_rows}")
    if rows > GEMV_MAX_ROWS and not x_per_launch:
        raise ValueError(f"gemv_s8 launches of {rows} > {GEMV_MAX_ROWS} x rows need x quantized per launch")
    spec = {"WTYPE": WTYPES[fmt], "SILU": int(silu)}
    if k_split:
        if rows <= GEMV_MAX_ROWS or silu:
            raise ValueError(f"gemv_s8's k split takes {GEMV_MAX_ROWS + 1}..{GEMV_S8_MAX_ROWS} x rows and no "
                             f"SwiGLU, got {rows} rows, silu={silu}")
        tile = GEMV_S8_KSPLIT_TILE if rows <= GEMV_S8_WIDE_ROWS else GEMV_S8_KSPLIT4_TILE
        spec.update(tile, GM_TILE_ROWS=tile_rows)
    elif rows > GEMV_S8_WIDE_ROWS:
        spec.update(GEMV_S8_WIDE4_TILE, GM_TILE_ROWS=tile_rows)
    elif rows > GEMV_MAX_ROWS:
        if tile_rows != GEMV_S8_WIDE_TILE["GM_TILE_ROWS"]:
            raise ValueError(f"gemv_s8 launches of {rows} > {GEMV_MAX_ROWS} x rows without a k split take "
                             f"{GEMV_S8_WIDE_TILE['GM_TILE_ROWS']}-row tiles, got {tile_rows}")
        spec.update(GEMV_S8_WIDE_TILE)
    elif tile_rows != GEMV_MMA_TILES[0]:
        spec.update(GEMV_S8_NARROW_TILE)
    if rows == 1:
        spec["S8_M1"] = 1
        spec["S8W_WARPS"] = GEMV_S8W_WARPS[fmt]  # gemv_s8w's block (the S8_M1 build of gemv_s8 ignores it)
        if silu:
            spec["S8W_OUT_SLOTS"] = GEMV_S8W_OUT_SLOTS
    if wide_block:
        if not 2 <= rows <= GEMV_MAX_ROWS or not x_per_launch or tile_rows != GEMV_MMA_TILES[0] or k_split:
            raise ValueError(f"gemv_s8's 16-warp block takes 2..{GEMV_MAX_ROWS} x rows quantized per launch in "
                             f"{GEMV_MMA_TILES[0]}-row tiles, got {rows} rows, x_per_launch={x_per_launch}, "
                             f"tile_rows={tile_rows}, k_split={k_split}")
        spec.update(GEMV_S8_WIDE_BLOCK)
    if x_per_launch:
        spec["S8_XG"] = 1
    elif norm_one_pass and rows > 1:
        spec["GM_NORM_ONE_PASS"] = 1
    return spec


def gemv_s8_smem_bytes(rows: int, k: int) -> int:
    """Dynamic shared memory of gemv_s8 (mirrors gemv_s8.cu, s8_xq.cuh s8_cols): x quantized to int8, `rows` rows
    of k + 16 bytes, then the per-32 scales (d, s) as fp32 pairs, [k / 32] for one row, [k / 32][8] up to 8
    rows, [k / 32][16] up to 16 and [k / 32][32] above."""
    nb = k // 32
    cols = 1 if rows == 1 else 8 if rows <= GEMV_MAX_ROWS else 16 if rows <= GEMV_S8_WIDE_ROWS else 32
    return rows * (nb * 32 + 16) + nb * 8 * cols


def gemv_s8w_smem_bytes(k: int) -> int:
    """Dynamic shared memory of gemv_s8w: gemv_s8's for one x row of width k, then GEMV_S8W_SMEM_PAD bytes."""
    return gemv_s8_smem_bytes(1, k) + GEMV_S8W_SMEM_PAD


def gemv_mma_sb_smem_bytes(fmt: str) -> int:
    """Dynamic shared memory of gemv_mma_sb: per warp SB_STAGES (Q8_0: 3, Q4: 2) stages of 32 rows x one
    256-weight superblock (row pitch padded so the fragment reads are conflict-free; mirrors SB_PITCH and
    SB_STAGES in gemv_mma.cu)."""
    sb = 8 * QUANT_BLOCK_BYTES[fmt]
    pitch = sb if (sb // 4) % 8 == 4 else sb + 16
    return GEMV_MMA_WARPS * (3 if fmt == "Q8_0" else 2) * 32 * pitch


# gemm_tc (ptx/gemm_tc.cu): WMMA tiles of 64 rows x GEMM_TC_BN (32 or 64) outputs, k chunks of 64, split-K over
# the grid's z with a deterministic last-block reduction when the tile grid would leave SMs idle.
GEMM_TC_BM = 64
GEMM_TC_KC = 64
GEMM_TC_BNS = (32, 64)
GEMM_TC_MAX_SPLITS = 16
GEMM_TC_MAX_COUNTERS = 4096  # arrival counters per backend (tiles of one split-K launch)
GEMM_TC_SPLIT_MAX_M_TILES = 2  # gemm_tc_plan(per_m_tile): up to this many 64-row x tiles split k as at 64 rows
# Quantized weights at many x rows: dequant_f16 (ptx/gemm_tc.cu) writes fp16 rows, cuBLAS multiplies them
# (dequant_gemm.dequant_gemm_wanted: on weights of >= DEQUANT_GEMM_MIN_WEIGHTS, every GEMM on SM90+, from
# DEQUANT_GEMM_MIN_ROWS_PRE_SM90 rows below: dequant_gemm.dequant_gemm_min_rows), in
# equal chunks of at most DEQUANT_SCRATCH_BYTES of fp16 rows (Llama-3-8B's largest layer weight, gate_up's
# 224 MiB, in one: 64 MB chunks measured 14-15% slower), each a multiple of DEQUANT_CHUNK_ROWS rows (cuBLAS takes
# its fast kernels only on 16-byte aligned column slices of y). The scratch comes from torch's caching allocator,
# inside the engine's activation reserve (actors/build.py).
DEQUANT_GEMM_MIN_ROWS_PRE_SM90 = 256  # projected, not measured (dequant_gemm_min_rows)
DEQUANT_GEMM_MIN_WEIGHTS = 1 << 22
DEQUANT_SCRATCH_BYTES = 256 << 20
DEQUANT_CHUNK_ROWS = 128
DEQUANT_GROUPS = 4  # 8-weight groups per thread (DQ_GROUPS in gemm_tc.cu); blocks of 128 threads
ARGMAX_CHUNK = 4096  # argmax_logprob: vocabulary entries per block (256 threads)
ARGMAX_MAX_CHUNKS = 64
ARGMAX_MAX_ROWS = 4096  # rows with arrival counters; more rows take one 1024-thread block each
ATTN_MAX_COUNTERS = 1 << 16  # attn_decode: (sequence, KV head) pairs merged in-kernel; more take the reduce kernel


def gemm_tc_spec(wtype: int, bn: int, repacked: bool) -> dict[str, int]:
    """The -D set of one gemm_tc.cu build (gemm_tc and dequant_f16): weight format code, tile width, layout."""
    return {"WTYPE": wtype, "BN": bn, **({"WREPACK": 1} if repacked else {})}


def gemm_tc_plan(m: int, n: int, k: int, num_sms: int, per_m_tile: bool = True) -> tuple[int, int, int]:
    """(BN, splits, k_split) of one gemm_tc launch: aim for >= 2 blocks per SM.

    BN = 64 when 64-wide tiles alone give 2 blocks an SM (less re-reading of x), else 32. Split-K only while the
    tile grid is short of 2 * num_sms blocks; every split gets the same whole number of 64-wide k chunks and none
    is empty. `per_m_tile`: 65-128 rows (GEMM_TC_SPLIT_MAX_M_TILES x tiles: a mixed CUDA-graph step, 64 decode
    rows and a prompt bucket) take the k_split of a 64-row launch of the same weight, where that aim would split
    k half as finely, each block running twice the chunks one after another (the default model's gemm_tc
    launches +1.75 us each, session 26); where the 64-row launch does not split, neither plan does. Depends only
    on the arguments, so eager and graph-replayed launches split identically.
    """
    m_tiles = -(-m // GEMM_TC_BM)
    chunks = -(-k // GEMM_TC_KC)
    bn = 64 if -(-n // 64) * m_tiles >= 2 * num_sms else 32
    tiles = -(-n // bn) * m_tiles
    if per_m_tile and 1 < m_tiles <= GEMM_TC_SPLIT_MAX_M_TILES and tiles <= GEMM_TC_MAX_COUNTERS:
        k_split = gemm_tc_plan(GEMM_TC_BM, n, k, num_sms)[2]
        return bn, -(-k // k_split), k_split
    splits = 1
    if tiles < 2 * num_sms and tiles <= GEMM_TC_MAX_COUNTERS:
        splits = min(chunks, -(-2 * num_sms // tiles), GEMM_TC_MAX_SPLITS)
    per_split = -(-chunks // splits)
    splits = -(-chunks // per_split)
    return bn, splits, per_split * GEMM_TC_KC


GEMV_PREFETCH_L2_BYTES = 8 << 20  # gemv under PDL: L2 prefetch of the first weight rows, all warps together
# GEMVs over this (~4 us of HBM and up) are bandwidth-bound: no PDL right after another one (gemv_launch.gemv_pdl),
# 16-row gemv_mma tiles where they fit one wave (gemv_mma_tile_rows)
GEMV_PDL_MAX_WEIGHT_BYTES = 16 << 20


def gemv_prefetch_bytes(first_rows: int, row_bytes: int, budget: int = GEMV_PREFETCH_L2_BYTES) -> int:
    """Leading bytes of each of a gemv launch's `first_rows` weight rows (the rows its warps take first) to
    prefetch into L2 before the previous kernel ends: whole rows while they fit `budget` bytes together
    (small models: the whole weight), else an equal share in 128-byte lines. Measured on the default model (H200,
    batch 1): 0.75 ms per step with an 8 MB budget, 0.81 ms with 32 MB, 0.81 ms without the prefetch."""
    share = budget // max(first_rows, 1)
    return min(row_bytes, share) // 128 * 128


def gemv_q_smem_bytes(mrows: int, fmt: str) -> int:
    """Dynamic shared memory of gemv_q: fp32 x piece [mrows][2048], the warps' partial sums [8][mrows][32] and
    one [32 rows][pitch] tile of 16-byte vectors per warp (pitch = superblock vectors rounded up to odd)."""
    pitch = (8 * QUANT_BLOCK_BYTES[fmt] // 16) | 1
    return 4 * mrows * GEMV_Q_PIECE + 4 * GEMV_Q_WARPS * mrows * 32 + GEMV_Q_WARPS * 32 * pitch * 16


@dataclass(frozen=True)
class KernelSource:
    """A `ptx/` source file, its kernels and its params mirror.

    Attributes:
        file: name in `ptx/`.
        kernels: `extern "C"` kernel names in the file.
        params: ctypes mirror of the file's params struct.
        size_define: the `-D` name the struct's static_assert checks.
        extra_sizes: further (define, ctypes struct) size checks (structs the kernel reads from device arrays).
    """

    file: str
    kernels: tuple[str, ...]
    params: type[ctypes.Structure]
    size_define: str
    extra_sizes: tuple[tuple[str, type[ctypes.Structure]], ...] = ()


SOURCES = {
    "embedding": KernelSource("embedding.cu", ("embedding_f16", "embedding_q8_0"), P.EmbeddingParams,
                              "VOLT_EMBEDDING_PARAMS_BYTES"),
    "rmsnorm": KernelSource("rmsnorm.cu", ("rms_norm",), P.RmsNormParams, "VOLT_RMSNORM_PARAMS_BYTES"),
    "rope_kv": KernelSource("rope_kv.cu", ("rope_kv_write",), P.RopeKvParams, "VOLT_ROPE_KV_PARAMS_BYTES"),
    "silu_mul": KernelSource("silu_mul.cu", ("silu_mul",), P.SiluMulParams, "VOLT_SILU_MUL_PARAMS_BYTES"),
    "attention_decode": KernelSource("attention_decode.cu", ("attn_decode", "attn_decode_reduce"),
                                     P.DecodeParams, "VOLT_DECODE_PARAMS_BYTES"),
    "attention_prefill": KernelSource("attention_prefill.cu", ("attn_prefill",), P.PrefillParams,
                                      "VOLT_PREFILL_PARAMS_BYTES"),
    "gemv": KernelSource("gemv.cu", ("gemv", "gemv_q"), P.GemvParams, "VOLT_GEMV_PARAMS_BYTES"),
    "gemv_mma": KernelSource("gemv_mma.cu", ("gemv_mma", "gemv_mma_sb"), P.GemvParams, "VOLT_GEMV_PARAMS_BYTES"),
    "gemv_tma": KernelSource("gemv_tma.cu", ("gemv_tma",), P.GemvParams, "VOLT_GEMV_PARAMS_BYTES"),
    "gemv_chain": KernelSource("gemv_chain.cu", ("gemv_chain",), P.ChainParams, "VOLT_CHAIN_PARAMS_BYTES"),
    "gemv_tma_s8": KernelSource("gemv_tma_s8.cu", ("gemv_tma_s8",), P.GemvParams, "VOLT_GEMV_PARAMS_BYTES"),
    "gemv_s8": KernelSource("gemv_s8.cu", ("gemv_s8", "quantize_s8", "gemv_s8w"), P.GemvParams,
                            "VOLT_GEMV_PARAMS_BYTES"),
    "gemm_tiled": KernelSource("gemm_tiled.cu", ("gemm_tiled",), P.GemmParams, "VOLT_GEMM_PARAMS_BYTES"),
    "gemm_tc": KernelSource("gemm_tc.cu", ("gemm_tc", "dequant_f16"), P.GemmTcParams, "VOLT_GEMM_TC_PARAMS_BYTES"),
    "sampling": KernelSource("sampling.cu", ("argmax_logprob",), P.ArgmaxParams, "VOLT_ARGMAX_PARAMS_BYTES"),
    "sample_topk_topp": KernelSource("sample_topk_topp.cu", ("sample_topk_topp", "philox4x32_10_test"),
                                     P.SampleParams, "VOLT_SAMPLE_PARAMS_BYTES",
                                     (("VOLT_SAMPLE_ROW_BYTES", P.SampleRowParams),)),
    "sample_chunks": KernelSource("sample_chunks.cu", ("sample_chunks",), P.SampleParams, "VOLT_SAMPLE_PARAMS_BYTES",
                                  (("VOLT_SAMPLE_ROW_BYTES", P.SampleRowParams),)),
}


def defines(op: str, **spec: int) -> dict[str, int]:
    """The `-D` set of one specialisation of `op`: the params size check plus `spec` (HEAD_DIM=64, ...)."""
    src = SOURCES[op]
    extra = {name: ctypes.sizeof(struct) for name, struct in src.extra_sizes}
    return {src.size_define: ctypes.sizeof(src.params), **extra, **spec}


DECODE_WARPS = 4  # attn_decode: 128 threads per block (NUM_THREADS in attention_decode.cu)
DECODE_BLOCKS_PER_SM = 4  # attn_decode: resident blocks per SM where the backend does not ask the driver
DECODE_PARTITION = 4096  # attn_decode: most keys per split
DECODE_WAVE_FILL = 0.95  # attn_decode: the share of a grid's block slots the split count aims to fill
DECODE_MIN_PART = 64  # attn_decode: fewest keys per split while the (KV head, sequence) pairs leave SMs idle


@functools.lru_cache(maxsize=4096)
def decode_plan(max_seq_len: int, num_seqs: int, num_kv_heads: int, partition: int,
                num_sms: int, blocks_per_sm: int = DECODE_BLOCKS_PER_SM,
                min_part: int = DECODE_MIN_PART) -> tuple[int, int]:
    """(num_splits, min_part) of attn_decode for a grid sized by `max_seq_len` (the capacity under CUDA graphs).

    At least ceil(max_seq_len / partition) splits (each sequence's keys fit) and at most one per min_part keys;
    among those, the fewest whose (KV head, sequence, split) blocks fill >= DECODE_WAVE_FILL of the block slots
    of the waves they take (`blocks_per_sm`, the kernel's occupancy, x num_sms per wave), else the best-filling
    (a grid short of one wave: the most splits). A grid of 1.9 waves ran at 0.74 of copy bandwidth where one
    full wave of longer splits ran at 0.85 (H200, 16 x 4096 keys); more, shorter splits add per-split cost. The
    kernel spreads each context evenly over the splits (split_len in attention_decode.cu), so short contexts use
    many blocks.
    min_part (the fewest keys per split, DECODE_MIN_PART unless given; a multiple of 16) bounds the per-split
    fixed cost (block-table and q loads, the partial's write and merge), which dominates a split of a few keys.
    Memoised: it runs per layer.
    """
    base = max(1, -(-max_seq_len // partition))
    min_part = min(min_part, partition)
    busy = num_kv_heads * num_seqs
    if busy <= 0:
        return base, min_part
    resident = max(1, blocks_per_sm * num_sms)
    best, best_fill = base, 0.0
    for splits in range(base, max(base, min(-(-max_seq_len // min_part), partition)) + 1):
        waves = busy * splits / resident
        fill = waves / math.ceil(waves)  # share of the launched waves' block slots that hold work
        if fill >= DECODE_WAVE_FILL:
            return splits, min_part
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best, min_part


@functools.lru_cache(maxsize=64)
def decode_split_table(capacity: int, num_seqs: int, num_kv_heads: int, partition: int, num_sms: int,
                       blocks_per_sm: int = DECODE_BLOCKS_PER_SM, min_part: int = DECODE_MIN_PART) -> tuple[int, ...]:
    """attn_decode's split count per longest context for a grid sized for `capacity` keys (CUDA graphs): entry i
    is `decode_plan`'s for a longest context of (i + 1) * min_part keys (min_part capped at `partition`), i.e. for
    every context in (i * min_part, (i + 1) * min_part], capped at the grid's own count. Each graph step takes
    entry (longest - 1) // min_part (`CudaBackend.graph_decode_splits` -> `AttentionMetadata.decode_splits`), so a
    graph captured for the model's whole context splits as its step needs: without it, 512-key contexts at 64
    sequences of Llama-3-8B took 8 splits of 64 keys (in a grid of 32) and a merge instead of one split (H200,
    Q4_1, max_model_len 131,072: 12.4 -> 11.3 ms a step, 11.1 at a capacity just above the contexts;
    tools/bench_decode.py --max-model-len). The cap at the grid's count is a guard: decode_plan grows with the
    context, so it does not bind.

    decode_plan depends on the context only through ceil(context / partition) and ceil(context / min_part), and
    min_part divides partition, so one entry per min_part keys is exact.

    Raises:
        ValueError: capacity < 1.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    plan = decode_plan.__wrapped__  # thousands of contexts: not through (and out of) the per-layer memo
    grid, part = plan(capacity, num_seqs, num_kv_heads, partition, num_sms, blocks_per_sm, min_part)
    return tuple(min(grid, plan(i * part, num_seqs, num_kv_heads, partition, num_sms, blocks_per_sm, min_part)[0])
                 for i in range(1, -(-capacity // part) + 1))


def decode_smem_bytes(head_dim: int, group: int, block_size: int, partition: int) -> int:
    """Dynamic shared memory of attn_decode (mirrors the layout in attention_decode.cu): q, the warps' partial
    outputs and their running max / sum, the split's block-table slice."""
    return 4 * (group * head_dim + DECODE_WARPS * group * head_dim + DECODE_WARPS * group * 2 +
                partition // block_size + 2)


def decode_max_merged_splits(head_dim: int) -> int:
    """Most splits attn_decode merges in-kernel (the merge's split maxima and sums reuse the warps' partial-output
    smem: 2 floats per split and head)."""
    return DECODE_WARPS * head_dim // 2


def prefill_tile_slots(num_tokens: int, num_seqs: int) -> int:
    """attn_prefill's grid width: q-tile slots (16 query rows each) for any split of `num_tokens` query tokens
    into `num_seqs` sequences (sequence s's tiles start at slot query_start_loc[s] // 16 + s), so a CUDA graph's
    grid sized for its token capacity covers every step it replays."""
    return num_tokens // 16 + num_seqs


# The most prompt tokens (a step's tokens past one a sequence; a mixed CUDA graph's bucket P) of a step that
# attn_prefill takes with the fused rotary (CudaBackend.rope_attention): the short-prompt graphs, lone short
# prompts (since session 33). Each key tile rotates its new keys again, a cost that grows with the prompt: at 100
# tokens next to 64 decodes the fused step still gained 3.8%, a lone pp512 lost 3-8% (session 27); between them,
# and lone prompts of <= 65 tokens, it is unmeasured.
ROPE_PREFILL_MAX_TOKENS = 64


def rope_fused(mode: str, decode_only: bool, num_tokens: int, num_seqs: int) -> bool:
    """Whether CudaBackend.rope_attention runs a step's rotary and KV write inside the attention kernels
    (VOLTSERVE_ROPE_ATTN `mode`: auto, decode or off): decode-only steps unless off; under auto also every other
    step of <= ROPE_PREFILL_MAX_TOKENS prompt tokens, counted as the `num_tokens` past one a sequence (a mixed
    CUDA graph's bucket), mixed (`split_decode`: attn_decode for the one-token sequences) or not (attn_prefill
    alone: a lone short prompt). Since session 33 a one-sequence mixed graph fuses too: attn_decode leaves
    sequences of >= 2 query tokens at once. Verify steps whose rows run as decodes take the two launches whatever
    this says (CudaBackend._rows_as_decodes: rope_kv_write, then attn_decode over the rows)."""
    if decode_only:
        return mode != "off"
    return mode == "auto" and num_tokens - num_seqs <= ROPE_PREFILL_MAX_TOKENS


def prefill_smem_bytes(head_dim: int) -> int:
    """Dynamic shared memory of attn_prefill (BQ = 16 query rows, BK = 32 keys)."""
    return 4 * 16 * head_dim + 2 * 32 * (head_dim + 2) + 2 * 32 * head_dim


def decode_spec(head_dim: int, group: int, simt: bool = False, per_row: bool = False) -> dict[str, int]:
    """attn_decode's specialisation; `simt` forces the CUDA-core path (V100's) on SM80+ GPUs; `per_row`: the
    build whose grid runs over query rows (CudaBackend's rows as decodes: verify steps), a build of its own so
    decode steps run none of its code."""
    spec = {"HEAD_DIM": head_dim, "GROUP": group, "PARTITION": DECODE_PARTITION}
    if simt:
        spec["ATTN_SIMT"] = 1
    if per_row:
        spec["PER_ROW"] = 1
    return spec


# Specialisations the engine compiles for the model families it serves (head_dim 64 / 128, GQA groups 1-8).
ENGINE_HEAD_DIMS = (64, 128)
ENGINE_GROUPS = (1, 2, 3, 4, 5, 6, 7, 8)


def engine_specializations() -> list[tuple[str, dict[str, int]]]:
    """Every (op, spec) the engine may compile; tools/build_ptx.py compiles all of them."""
    from voltserve.backends.cuda.kernels_tma import gemv_tma_s8_spec, gemv_tma_spec  # it imports this module

    specs: list[tuple[str, dict[str, int]]] = [(op, {}) for op in ("embedding", "rmsnorm", "rope_kv",
                                                                  "silu_mul")]
    specs += [("attention_decode", decode_spec(d, g, per_row=r)) for d in ENGINE_HEAD_DIMS for g in ENGINE_GROUPS
              for r in (False, True)]
    specs += [("attention_prefill", {"HEAD_DIM": d}) for d in ENGINE_HEAD_DIMS]
    specs += [("gemv", gemv_spec(f, m, bool(s), bool(n))) for f in WTYPES for m in GEMV_ROW_BUCKETS
              for s in (0, 1) for n in (0, 1) if f == "F16" or not n]
    specs += [("gemv_mma", gemv_mma_spec(f, bool(s), bool(o), t, r))
              for r in (False, True) for f in WTYPES if not (r and f == "F16")
              for s in (0, 1) for o in (0, 1) for t in GEMV_MMA_TILES]
    specs += [("gemv_tma", gemv_tma_spec(bool(s), bool(n))) for s in (0, 1) for n in (0, 1)]
    specs += [("gemv_chain", {})]
    specs += [("gemv_tma_s8", gemv_tma_s8_spec(f)) for f in QUANT_BLOCK_BYTES]
    specs += [("gemv_s8", gemv_s8_spec(f, bool(s), r, o, g, t)) for f in QUANT_BLOCK_BYTES for s in (0, 1)
              for r, o, g, t in ((1, False, False, 32), (1, False, True, 32), (8, False, False, 32),
                                 (8, True, False, 32), (8, False, True, 32), (8, False, True, 16),
                                 (GEMV_S8_WIDE_ROWS, False, True, 16), (GEMV_S8_MAX_ROWS, False, True, 32),
                                 (GEMV_S8_MAX_ROWS, False, True, 16))]
    # the k-split launches as they run: x copied per warp (gemv_int8.gemv_s8_launch_spec)
    specs += [("gemv_s8", {**gemv_s8_spec(f, False, r, False, True, t, True), "S8_XWARP": 1})
              for f in QUANT_BLOCK_BYTES for t in GEMV_MMA_TILES for r in (GEMV_S8_WIDE_ROWS, GEMV_S8_MAX_ROWS)]
    specs += [("gemv_s8", gemv_s8_spec(f, bool(s), GEMV_MAX_ROWS, False, True, wide_block=True))
              for f in QUANT_BLOCK_BYTES for s in (0, 1)]
    specs += [("gemm_tiled", {"WTYPE": w}) for w in WTYPES.values()]
    specs += [("gemm_tc", gemm_tc_spec(w, bn, r)) for w in (1, 2, 3) for bn in GEMM_TC_BNS for r in (False, True)]
    specs += [("sampling", {"LOGITS_F16": f}) for f in (0, 1)]
    specs += [(op, {"LOGITS_F16": f}) for op in ("sample_topk_topp", "sample_chunks") for f in (0, 1)]
    return specs
