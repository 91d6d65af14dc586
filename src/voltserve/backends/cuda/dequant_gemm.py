"""Quantized GEMMs through fp16: `dequant_f16` (ptx/gemm_tc.cu) writes a Q4_0 / Q4_1 / Q8_0 weight's rows as fp16,
cuBLAS (torch.mm) multiplies x by them. At many x rows cuBLAS's tensor-core GEMM outruns gemm_tc's WMMA tiles by
more than the dequantized copy costs (4.6 bytes a weight moved instead of 0.6); `dequant_gemm_wanted` decides
per call (docs/performance.md, session 20)."""

from __future__ import annotations

import math
from typing import Any

import torch

from voltserve.backends.cuda import kernels
from voltserve.backends.cuda import params as P


def dequant_gemm_min_rows(arch: int) -> int:
    """Fewest x rows from which a large quantized weight's GEMM takes the dequant path on a GPU of compute
    capability `arch` (major * 10 + minor).

    SM90+: every GEMM (kernels.GEMM_MIN_ROWS), measured on the H200 (4.2 TB/s): faster than gemm_tc from 17
    sequences of decode (gemm_tc's 64-row tiles cost the same from 17 to 64 rows) and for 96-2,048-token
    prefills. Repacked rows that gemv_s8 takes reach the GEMM only past linear.gemv_max_rows (32-64 rows there).
    Below SM90, not measured: per weight the dequant path costs 4.6 bytes / bandwidth + 2 m / cuBLAS FLOP/s and
    gemm_tc 2 m_pad / its own FLOP/s (m_pad = m rounded up to 64); with V100's 900 GB/s and cuBLAS ~100 TFLOP/s
    against gemm_tc at ~40 (H200's ~85 scaled by SM count x clock) they cross at ~200 rows, A100's 2 TB/s at ~65, so
    kernels.DEQUANT_GEMM_MIN_ROWS_PRE_SM90 (256) keeps gemm_tc wherever the projection is unsure.
    """
    return kernels.GEMM_MIN_ROWS if arch >= 90 else kernels.DEQUANT_GEMM_MIN_ROWS_PRE_SM90


def dequant_gemm_wanted(backend: Any, m: int, w: Any) -> bool:
    """Whether a GEMM of m >= GEMM_MIN_ROWS x rows on the quantized weight `w` (a CudaLinear) takes the dequant
    path (`dequant_gemm`) rather than gemm_tc: from `dequant_gemm_min_rows(backend.loader.arch)` rows on weights of
    at least kernels.DEQUANT_GEMM_MIN_WEIGHTS (smaller ones, SmolLM2-135M's, measured no faster: the second launch
    costs what cuBLAS gains), unless `backend.quant_gemm` says "tc" / "dequant"."""
    choice = getattr(backend, "quant_gemm", "auto")
    if choice != "auto":
        return choice == "dequant"
    return (m >= dequant_gemm_min_rows(backend.loader.arch)
            and w.out_features * w.in_features >= kernels.DEQUANT_GEMM_MIN_WEIGHTS)


def dequantize_rows(backend: Any, w: Any, n0: int, out: torch.Tensor) -> torch.Tensor:
    """Rows [n0, n0 + out.shape[0]) of a quantized weight (GGUF or repacked rows) as fp16 in `out`, by one
    dequant_f16 launch (ptx/gemm_tc.cu): the values gemm_tc's tiles hold (each weight d * q (+ m) in fp32,
    rounded once to fp16).

    Args:
        w: a Q4_0 / Q4_1 / Q8_0 CudaLinear whose rows start 4-byte aligned.
        out: [rows, in_features] fp16, CUDA, contiguous, 16-byte aligned.
    Returns:
        out.
    Raises:
        ValueError: an fp16 weight, or `out` of another shape, dtype or layout, or rows past the weight's.
    """
    nc, k = out.shape
    if w.fmt == "F16" or k != w.in_features or n0 < 0 or n0 + nc > w.out_features:
        raise ValueError(f"dequantize_rows: rows [{n0}, {n0 + nc}) x {k} of a {w.fmt} weight of "
                         f"{w.out_features} x {w.in_features}")
    if out.dtype != torch.float16 or not out.is_contiguous() or out.data_ptr() % 16:
        raise ValueError("dequantize_rows: out must be contiguous, 16-byte aligned fp16")
    if nc == 0:
        return out
    spec = kernels.gemm_tc_spec(kernels.WTYPES[w.fmt], kernels.GEMM_TC_BNS[0], w.layout == "repacked")
    p = P.GemmTcParams(None, w.data.data_ptr() + n0 * w.row_bytes, out.data_ptr(), None, None, 0, k, w.row_bytes,
                       0, nc, k, 0, 0, 0)
    grid = (math.ceil(k / (8 * 128 * kernels.DEQUANT_GROUPS)), min(nc, 65535), 1)
    backend._launch("gemm_tc", "dequant_f16", spec, grid, (128, 1, 1), 0, p)
    return out


def dequant_chunk_rows(n: int, k: int) -> int:
    """Weight rows per chunk of `dequant_gemm`: n cut into the fewest equal chunks of at most
    kernels.DEQUANT_SCRATCH_BYTES of fp16 rows, each rounded up to a multiple of kernels.DEQUANT_CHUNK_ROWS (so
    every chunk's columns of y start 16-byte aligned; the last chunk may be shorter)."""
    align = kernels.DEQUANT_CHUNK_ROWS
    cap = max(align, kernels.DEQUANT_SCRATCH_BYTES // (2 * k) // align * align)
    chunks = -(-n // cap)
    per_chunk = -(-n // chunks)
    return min(n, -(-per_chunk // align) * align)


def dequant_gemm(backend: Any, x: torch.Tensor, w: Any, y: torch.Tensor) -> None:
    """y = x @ W^T for a quantized W: equal chunks of W's rows (`dequant_chunk_rows`) dequantized
    (`dequantize_rows`) into one scratch, each multiplied by cuBLAS (torch.mm) into its columns of y.
    x: [m, k] fp16, contiguous rows; y: [m, n] fp16, contiguous."""
    k, n = x.shape[1], w.out_features
    rows = dequant_chunk_rows(n, k)
    scratch = torch.empty(rows, k, dtype=torch.float16, device=x.device)  # caching allocator: graph-capturable
    for n0 in range(0, n, rows):
        nc = min(rows, n - n0)
        dequantize_rows(backend, w, n0, scratch[:nc])
        torch.mm(x, scratch[:nc].t(), out=y if nc == n else y[:, n0:n0 + nc])
