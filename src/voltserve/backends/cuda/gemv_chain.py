"""gemv_chain (ptx/gemv_chain.cu, SM90+): a decoder layer's one-row fp16 GEMVs after attention in one persistent
launch: o_proj (+ residual), gate_up (its RMSNorm folded in; the SwiGLU of its two halves), down (+ residual)
and optionally the linear after the next RMSNorm (the next layer's qkv, or the lm_head), all their weights
streamed through one shared-memory ring that does not drain between them. Opt-in: it measured slower than the
launches it replaces (docs/performance.md, session 15)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from voltserve.backends.cuda import kernels_tma
from voltserve.backends.cuda import params as P
from voltserve.backends.cuda.gemv_launch import launched_gemv
from voltserve.backends.cuda.gemv_tma import ring_block_smem, ring_blocks_fit, tma_ring

if TYPE_CHECKING:
    from voltserve.backends.cuda.linear import CudaLinear


@dataclass
class ChainLink:
    """One phase of a gemv_chain launch: y = x . W^T (scaled by 1 / rms(x) where W has its norm folded in,
    `CudaLinear.norm_folded`; silu_out: W a [gate; up] pair, y = silu(gate) * up, each rounded to fp16 as gemv's
    SwiGLU) (+ residual).

    Shapes: x [1, k] fp16, y and residual [1, n] fp16 ([1, n / 2] with silu_out), W [n, k] fp16 rows.
    """

    w: CudaLinear
    x: torch.Tensor
    y: torch.Tensor
    residual: torch.Tensor | None = None
    silu_out: bool = False


def gemv_chain_ok(backend: Any, weights: list[CudaLinear]) -> bool:
    """Whether one gemv_chain launch may run one-row GEMVs on `weights` in turn: `backend.gemv_chain`
    (VOLTSERVE_GEMV_CHAIN) "on", the decode GEMV choice "auto", SM90+ (compiled for it), at most
    P.CHAIN_MAX_PHASES fp16 weights of dense rows with k % GEMV_TMA_SPAN == 0 and 16-byte aligned data, and the
    ring, x and partials within one block's shared memory."""
    if getattr(backend, "gemv_chain", "off") != "on" or getattr(backend, "gemv_kernel", "auto") != "auto":
        return False
    if backend.loader.compile_arch < kernels_tma.GEMV_TMA_MIN_ARCH or not 0 < len(weights) <= P.CHAIN_MAX_PHASES:
        return False
    for w in weights:
        k = w.in_features
        if w.fmt != "F16" or w.row_bytes != 2 * k or k % kernels_tma.GEMV_TMA_SPAN or w.data.data_ptr() % 16:
            return False
    _, smem = kernels_tma.gemv_chain_plan([(w.out_features, w.in_features) for w in weights], backend.num_sms,
                                          tma_ring(backend))
    return ring_blocks_fit(backend, smem, 1)


def launch_gemv_chain(backend: Any, links: list[ChainLink], eps: float) -> None:
    """One gemv_chain launch running `links` in order (`gemv_chain_ok` on their weights), under PDL where the
    backend has it (the ring fills before the previous kernel ends).

    Raises:
        ValueError: a link whose x / y / residual does not match its weight (one row, 16-byte aligned x).
    """
    ring = tma_ring(backend)
    grid, smem = kernels_tma.gemv_chain_plan([(li.w.out_features, li.w.in_features) for li in links], backend.num_sms,
                                             ring)
    p = P.ChainParams()
    for i, li in enumerate(links):
        n, k = li.w.out_features, li.w.in_features
        n_out = n // 2 if li.silu_out else n
        if li.x.shape != (1, k) or li.y.shape != (1, n_out) or li.x.data_ptr() % 16 or (
                li.residual is not None and li.residual.shape != (1, n_out)):
            raise ValueError(f"gemv_chain phase {i}: x {tuple(li.x.shape)}, y {tuple(li.y.shape)} do not match "
                             f"its [{n}, {k}] weight (silu_out={li.silu_out})")
        p.phase[i] = P.ChainPhase(li.x.data_ptr(), li.w.data.data_ptr(), li.y.data_ptr(),
                                  0 if li.residual is None else li.residual.data_ptr(), n, k, int(li.w.norm_folded),
                                  int(li.silu_out))
    p.barrier = backend.chain_barrier.data_ptr()
    trace = getattr(backend, "chain_trace", None)  # profiling: [grid, CHAIN_MAX_PHASES, 8] int64 (.cu's chain_trace)
    p.trace = None if trace is None else trace.data_ptr()
    p.num_phases = len(links)
    p.stages, p.stage_spans = ring
    p.max_k = max(li.w.in_features for li in links)
    p.eps = eps
    backend._launch("gemv_chain", "gemv_chain", {}, (grid, 1, 1), (kernels_tma.GEMV_TMA_THREADS, 1, 1),
                    ring_block_smem(backend, smem, 1), p)
    launched_gemv(backend, links[-1].w)
