"""GGUF Q4_0 / Q4_1 / Q8_0 weight rows rearranged at load time for 16-byte loads ("repacked" rows).

A GGUF row is k / 32 blocks of 18 / 20 / 34 bytes (scale words, then the quants; ggml-common.h), so only every
eighth block (every fourth for Q4_1) starts 16-byte aligned, and a tensor-core GEMV lane that takes one k slot of a block (a quarter:
4 bytes of nibbles or 8 int8) issues a 2-4 byte load per block and row (~0.3 of the copy bandwidth on an H200,
bound by load wavefronts, docs/performance.md). A repacked row holds the same bytes in another order:

    [scales of blocks 0 .. nb-1][quant groups]        nb = k / 32, same row_bytes as the GGUF row
    scales: Q4_1 one u32 (d | m << 16) per block; Q4_0, Q8_0 one fp16 d per block
    quant group j: blocks G*j .. G*j + G-1 (G = 4 for Q4, 2 for Q8_0), 64 bytes; slot t (0..3) of block b
        (its quants' bytes P*t .. P*t + P-1, P = 4 for Q4, 8 for Q8_0) sits at 16 * t + P * (b % G)

so the lane of slot t reads its piece of G blocks with one 16-byte load, and 4 scales (2 for Q8_0) with one.
Needs k % 256 == 0 (whole groups; the quant groups start 16-byte aligned). gemv_mma, gemv_s8 / gemv_s8w and
gemm_tc read this layout when compiled with WREPACK=1 (ptx/quant.cuh); the CPU backend never sees it.
"""

from __future__ import annotations

import torch

from voltserve.backends.cuda.kernels import REPACK_FORMATS as FORMATS  # (scale, quant) bytes of a block
REPACK_K_MULTIPLE = 256


def _check(data: torch.Tensor, fmt: str, in_features: int) -> tuple[int, int, int]:
    if fmt not in FORMATS:
        raise ValueError(f"no repacked layout for {fmt!r}; expected one of {sorted(FORMATS)}")
    if in_features % REPACK_K_MULTIPLE:
        raise ValueError(f"repacked rows need in_features % {REPACK_K_MULTIPLE} == 0, got {in_features}")
    sb, qb = FORMATS[fmt]
    nb = in_features // 32
    if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != nb * (sb + qb):
        raise ValueError(f"{fmt} rows of {in_features} weights are uint8 [rows, {nb * (sb + qb)}], got "
                         f"{data.dtype} {tuple(data.shape)}")
    return sb, qb, nb


def repack_rows(data: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """GGUF rows -> repacked rows (module docstring), on data's device.

    Args:
        data: [rows, k / 32 * block_bytes] uint8, each row the GGUF blocks of one output feature.
        fmt: "Q4_0", "Q4_1" or "Q8_0".
        in_features: k.
    Returns:
        a new [rows, row_bytes] uint8 tensor, contiguous.
    Raises:
        ValueError: unknown format, k % 256 != 0 or a shape that does not match.
    """
    sb, qb, nb = _check(data, fmt, in_features)
    rows = data.shape[0]
    blocks = data.view(rows, nb, sb + qb)
    piece = qb // 4
    group = 16 // piece
    # quants [rows, nb, 4 slots, piece] -> [rows, nb / G, 4 slots, G blocks, piece]
    quants = blocks[:, :, sb:].reshape(rows, nb // group, group, 4, piece).transpose(2, 3)
    return torch.cat([blocks[:, :, :sb].reshape(rows, nb * sb), quants.reshape(rows, nb * qb)], dim=1).contiguous()


def unpack_rows(data: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """Repacked rows -> GGUF rows: the inverse of `repack_rows` (same arguments, same errors)."""
    sb, qb, nb = _check(data, fmt, in_features)
    rows = data.shape[0]
    piece = qb // 4
    group = 16 // piece
    scales = data[:, :nb * sb].reshape(rows, nb, sb)
    quants = data[:, nb * sb:].reshape(rows, nb // group, 4, group, piece).transpose(2, 3).reshape(rows, nb, qb)
    return torch.cat([scales, quants], dim=2).reshape(rows, nb * (sb + qb)).contiguous()
