"""Linear and embedding operands on the GPU (fp16 or raw GGUF blocks) and the GEMV / tiled-GEMM launchers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from voltserve.backends.cuda import kernels
from voltserve.backends.cuda import params as P


# gemv_q (x staged in smem, shared by 32 rows) from this row bucket up (m >= 3); below it the warp-per-row
# `gemv`, which measured as fast or faster at m = 1-2 on the H200 (docs/performance.md). Rows of one launch are
# bitwise independent of the other rows; results at m <= 2 and m >= 3 differ by fp32 summation order.
GEMV_Q_MIN_ROWS = 4


def _quant_upload(quant: Any, device: torch.device) -> tuple[str, torch.Tensor, int]:
    data = np.ascontiguousarray(quant.data, dtype=np.uint8)
    rows, cols = quant.shape
    row_bytes = cols // 32 * kernels.QUANT_BLOCK_BYTES[quant.qtype]
    if data.shape != (rows, row_bytes):
        raise ValueError(f"{quant.qtype} data {data.shape} does not match shape {quant.shape}")
    return quant.qtype, torch.from_numpy(data).to(device), row_bytes


@dataclass
class CudaLinear:
    """A linear weight on the device.

    Attributes:
        fmt: "F16", "Q4_0", "Q4_1" or "Q8_0".
        data: F16: [out_features, in_features] fp16; quant: [out_features, in_features / 32 * block_bytes] uint8,
            the GGUF blocks of each row as stored in the file.
        out_features, in_features: logical shape.
        row_bytes: bytes of one weight row.
    """

    fmt: str
    data: torch.Tensor
    out_features: int
    in_features: int
    row_bytes: int

    @classmethod
    def upload(cls, weight: torch.Tensor, quant: Any | None, device: torch.device) -> "CudaLinear":
        """fp16 copy of `weight`, or the raw blocks of `quant` when its type has a kernel (Q4_0/Q4_1/Q8_0)."""
        out_features, in_features = weight.shape
        if quant is not None and quant.qtype in kernels.QUANT_BLOCK_BYTES and in_features % 32 == 0:
            fmt, data, row_bytes = _quant_upload(quant, device)
            return cls(fmt, data, out_features, in_features, row_bytes)
        data = weight.detach().to(device, torch.float16).contiguous()
        return cls("F16", data, out_features, in_features, in_features * 2)


@dataclass
class CudaEmbedding:
    """A token embedding table on the device: fp16 [vocab, hidden] or Q8_0 rows (dequantized per lookup)."""

    fmt: str
    data: torch.Tensor
    vocab: int
    hidden: int
    row_bytes: int

    @classmethod
    def upload(cls, weight: torch.Tensor, quant: Any | None, device: torch.device) -> "CudaEmbedding":
        vocab, hidden = weight.shape
        if quant is not None and quant.qtype == "Q8_0" and hidden % 32 == 0:
            fmt, data, row_bytes = _quant_upload(quant, device)
            return cls(fmt, data, vocab, hidden, row_bytes)
        data = weight.detach().to(device, torch.float16).contiguous()
        return cls("F16", data, vocab, hidden, hidden * 2)


def _launch_gemm_tc(backend: Any, x: torch.Tensor, w: CudaLinear, y: torch.Tensor, wtype: int) -> None:
    """Quantized weights at m >= GEMM_MIN_ROWS: WMMA tiles, split-K when the tile grid is short of the SMs."""
    m, k = x.shape
    n = w.out_features
    bn, splits, k_split = kernels.gemm_tc_plan(m, n, k, backend.num_sms)
    part = counters = None
    if splits > 1:
        # workspace from torch's caching allocator (graph-capturable); counters are the backend's zeroed array,
        # each reset by the launch that used it
        tiles = math.ceil(n / bn) * math.ceil(m / kernels.GEMM_TC_BM)
        part = torch.empty(splits * tiles * kernels.GEMM_TC_BM * bn, dtype=torch.float32, device=x.device)
        counters = backend.gemm_counters
    p = P.GemmTcParams(x.data_ptr(), w.data.data_ptr(), y.data_ptr(), part.data_ptr() if part is not None else None,
                       counters.data_ptr() if counters is not None else None, x.stride(0), n, w.row_bytes, m, n, k,
                       k_split, splits, 0)
    grid = (math.ceil(n / bn), math.ceil(m / kernels.GEMM_TC_BM), splits)
    backend._launch("gemm_tc", "gemm_tc", {"WTYPE": wtype, "BN": bn}, grid, (128, 1, 1), 0, p)


def launch_linear(backend: Any, x: torch.Tensor, w: CudaLinear) -> torch.Tensor:
    """y = x @ W^T with our kernels: GEMV for up to 16 rows (in launches of <= 8), a GEMM above: `gemm_tc`
    (WMMA, ptx/gemm_tc.cu) for quantized weights, the SIMT `gemm_tiled` for fp16 weights.

    GEMV kernels (ptx/gemv.cu): quant weights with k % 256 == 0 and a row bucket >= GEMV_Q_MIN_ROWS ->
    `gemv_q`; fp16 weights and other quant shapes -> `gemv`.

    Args:
        backend: the CudaBackend (loader, stream).
        x: [m, in_features] fp16, CUDA, contiguous rows.
        w: the weight.
    Returns:
        [m, out_features] fp16.
    """
    m, k = x.shape
    n = w.out_features
    if w.fmt != "F16" and (x.stride(0) % 8 or x.data_ptr() % 16):
        x = x.contiguous()  # the quant paths read x as 16-byte vectors
    y = torch.empty(m, n, dtype=torch.float16, device=x.device)
    if m == 0 or n == 0:
        return y
    wtype = kernels.WTYPES[w.fmt]
    if m >= kernels.GEMM_MIN_ROWS and w.fmt != "F16" and w.data.data_ptr() % 4 == 0:
        _launch_gemm_tc(backend, x, w, y, wtype)
        return y
    if m >= kernels.GEMM_MIN_ROWS:
        p = P.GemmParams(x.data_ptr(), w.data.data_ptr(), y.data_ptr(), x.stride(0), n, w.row_bytes, m, n, k, 0)
        backend._launch("gemm_tiled", "gemm_tiled", {"WTYPE": wtype}, (math.ceil(n / 64), math.ceil(m / 64), 1),
                        (256, 1, 1), 0, p)
        return y
    vec_ok = int(k % 8 == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0)
    # gemv_q streams 16-byte-aligned 256-weight superblocks; other quant shapes take the simple `gemv`
    q_fast = w.fmt != "F16" and k % kernels.GEMV_Q_SUPERBLOCK == 0 and w.data.data_ptr() % 16 == 0
    for r0 in range(0, m, kernels.GEMV_MAX_ROWS):
        rows = min(kernels.GEMV_MAX_ROWS, m - r0)
        bucket = next(b for b in kernels.GEMV_ROW_BUCKETS if b >= rows)
        spec = {"WTYPE": wtype, "MROWS": bucket}
        p = P.GemvParams(x.data_ptr() + r0 * x.stride(0) * 2, w.data.data_ptr(), y.data_ptr() + r0 * n * 2,
                         x.stride(0), n, w.row_bytes, rows, n, k, vec_ok)
        if q_fast and bucket >= GEMV_Q_MIN_ROWS:
            backend._launch("gemv", "gemv_q", spec, (math.ceil(n / 32), 1, 1), (32 * kernels.GEMV_Q_WARPS, 1, 1),
                            kernels.gemv_q_smem_bytes(bucket, w.fmt), p)
        else:
            backend._launch("gemv", "gemv", spec, (math.ceil(n / 4), 1, 1), (128, 1, 1), 0, p)
    return y
