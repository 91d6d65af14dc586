"""Kernel registry, the SM90 TMA-ring GEMVs' part: compile-time specs and launch plans of gemv_tma (fp16, one x
row), gemv_chain (a decoder layer's one-row fp16 GEMVs in one persistent launch) and gemv_tma_s8 (repacked quant
rows, int8 MMAs). Split from kernels.py, whose rules it shares; like it, no cuda-python or torch import here.
"""

from __future__ import annotations

import functools

from voltserve.backends.cuda import params as P
from voltserve.backends.cuda.kernels import QUANT_BLOCK_BYTES, REPACK_GROUP_BLOCKS, WTYPES, gemv_s8_smem_bytes

GEMV_TMA_MIN_ARCH = 90  # gemv_tma: cp.async.bulk into an mbarrier-tracked smem ring
GEMV_TMA_SPAN = 1024  # TMA_SPAN_HALVES: gemv_tma needs k % GEMV_TMA_SPAN == 0; a stage is whole 2 KB spans
GEMV_TMA_CONSUMERS = 8  # TMA_CONSUMERS: the ring's depth is a multiple of it
GEMV_TMA_MAX_STAGES = 32  # TMA_MAX_STAGES
GEMV_TMA_STAGE_SPANS = 4  # TMA_STAGE_SPANS: most 2 KB spans per stage (a consumer warp holds a stage in registers)
GEMV_TMA_RING = (16, 4)  # (stages, spans per stage): 16 x 8 KB = 128 KB, room beside attn_decode blocks on an SM
GEMV_TMA_THREADS = 32 * (GEMV_TMA_CONSUMERS + 1)


def gemv_tma_spec(silu: bool, norm_post: bool, blocks_per_sm: int = 1) -> dict[str, int]:
    """The -D set of gemv_tma.cu (fp16 weights, one x row): SwiGLU and the folded-norm builds, and the blocks per
    SM its registers are capped for (TMA_MIN_BLOCKS: 2 lets the next launch's block in beside this one)."""
    return {**({"SILU": 1} if silu else {}), **({"NORM_POST": 1} if norm_post else {}),
            **({"TMA_MIN_BLOCKS": blocks_per_sm} if blocks_per_sm != 1 else {})}


def gemv_tma_plan(n_out: int, k: int, silu: bool, num_sms: int,
                  ring: tuple[int, int] = GEMV_TMA_RING) -> tuple[int, int]:
    """(grid, dynamic smem bytes) of a gemv_tma launch: one block per SM (at most one per output feature), a ring
    of `ring` = (stages, 2 KB spans per stage), x as fp16 [k] and the partial sums [rows][k / GEMV_TMA_SPAN] fp32
    of the block's most weight rows (SwiGLU: gate and up).

    Raises:
        ValueError: stages not a multiple of GEMV_TMA_CONSUMERS up to GEMV_TMA_MAX_STAGES, spans outside
            1..GEMV_TMA_STAGE_SPANS, or k not a multiple of GEMV_TMA_SPAN.
    """
    stages, spans = ring
    if stages % GEMV_TMA_CONSUMERS or not 0 < stages <= GEMV_TMA_MAX_STAGES or not 0 < spans <= GEMV_TMA_STAGE_SPANS:
        raise ValueError(f"gemv_tma ring stages must be a multiple of {GEMV_TMA_CONSUMERS} up to "
                         f"{GEMV_TMA_MAX_STAGES} and spans in 1..{GEMV_TMA_STAGE_SPANS}, got {ring}")
    if k % GEMV_TMA_SPAN:
        raise ValueError(f"gemv_tma needs k % {GEMV_TMA_SPAN} == 0, got k = {k}")
    grid = max(1, min(num_sms, n_out))
    rows = -(-n_out // grid) * (2 if silu else 1)
    return grid, stages * spans * GEMV_TMA_SPAN * 2 + k * 2 + rows * (k // GEMV_TMA_SPAN) * 4


GEMV_CHAIN_MAX_GRID = 1024  # CHAIN_MAX_GRID in gemv_chain.cu
GEMV_CHAIN_BARRIER_QUANTUM = (P.CHAIN_MAX_PHASES - 1) * GEMV_CHAIN_MAX_GRID  # arrivals a launch adds


def gemv_chain_plan(phases: list[tuple[int, int]], num_sms: int,
                    ring: tuple[int, int] = GEMV_TMA_RING) -> tuple[int, int]:
    """(grid, dynamic smem bytes) of a gemv_chain launch over `phases` [(n, k)] (ptx/gemv_chain.cu): one block per
    SM, each streaming its share of every phase through one ring of `ring` = (stages, 2 KB spans per stage); x as
    fp16 [max k] and the partial sums of the phase with the most, [rows][k / GEMV_TMA_SPAN] fp32, after it.
    Memoised: gemv_chain_ok and the launch both ask it for every layer of every step.

    Raises:
        ValueError: no phases or more than P.CHAIN_MAX_PHASES, more SMs than GEMV_CHAIN_MAX_GRID, a k not a
            multiple of GEMV_TMA_SPAN, or a ring gemv_tma_plan rejects.
    """
    return _gemv_chain_plan(tuple((int(n), int(k)) for n, k in phases), num_sms, tuple(ring))


@functools.lru_cache(maxsize=256)
def _gemv_chain_plan(phases: tuple[tuple[int, int], ...], num_sms: int, ring: tuple[int, int]) -> tuple[int, int]:
    if not 0 < len(phases) <= P.CHAIN_MAX_PHASES:
        raise ValueError(f"gemv_chain takes 1..{P.CHAIN_MAX_PHASES} phases, got {len(phases)}")
    if not 0 < num_sms <= GEMV_CHAIN_MAX_GRID:
        raise ValueError(f"gemv_chain's grid barrier counts up to {GEMV_CHAIN_MAX_GRID} blocks, got {num_sms} SMs")
    for n, k in phases:
        gemv_tma_plan(n, k, False, num_sms, ring)  # gemv_tma's ring and k rules
    grid = num_sms
    ring_bytes = ring[0] * ring[1] * GEMV_TMA_SPAN * 2
    max_k = max(k for _, k in phases)
    # + 1 row: a SwiGLU phase's blocks own ceil(n / 2 / grid) gate rows and as many up rows
    partials = max((-(-n // grid) + 1) * (k // GEMV_TMA_SPAN) * 4 for n, k in phases)
    return grid, ring_bytes + max_k * 2 + partials


GEMV_TMA_S8_CONSUMERS = 16  # TS8_CONSUMERS in gemv_tma_s8.cu: consumer warps (one more issues the copies)
GEMV_TMA_S8_ROWS = 2  # TS8_ROWS: weight rows per MMA (A rows g and g + 8); a stage holds whole pairs
GEMV_TMA_S8_MAX_STAGES = 8  # TS8_MAX_STAGES
GEMV_TMA_S8_CHUNK_GROUPS = 8  # TS8_CHUNK_GROUPS: rows are whole chunks of 8 load groups (64 quant bytes each)
GEMV_TMA_S8_SLOT_BYTES = 32 << 10  # a ring stage's most bytes (one bulk copy): fewer, larger copies stream faster
GEMV_TMA_S8_RING_BYTES = 160 << 10  # the ring's most bytes


def gemv_tma_s8_spec(fmt: str, consumers: int = GEMV_TMA_S8_CONSUMERS) -> dict[str, int]:
    """The -D set of gemv_tma_s8.cu: the quant format and its consumer warps (the block has 32 (consumers + 1)
    threads)."""
    return {"WTYPE": WTYPES[fmt], "TS8_CONSUMERS": consumers}


def gemv_tma_s8_chunk(fmt: str) -> int:
    """Weights per gemv_tma_s8 chunk (8 load groups): its rows must be whole chunks (Q4: 1,024, Q8_0: 512).

    Raises:
        ValueError: a format without a repacked layout.
    """
    if fmt not in REPACK_GROUP_BLOCKS:
        raise ValueError(f"gemv_tma_s8 takes repacked Q4_0 / Q4_1 / Q8_0 rows, got {fmt}")
    return 32 * REPACK_GROUP_BLOCKS[fmt] * GEMV_TMA_S8_CHUNK_GROUPS


def gemv_tma_s8_ring(fmt: str, k: int) -> tuple[int, int]:
    """(stages, rows per stage) of gemv_tma_s8 for repacked `fmt` rows of width k: the most whole row pairs that
    fit GEMV_TMA_S8_SLOT_BYTES (at least one pair), then as many stages (<= GEMV_TMA_S8_MAX_STAGES, >= 2) as
    GEMV_TMA_S8_RING_BYTES holds.

    Raises:
        ValueError: an unknown format or rows of no whole chunks (`gemv_tma_s8_chunk`).
    """
    if k <= 0 or k % gemv_tma_s8_chunk(fmt):
        raise ValueError(f"gemv_tma_s8 takes repacked Q4_0 / Q4_1 / Q8_0 rows of whole chunks, got {fmt}, k = {k}")
    row_bytes = k // 32 * QUANT_BLOCK_BYTES[fmt]  # a repacked row holds the GGUF row's bytes
    pair = GEMV_TMA_S8_ROWS * row_bytes
    rows = max(1, GEMV_TMA_S8_SLOT_BYTES // pair) * GEMV_TMA_S8_ROWS
    stages = max(2, min(GEMV_TMA_S8_MAX_STAGES, GEMV_TMA_S8_RING_BYTES // (rows * row_bytes)))
    return stages, rows


def gemv_tma_s8_plan(fmt: str, n: int, k: int, num_sms: int, ring: tuple[int, int]) -> tuple[int, int]:
    """(grid, dynamic smem bytes) of a gemv_tma_s8 launch: one block per SM (at most one per output feature),
    `ring` = (stages, rows per stage) of whole repacked rows, x quantized (gemv_s8_smem_bytes at one row) and the
    partial sums [rows][chunks] fp32 of the block's most rows (the most parts a row can have).

    Raises:
        ValueError: stages outside 1..GEMV_TMA_S8_MAX_STAGES, rows per stage not a positive multiple of
            GEMV_TMA_S8_ROWS, rows of no whole chunks, or a format without a repacked layout.
    """
    stages, stage_rows = ring
    if not 0 < stages <= GEMV_TMA_S8_MAX_STAGES or stage_rows < GEMV_TMA_S8_ROWS or stage_rows % GEMV_TMA_S8_ROWS \
            or k <= 0 or k % gemv_tma_s8_chunk(fmt):
        raise ValueError(f"gemv_tma_s8 ring {ring} does not fit {fmt} rows of k = {k}: 1..{GEMV_TMA_S8_MAX_STAGES} "
                         f"stages of a positive multiple of {GEMV_TMA_S8_ROWS} rows, k % {gemv_tma_s8_chunk(fmt)} == 0")
    grid = max(1, min(num_sms, n))
    rows = -(-n // grid)
    row_bytes = k // 32 * QUANT_BLOCK_BYTES[fmt]  # a repacked row holds the GGUF row's bytes
    return grid, stages * stage_rows * row_bytes + gemv_s8_smem_bytes(1, k) + rows * (k // gemv_tma_s8_chunk(fmt)) * 4
