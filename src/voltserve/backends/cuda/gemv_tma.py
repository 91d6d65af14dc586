"""The SM90+ decode GEMVs that stream weights through a shared-memory ring of bulk copies: gemv_tma (fp16,
ptx/gemv_tma.cu) and gemv_tma_s8 (repacked quant rows, ptx/gemv_tma_s8.cu), their routing rules and launchers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from voltserve.backends.cuda import kernels, kernels_tma
from voltserve.backends.cuda.gemv_launch import gemv_params, launched_gemv

if TYPE_CHECKING:
    from voltserve.backends.cuda.linear import CudaLinear

# gemv_tma (fp16, one x row, SM90+) under VOLTSERVE_GEMV_TMA=folded: weights of at least this many bytes
GEMV_TMA_MIN_BYTES = 4 << 20

# gemv_tma's static smem, at most: the ring's mbarriers, the norm's scratch and 1 / rms (static_assert in the .cu)
GEMV_TMA_STATIC_SMEM = 1024


def gemv_tma_ok(backend: Any, w: CudaLinear, vec_ok: int, silu: bool = False) -> bool:
    """Whether a one-row GEMV on `w` (no fused norm weight; a folded norm is fine) runs gemv_tma: SM90+, fp16 rows
    of k % GEMV_TMA_SPAN == 0, x and the weight 16-byte aligned, the ring and partials within the opt-in shared
    memory, the decode GEMV choice "auto" (forced choices pin their kernels), and `backend.gemv_tma`
    (VOLTSERVE_GEMV_TMA): "folded" (the default) only weights with their RMSNorm folded in
    (`CudaLinear.norm_folded`), without SwiGLU, of >= GEMV_TMA_MIN_BYTES (Llama-3-8B's qkv and lm_head: the shapes
    where it measured faster inside the engine's step; docs/performance.md, sessions 9 and 10), "off" never, "on"
    wherever it can."""
    choice = getattr(backend, "gemv_tma", "folded")
    if choice == "off" or getattr(backend, "gemv_kernel", "auto") != "auto" or w.fmt != "F16":
        return False
    if backend.loader.compile_arch < kernels_tma.GEMV_TMA_MIN_ARCH or not vec_ok or w.data.data_ptr() % 16:
        return False
    k = w.in_features
    if k % kernels_tma.GEMV_TMA_SPAN or w.row_bytes != 2 * k:
        return False
    if choice == "folded" and (silu or not w.norm_folded or w.out_features * w.row_bytes < GEMV_TMA_MIN_BYTES):
        return False
    n_out = w.out_features // 2 if silu else w.out_features
    _, smem = kernels_tma.gemv_tma_plan(n_out, k, silu, backend.num_sms, tma_ring(backend))
    return gemv_tma_fits(backend, smem)


def gemv_tma_fits(backend: Any, smem: int) -> bool:
    """Whether `_tma_blocks(backend)` gemv_tma blocks of `smem` dynamic bytes fit one SM (`ring_blocks_fit`)."""
    return ring_blocks_fit(backend, smem, _tma_blocks(backend))


def ring_blocks_fit(backend: Any, smem: int, blocks: int) -> bool:
    """Whether `blocks` ring-kernel blocks of `smem` dynamic bytes (their static smem and the per-block reserve on
    top) fit one SM's shared memory (the opt-in maximum plus one reserve)."""
    return kernels.blocks_fit_sm(backend.loader.max_smem_optin, smem + GEMV_TMA_STATIC_SMEM, blocks)


def ring_block_smem(backend: Any, smem: int, blocks: int) -> int:
    """The dynamic smem a ring kernel's launch asks for: at least `smem`, and enough that at most `blocks` blocks
    fit an SM (its rows are split evenly over a grid of one block per SM: two blocks of one launch on an SM leave
    another idle)."""
    return max(smem, backend.loader.max_smem_optin // (blocks + 1) + 16)


def tma_ring(backend: Any) -> tuple[int, int]:
    """The ring of gemv_tma and gemv_chain, (stages, 2 KB spans per stage): `backend.gemv_tma_ring`
    (VOLTSERVE_GEMV_TMA_RING) or kernels_tma.GEMV_TMA_RING."""
    return getattr(backend, "gemv_tma_ring", kernels_tma.GEMV_TMA_RING)


def _tma_blocks(backend: Any) -> int:
    return getattr(backend, "gemv_tma_blocks", 1)


def launch_gemv_tma(backend: Any, x: torch.Tensor, w: CudaLinear, y: torch.Tensor,
                    residual: torch.Tensor | None, silu: bool, norm_post: bool, eps: float) -> None:
    """One gemv_tma launch for one x row (`gemv_tma_ok`); always under PDL where the backend has it: its ring fills
    before pdl_enter, so it gains most right after another GEMV."""
    n_out = y.shape[1]
    ring = tma_ring(backend)
    grid, smem = kernels_tma.gemv_tma_plan(n_out, w.in_features, silu, backend.num_sms, ring)
    blocks = _tma_blocks(backend)
    # with 2 blocks an SM the second place is meant for the next launch's block, but nothing keeps it for that:
    # where SMs free up unevenly, two blocks of one launch may share an SM
    smem = ring_block_smem(backend, smem, blocks)
    p = gemv_params(x, 0, w, y, residual, None, eps, 1)
    p.stages, p.stage_spans = ring
    backend._launch("gemv_tma", "gemv_tma", kernels_tma.gemv_tma_spec(silu, norm_post, blocks), (grid, 1, 1),
                    (kernels_tma.GEMV_TMA_THREADS, 1, 1), smem, p)
    launched_gemv(backend, w)


def gemv_tma_s8_ok(backend: Any, w: CudaLinear, rows: int, norm: bool = False, silu: bool = False) -> bool:
    """Whether a GEMV call of `rows` x rows on repacked rows `w` runs gemv_tma_s8 (ptx/gemv_tma_s8.cu):
    `backend.gemv_tma_s8` (VOLTSERVE_GEMV_TMA_S8) "on" (the default "off": it measured slower than gemv_s8 /
    gemv_s8w, docs/performance.md session 11), one row, no fused norm and no SwiGLU (builds it lacks), SM90+, rows
    of whole chunks (`kernels_tma.gemv_tma_s8_chunk`), the ring, x and the partials within the opt-in shared memory.
    "on" takes precedence over gemv_s8 / gemv_kernel choices (an A/B knob for this kernel alone)."""
    if getattr(backend, "gemv_tma_s8", "off") != "on" or rows != 1 or norm or silu or w.layout != "repacked":
        return False
    k = w.in_features
    if backend.loader.compile_arch < kernels_tma.GEMV_TMA_MIN_ARCH or k % kernels_tma.gemv_tma_s8_chunk(w.fmt):
        return False
    _, smem = kernels_tma.gemv_tma_s8_plan(w.fmt, w.out_features, k, backend.num_sms,
                                           kernels_tma.gemv_tma_s8_ring(w.fmt, k))
    return ring_blocks_fit(backend, smem, 1)


def launch_gemv_tma_s8(backend: Any, x: torch.Tensor, w: CudaLinear, y: torch.Tensor,
                       residual: torch.Tensor | None) -> None:
    """One gemv_tma_s8 launch for one x row (`gemv_tma_s8_ok`), under PDL where the backend has it (its ring
    fills before pdl_enter), one block per SM whatever its shared memory (as gemv_tma)."""
    ring = kernels_tma.gemv_tma_s8_ring(w.fmt, w.in_features)
    grid, smem = kernels_tma.gemv_tma_s8_plan(w.fmt, w.out_features, w.in_features, backend.num_sms, ring)
    smem = ring_block_smem(backend, smem, 1)
    p = gemv_params(x, 0, w, y, residual, None, 0.0, 1)
    p.stages, p.stage_spans = ring
    warps = getattr(backend, "gemv_tma_s8_warps", kernels_tma.GEMV_TMA_S8_CONSUMERS)
    backend._launch("gemv_tma_s8", "gemv_tma_s8", kernels_tma.gemv_tma_s8_spec(w.fmt, warps), (grid, 1, 1),
                    (32 * (warps + 1), 1, 1), smem, p)
    launched_gemv(backend, w)
