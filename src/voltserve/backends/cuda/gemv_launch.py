"""Shared pieces of the decode GEMV launchers: the params of a launch, whether x takes 16-byte loads, and the
PDL decision (which depends on the launch before)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from voltserve.backends.cuda import kernels
from voltserve.backends.cuda import params as P

if TYPE_CHECKING:
    from voltserve.backends.cuda.linear import CudaLinear


def vec_ok_of(x: torch.Tensor) -> int:
    """GemvParams.vec_ok of x [m, k] fp16: 16-byte-aligned rows of whole 8-element vectors."""
    return int(x.shape[1] % 8 == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0)


def gemv_params(xr: torch.Tensor, r0: int, w: CudaLinear, y: torch.Tensor, residual: torch.Tensor | None,
                norm_weight: torch.Tensor | None, eps: float, vec_ok: int, prefetch: int = 0,
                xq: torch.Tensor | None = None) -> P.GemvParams:
    """GemvParams of the decode-GEMV launch for x rows `xr` = rows [r0, r0 + len(xr)) of the call: y's (and the
    residual's, same row stride) rows from r0 on; `norm_weight` for a fused RMSNorm, `xq` gemv_s8's quantized x."""
    n_out = y.shape[1]
    return P.GemvParams(xr.data_ptr(), w.data.data_ptr(), y.data_ptr() + r0 * n_out * 2,
                        residual.data_ptr() + r0 * n_out * 2 if residual is not None else None,
                        norm_weight.data_ptr() if norm_weight is not None else None, xr.stride(0), n_out,
                        w.row_bytes, xr.shape[0], w.out_features, w.in_features, vec_ok, eps, prefetch,
                        xq.data_ptr() if xq is not None else None)


def launched_gemv(backend: Any, w: CudaLinear) -> None:
    """Record that the last launch streamed `w` (for the next gemv_pdl decision; `CudaBackend._launch` resets it)."""
    backend.last_launch_weight_bytes = w.out_features * w.row_bytes


def gemv_pdl(backend: Any, w: CudaLinear, rows: int) -> bool:
    """Whether a decode GEMV launch of `rows` x rows on `w` uses programmatic dependent launch (`backend.pdl`,
    SM90+).

    `backend.gemv_pdl` "auto": every one-row launch, and every launch of more rows but one whose weight and the
    previous launch's (`backend.last_launch_weight_bytes`) both exceed GEMV_PDL_MAX_WEIGHT_BYTES. After a short
    kernel (rms_norm, attention) the early start hides the launch and the first loads (8B shapes, H200, the
    unfused norm: qkv / o_proj / gate_up 1.3 / 1.5 / 0.5 us faster; tools/profile_step.py). After a large GEMV, a
    multi-row launch's blocks take the SM slots the primary frees first, unevenly (H100, session 39: the 8B step
    at 4 sequences 5.3-5.5% slower with PDL there, Q4_1 and Q8_0; at 2 sequences +2.5% / equal). One-row launches
    gain (session 39, H100, 8B step at batch 1 with PDL after large GEMVs too: Q4_1 -1.3%, Q8_0 -3.0%, fp16
    -0.3 to -0.8%; gemv_s8w alone at Q4_1 14336x4096 17.3 -> 15.2 us). Decided per launch, against the launch
    right before it (a call's second 8-row launch follows its first); gemv_s8's quantize_s8 + gemv_s8 pair counts
    as one launch, decided before quantize_s8. "small": PDL only for weights of at most GEMV_PDL_MAX_WEIGHT_BYTES
    (the rule of sessions <= 11). "on" / "off": every GEMV / none (A/B runs)."""
    choice = getattr(backend, "gemv_pdl", "auto")
    if not backend.pdl or choice == "off":
        return False
    small = w.out_features * w.row_bytes <= kernels.GEMV_PDL_MAX_WEIGHT_BYTES
    if choice == "small":
        return small
    return choice == "on" or rows == 1 or small or getattr(backend, "last_launch_weight_bytes", 0) <= \
        kernels.GEMV_PDL_MAX_WEIGHT_BYTES
