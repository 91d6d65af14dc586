"""Linear and embedding operands on the GPU (fp16 or raw GGUF blocks) and the GEMV / tiled-GEMM launchers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from voltserve.backends.cuda import kernels
from voltserve.backends.cuda import params as P
from voltserve.backends.cuda.dequant_gemm import dequant_gemm, dequant_gemm_wanted
from voltserve.backends.cuda.gemv_int8 import (GEMV_S8_AUTO_FORMATS, PendingXq, gemv_s8_launch_rows, gemv_s8_ok,
                                              gemv_s8w_ok, launch_gemv_s8, launch_gemv_s8w, x_per_launch_of)
from voltserve.backends.cuda.gemv_launch import gemv_params, gemv_pdl, launched_gemv, vec_ok_of
from voltserve.backends.cuda.gemv_tma import gemv_tma_ok, gemv_tma_s8_ok, launch_gemv_tma, launch_gemv_tma_s8
from voltserve.backends.cuda.repack import FORMATS as REPACK_FORMATS
from voltserve.backends.cuda.repack import REPACK_K_MULTIPLE, repack_rows


# gemv_q (x staged in smem, shared by 32 rows) from this row bucket up (m >= 3); below it the warp-per-row
# `gemv`, which measured as fast or faster at m = 1-2 on the H200 (docs/performance.md). Rows of one launch are
# bitwise independent of the other rows; results at m <= 2 and m >= 3 differ by fp32 summation order.
# Both are also the fallback of the tensor-core kernels (`gemv_mma`, `gemv_mma_sb`), which take the shapes and row
# counts `gemv_mma_ok` allows.
GEMV_Q_MIN_ROWS = 4
# gemv_mma / gemv_mma_sb (tensor cores; gemv_mma_sb SM80+) from this many x rows up, per weight format, where
# they measured faster than gemv / gemv_q at the Llama-3-8B shapes (H200, `bench_kernels.py --only decode_
# --gemv-kernel scalar,mma`, docs/performance.md): fp16 0.69-0.90 of copy bandwidth at m = 2-8 vs 0.17-0.73; quant through
# gemv_mma's narrow loads (~0.2-0.33) from m = 2 (Q4) or m >= 3 (Q8_0).
GEMV_MMA_MIN_ROWS = {"F16": 2, "Q4_0": 2, "Q4_1": 2, "Q8_0": 3}
# SM70 (V100, m8n8k4 path): from 3 rows (row buckets 4 and 8, where the scalar kernels fall to <= 0.5 of the
# bandwidth on the H200). Not measured on a V100: the path is verified for correctness only (on the H200, which
# runs m8n8k4 emulated, far slower than V100's native HMMA.884, so its speed there says nothing).
GEMV_MMA_SM70_MIN_ROWS = 3
# At m = 1 the mma kernels win only on weights that stream long enough to be bandwidth-bound (small ones, like
# the default model's, are launch-bound and keep gemv) and never with SwiGLU (gemv's fused gate_up streams
# faster: Q4_1 28672x4096 0.40 vs 0.33, fp16 0.80 vs 0.75): gemv_mma_sb on quant superblocks (Q4_1 4096x4096
# 0.34 vs 0.23, qkv + norm 0.26 vs 0.21), and gemv_mma for fp16 with the fused RMSNorm (qkv: 0.62 vs 0.51).
GEMV_MMA_M1_MIN_BYTES = 4 << 20
# fp16 weights above this size take their RMSNorm as a separate rms_norm launch (every row count): the norm pass
# in every block of the fused GEMV costs more than the launch. Llama-3-8B shapes (qkv 48 MB, gate_up 235 MB,
# lm_head 1 GB), H200, tools/profile_step.py: at 1 row qkv 18.2 -> 2.4 + 12.9 us, gate_up + SwiGLU 71.3 -> 1.7 +
# 55.7 us, the step 4.87 -> 4.29 ms (bench_decode.py); at 8 rows 5.66 -> 4.83 ms (with the 16-byte rms_norm;
# the old 2-byte one took ~10 us a launch, which had made the two equal at 1 row). Quant weights keep the fusion
# (8B Q4_1, 1 row: unfused layers 76.1 vs 74.0 us). The default model's weights are all far below (< 4 MB).
GEMV_NORM_FUSED_MAX_BYTES = 16 << 20
# Q8_0 weights wider than this stay GGUF under VOLTSERVE_QUANT_REPACK=auto unless gemv_s8 runs (repack_wanted)
REPACK_Q8_0_MAX_K = 4096


def can_repack(fmt: str, in_features: int) -> bool:
    """Whether rows of this format and width have a repacked layout (repack.py: Q4_0/Q4_1/Q8_0, k % 256 == 0)."""
    return fmt in REPACK_FORMATS and in_features % REPACK_K_MULTIPLE == 0


def repack_wanted(choice: str, arch: int, fmt: str, in_features: int, weight_bytes: int,
                  swiglu: bool = False, superblocks: bool = True, s8: bool = False) -> bool:
    """Whether a quant weight is stored repacked (`CudaBackend.quant_repack`, VOLTSERVE_QUANT_REPACK).

    Only on SM80+ (gemv_mma's m16n8k16 path; its SM70 m8n8k4 build with repacked rows spills registers and was
    never measured) and where `can_repack`. "off": never; "on": always there; "auto": where it measured faster
    (H200, Llama-3-8B shapes, docs/performance.md): weights of >= GEMV_MMA_M1_MIN_BYTES (the default model's
    small, launch-bound weights stay GGUF), not a SwiGLU pair (`swiglu`: at m = 1 the GGUF pair runs the scalar
    gemv's fused SwiGLU, 44.1 us vs gemv_mma's 53.4 us on 28672x4096 Q4_1), and Q8_0 wider than k = 4096 only
    where the GGUF rows could not take gemv_mma_sb instead (`superblocks`: its shared memory fits; 4096x14336
    Q8_0: 27.2 us through gemv_mma_sb vs 30.1 us repacked on the H200). `s8`: the backend runs gemv_s8 on this
    weight's repacked rows at every row count (`gemv_s8_enabled` and `gemv_s8_fits` at 8 rows), whose int8
    MMAs beat the GGUF pair's scalar SwiGLU at m = 1 (29.0 vs 45.1 us on 28672x4096 Q4_1), so then every
    weight of a format in GEMV_S8_AUTO_FORMATS and of >= GEMV_MMA_M1_MIN_BYTES is repacked. For Q8_0 (there
    since session 11) that repacks SwiGLU pairs and k = 14,336 too, which gemv_s8w then takes at one row: the 8B
    Q8_0 step 4.80 -> 2.83 ms at batch 1, 5.62 -> 4.54 ms at 8 with gemv_mma at 2-8 rows, 3.85 ms with gemv_s8
    there (H200, docs/performance.md session 11), though down_proj's own kernel rows at 2-8 rows on gemv_mma were
    ~2 us slower repacked."""
    if choice == "off" or arch < kernels.GEMV_MMA_SB_MIN_ARCH or not can_repack(fmt, in_features):
        return False
    if choice == "on":
        return True
    if s8 and fmt in GEMV_S8_AUTO_FORMATS:
        return weight_bytes >= GEMV_MMA_M1_MIN_BYTES
    return (weight_bytes >= GEMV_MMA_M1_MIN_BYTES and not swiglu
            and (fmt != "Q8_0" or in_features <= REPACK_Q8_0_MAX_K or not superblocks))


def _quant_upload(quant: Any, device: torch.device, repack: bool = False) -> tuple[str, torch.Tensor, int]:
    data = np.ascontiguousarray(quant.data, dtype=np.uint8)
    rows, cols = quant.shape
    row_bytes = cols // 32 * kernels.QUANT_BLOCK_BYTES[quant.qtype]
    if data.shape != (rows, row_bytes):
        raise ValueError(f"{quant.qtype} data {data.shape} does not match shape {quant.shape}")
    host = torch.from_numpy(data)
    if repack:  # on the host: the device never holds both layouts
        host = repack_rows(host, quant.qtype, cols)
    return quant.qtype, host.to(device), row_bytes


@dataclass
class CudaLinear:
    """A linear weight on the device.

    Attributes:
        fmt: "F16", "Q4_0", "Q4_1" or "Q8_0".
        data: F16: [out_features, in_features] fp16; quant: [out_features, in_features / 32 * block_bytes] uint8,
            the GGUF blocks of each row as stored in the file, or the same bytes repacked (`layout`).
        out_features, in_features: logical shape.
        row_bytes: bytes of one weight row.
        layout: quant rows as GGUF stores them ("gguf"), or "repacked" (backends/cuda/repack.py) for 16-byte
            loads: then only gemv_mma and gemm_tc read them (launch_linear routes there).
        unit_norm: fp16 weights with the RMSNorm before them folded in (W diag(g), `norm_folded`): [in_features]
            fp32 ones on the device, the weight of the plain RMSNorm that the GEMM path (prefill) runs first;
            None otherwise.
    """

    fmt: str
    data: torch.Tensor
    out_features: int
    in_features: int
    row_bytes: int
    layout: str = "gguf"
    unit_norm: torch.Tensor | None = None

    @property
    def norm_folded(self) -> bool:
        """The RMSNorm weight g of the norm before this linear is folded into it: only norm_linear reads it."""
        return self.unit_norm is not None

    @staticmethod
    def stays_quant(quant: Any | None, in_features: int) -> bool:
        """Whether `upload` keeps `quant`'s raw blocks (a format with kernels, whole 32-wide blocks) rather than
        an fp16 copy."""
        return quant is not None and quant.qtype in kernels.QUANT_BLOCK_BYTES and in_features % 32 == 0

    @classmethod
    def upload(cls, weight: torch.Tensor, quant: Any | None, device: torch.device,
               repack: bool = False, norm: torch.Tensor | None = None) -> "CudaLinear":
        """fp16 copy of `weight`, or the raw blocks of `quant` when its type has a kernel (Q4_0/Q4_1/Q8_0);
        `repack`: quant rows that `can_repack` are stored repacked (rearranged on the host before the copy);
        `norm` ([in_features] fp32, fp16 copies only): the RMSNorm weight g of the norm before this linear,
        folded in as fp16(W diag(g)) (rounded once, from the fp32 weight).

        Raises:
            ValueError: `norm` with a weight that stays quantized, or of the wrong length."""
        out_features, in_features = weight.shape
        if cls.stays_quant(quant, in_features):
            if norm is not None:
                raise ValueError("a norm weight folds into fp16 weights only")
            repack = repack and can_repack(quant.qtype, in_features)
            fmt, data, row_bytes = _quant_upload(quant, device, repack)
            return cls(fmt, data, out_features, in_features, row_bytes, "repacked" if repack else "gguf")
        if norm is None:
            data = weight.detach().to(device, torch.float16).contiguous()
            return cls("F16", data, out_features, in_features, in_features * 2)
        if norm.shape != (in_features,):
            raise ValueError(f"norm weight {tuple(norm.shape)} does not match in_features {in_features}")
        g = norm.detach().to(weight.device, torch.float32)
        data = torch.empty(out_features, in_features, dtype=torch.float16, device=device)
        for r0 in range(0, out_features, 4096):  # row pieces: no full fp32 copy of a large weight
            data[r0:r0 + 4096] = (weight[r0:r0 + 4096].detach().to(torch.float32) * g).to(device, torch.float16)
        ones = torch.ones(in_features, dtype=torch.float32, device=device)
        return cls("F16", data, out_features, in_features, in_features * 2, unit_norm=ones)


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
    bn, splits, k_split = kernels.gemm_tc_plan(m, n, k, backend.num_sms,
                                               getattr(backend, "gemm_tc_split", "rows") == "rows")
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
    spec = kernels.gemm_tc_spec(wtype, bn, w.layout == "repacked")
    backend._launch("gemm_tc", "gemm_tc", spec, grid, (128, 1, 1), 0, p)


def launch_linear(backend: Any, x: torch.Tensor, w: CudaLinear, *, norm_weight: torch.Tensor | None = None,
                  eps: float = 0.0, residual: torch.Tensor | None = None, silu: bool = False,
                  f16_gemm: str = "cublas", norm_post: bool = False, then: Any = None) -> torch.Tensor:
    """y = x @ W^T with our kernels, optionally fused with its neighbours in the decoder block.

    GEMV for up to `gemv_max_rows` rows (16; repacked quant rows on SM90+ 32-64, in gemv_s8 launches of 8, 16 or
    32; other launches of <= 8): `gemv_mma` / `gemv_mma_sb` (ptx/gemv_mma.cu, tensor cores)
    where `gemv_mma_ok`; else quant weights with k % 256 == 0 and a row bucket >= GEMV_Q_MIN_ROWS -> `gemv_q`, the rest
    -> `gemv` (ptx/gemv.cu). Above, a GEMM (`_gemm`). `gemv` and `gemv_mma` fuse all three options; `gemv_q` the
    norm and the residual; a fusion a kernel does not take runs as its own op (rms_norm / silu_mul / an fp16
    add), equal up to the fp32 summation order of 1/rms.

    Args:
        backend: the CudaBackend (loader, stream, rms_norm, silu_and_mul).
        x: [m, in_features] fp16, CUDA, contiguous rows.
        w: the weight; with `silu`, the fused [gate; up] weight (out_features = 2 * inner).
        norm_weight: [in_features] fp32 on the device: x is RMS-normalized (epsilon `eps`) and scaled first.
        norm_post: `w` has its RMSNorm folded in (`CudaLinear.norm_folded`; not with norm_weight): `gemv`
            (its NORM_POST build) scales the product by 1/rms(x); gemv_mma and the GEMM read x after an
            rms_norm launch with unit weights.
        residual: [m, out_features] fp16 added to the product (the output is a new tensor).
        silu: return silu(gate) * up, [m, out_features / 2].
        f16_gemm: fp16 weights at m >= GEMM_MIN_ROWS: "cublas" (torch) or "tiled" (ptx/gemm_tiled.cu).
        then: the linear the caller applies next to the output (with `silu`: down), which a one-row gemv_s8w
            launch may hand it quantized (`swiglu_xq_target`); a hint only.
    Returns:
        [m, out_features] fp16 (silu: [m, out_features / 2]).
    """
    m, k = x.shape
    n = w.out_features
    n_out = n // 2 if silu else n
    # x quantized by the kernel that wrote it (attention_xq), for this call only: taken whatever this call is
    pending, backend.xq_pending = getattr(backend, "xq_pending", None), None
    ready = pending.xq if pending is not None and norm_weight is None and not norm_post and \
        pending.matches(x, w) else None
    if residual is not None and (residual.shape != (m, n_out) or residual.stride(1) != 1):
        raise ValueError(f"residual {tuple(residual.shape)} does not match the output [{m}, {n_out}]")
    if norm_post != w.norm_folded or (norm_post and norm_weight is not None):
        raise ValueError("a weight with its norm folded in takes norm_post (and no norm_weight), others not")
    gemm = m > gemv_max_rows(backend, w, silu)
    if norm_post and (gemm or
                      gemv_mma_ok(backend, w, min(m, kernels.GEMV_MAX_ROWS), vec_ok_of(x), silu=silu)):
        # only gemv has the NORM_POST build: the GEMM and gemv_mma read x normalized by rms_norm (unit weights;
        # g is in W). gemv_mma's NORM_POST build, which summed x^2 in its main loop, spilled registers at the
        # 128-register bound and, re-reading x after the loop instead, lost to this at 8 rows (8B shapes, H200:
        # 4.96 / 4.86 ms per step against 4.68)
        x, _ = backend.rms_norm(x, w.unit_norm, eps)
        norm_post = False
    if norm_weight is not None and not gemm and not fuses_norm(backend, w):
        x, _ = backend.rms_norm(x, norm_weight, eps)
        norm_weight = None
    if w.fmt != "F16" and (x.stride(0) % 8 or x.data_ptr() % 16):
        # the quant paths read x as 16-byte vectors (a clone: contiguous() keeps a misaligned contiguous view)
        x = x.clone(memory_format=torch.contiguous_format)
        backend.last_launch_weight_bytes = 0  # the copy kernel is the launch before the GEMV (gemv_pdl)
    vec_ok = vec_ok_of(x)
    use_mma = not gemm and gemv_mma_ok(backend, w, min(m, kernels.GEMV_MAX_ROWS), vec_ok, norm_weight is not None,
                                       silu)
    # gemv_q streams 16-byte-aligned 256-weight superblocks; other quant shapes take the simple `gemv`
    q_fast = _whole_superblocks(w)
    if gemm or (silu and q_fast and m > 2 and not use_mma):
        # the GEMM (and gemv_q, for SwiGLU; quant only, so never norm_post) with the fusions it lacks as separate
        # ops
        if gemm:
            if norm_weight is not None:
                x, _ = backend.rms_norm(x, norm_weight, eps)
            y = _gemm(backend, x, w, f16_gemm)
        else:
            y = launch_linear(backend, x, w, norm_weight=norm_weight, eps=eps)
        if silu:
            y = backend.silu_and_mul(y)
        return y if residual is None else torch.add(y, residual)
    y = torch.empty(m, n_out, dtype=torch.float16, device=x.device)
    if m == 0 or n == 0:
        return y
    if residual is not None and residual.stride(0) != n_out:
        residual = residual.contiguous()  # the kernels read it with y's row stride
    if use_mma:
        _launch_gemv_mma(backend, x, w, y, norm_weight, eps, residual, silu, vec_ok, ready,
                         swiglu_xq_target(backend, then, n_out) if silu and m == 1 else None)
        return y
    if m == 1 and norm_weight is None and gemv_tma_ok(backend, w, vec_ok, silu):
        launch_gemv_tma(backend, x, w, y, residual, silu, norm_post, eps)
        return y
    for r0 in range(0, m, kernels.GEMV_MAX_ROWS):
        rows = min(kernels.GEMV_MAX_ROWS, m - r0)
        bucket = next(b for b in kernels.GEMV_ROW_BUCKETS if b >= rows)
        use_q = q_fast and bucket >= GEMV_Q_MIN_ROWS  # never with silu (handled above)
        xr = x[r0:r0 + rows]
        fuse_norm = norm_weight is not None and (use_q or bucket * k * 2 <= kernels.GEMV_NORM_MAX_SMEM)
        if norm_weight is not None and not fuse_norm:
            xr, _ = backend.rms_norm(xr, norm_weight, eps)
        pdl = gemv_pdl(backend, w, rows)  # per launch: it depends on the launch right before
        spec = kernels.gemv_spec(w.fmt, bucket, silu, norm_post)
        groups = math.ceil(n_out / 4)
        if fuse_norm and not use_q:  # each block normalizes x once: fewer blocks, grid-stride over the features
            groups = min(groups, backend.num_sms * kernels.GEMV_NORM_BLOCKS_PER_SM)
        prefetch = kernels.gemv_prefetch_bytes(min(n_out, groups * 4) * (2 if silu else 1), w.row_bytes,
                                               _prefetch_budget(backend)) if pdl and not use_q else 0
        p = gemv_params(xr, r0, w, y, residual, norm_weight if fuse_norm else None, eps, vec_ok, prefetch)
        if use_q:
            backend._launch("gemv", "gemv_q", spec, (math.ceil(n / 32), 1, 1), (32 * kernels.GEMV_Q_WARPS, 1, 1),
                            kernels.gemv_q_smem_bytes(bucket, w.fmt), p, pdl)
        else:
            backend._launch("gemv", "gemv", spec, (groups, 1, 1), (128, 1, 1), bucket * k * 2 if fuse_norm else 0,
                            p, pdl)
        launched_gemv(backend, w)
    return y


def gemv_max_rows(backend: Any, w: CudaLinear, silu: bool = False) -> int:
    """The most x rows a call on `w` (with SwiGLU `silu`) runs as decode GEMV launches; above, the GEMM (`_gemm`).
    Repacked quant rows that gemv_s8 takes in launches of more than 8 rows (gemv_int8.gemv_s8_launch_rows: 16 or
    32, each launch reading the weights once, or once per k range): `backend.quant_gemv_rows` ("auto":
    kernels.quant_gemv_max_rows of the device); all others, 8-row gemv_s8 launches included (each would read the
    whole weight again), GEMM_MIN_ROWS - 1."""
    if (w.layout == "repacked" and gemv_s8_ok(backend, w, kernels.GEMV_MAX_ROWS)
            and gemv_s8_launch_rows(backend, w.fmt, w.in_features, silu) > kernels.GEMV_MAX_ROWS):
        choice = getattr(backend, "quant_gemv_rows", "auto")
        return kernels.quant_gemv_max_rows(backend.loader.compile_arch, w.fmt) if choice == "auto" else int(choice)
    return kernels.GEMM_MIN_ROWS - 1


def fuses_norm(backend: Any, w: CudaLinear) -> bool:
    """Whether a decode GEMV (up to `gemv_max_rows` x rows) on `w` takes the RMSNorm before it into its prologue
    (`backend.fuse_norm` "auto"), rather than after an `rms_norm` launch of its own.

    "auto" fuses except for fp16 weights over GEMV_NORM_FUSED_MAX_BYTES, where the norm pass inside every block
    of the GEMV cost more than the extra launch (at every row count).
    """
    choice = getattr(backend, "fuse_norm", "auto")
    if choice != "auto":
        return choice == "on"
    return not (w.fmt == "F16" and w.out_features * w.row_bytes > GEMV_NORM_FUSED_MAX_BYTES)


def folds_norm(backend: Any, shape: tuple[int, int], quant: Any | None) -> bool:
    """Whether a weight of `shape` ([out, in]) behind an RMSNorm is stored with the norm folded in (W diag(g),
    `CudaLinear.norm_folded`; `backend.norm_fold`): fp16 copies only (not `CudaLinear.stays_quant`). "auto": fp16
    weights over GEMV_NORM_FUSED_MAX_BYTES (those whose norm `fuses_norm` runs as its own rms_norm launch under
    its own "auto"), which the folded norm removes at one row; "on": every fp16 weight; "off": none. A folded
    weight's norm_linear no longer asks `fuses_norm` (A/Bs of VOLTSERVE_FUSE_NORM on such weights need
    VOLTSERVE_NORM_FOLD=off)."""
    choice = getattr(backend, "norm_fold", "auto")
    if choice == "off" or CudaLinear.stays_quant(quant, shape[1]):
        return False
    return choice == "on" or shape[0] * shape[1] * 2 > GEMV_NORM_FUSED_MAX_BYTES


def gemv_mma_ok(backend: Any, w: CudaLinear, rows: int, vec_ok: int, norm: bool = False,
                silu: bool = False) -> bool:
    """Whether a GEMV launch of `rows` (<= 8) x rows on `w` (with a fused RMSNorm `norm`, SwiGLU `silu`) runs
    `gemv_mma` / `gemv_mma_sb`: SM70+, k a multiple of 32, x rows 16-byte aligned, the weight aligned for the
    kernel's loads, and at least GEMV_MMA_MIN_ROWS[fmt] rows (SM70: also >= GEMV_MMA_SM70_MIN_ROWS; SM80+: also
    m = 1, without SwiGLU, on weights of
    >= GEMV_MMA_M1_MIN_BYTES: quant superblocks, and fp16 with a fused norm). `backend.gemv_kernel` ("auto",
    "scalar", "mma", "mma884": the SM70 m8n8k4 path on any arch) forces a choice (benchmarks, A/B tests).
    Repacked rows (`CudaLinear.layout`) always pass: only gemv_mma and gemv_s8 / gemv_s8w (which
    `gemv_kernel_name` picks among) read them (the backend does not repack under "scalar").

    Raises:
        ValueError: repacked rows with x or the weight not 16-byte aligned."""
    choice = getattr(backend, "gemv_kernel", "auto")
    arch = backend.loader.compile_arch  # the __CUDA_ARCH__ the kernels are built for
    if w.layout == "repacked":  # only the tensor-core / int8 decode GEMVs read that layout
        if not vec_ok or w.data.data_ptr() % 16:
            raise ValueError("repacked quant rows need x rows and the weight 16-byte aligned (k % 8 == 0)")
        return True
    if choice == "scalar" or arch < kernels.GEMV_MMA_MIN_ARCH or not vec_ok:
        return False
    if choice == "auto" and 73 <= arch < kernels.GEMV_MMA_SB_MIN_ARCH:
        return False  # Turing would run the m8n8k4 path, which is native only on SM70/72 (not measured there)
    align = 16 if w.fmt == "F16" else 4 if w.fmt == "Q4_1" else 2
    if w.in_features % kernels.GEMV_MMA_CHUNK or w.data.data_ptr() % align or w.row_bytes % align:
        return False
    if choice in ("mma", "mma884"):
        return True
    if arch < kernels.GEMV_MMA_SB_MIN_ARCH:
        return rows >= max(GEMV_MMA_MIN_ROWS[w.fmt], GEMV_MMA_SM70_MIN_ROWS)
    if rows >= GEMV_MMA_MIN_ROWS[w.fmt]:
        return True
    if w.out_features * w.row_bytes < GEMV_MMA_M1_MIN_BYTES:
        return False
    return not silu and (_mma_superblocks(backend, w) or (w.fmt == "F16" and norm))


def gemv_kernel_name(backend: Any, w: CudaLinear, rows: int, vec_ok: int = 1, norm: bool = False,
                     silu: bool = False) -> str:
    """The kernel a GEMV launch of `rows` (1..8) x rows on `w` runs: "gemv_tma_s8", "gemv_s8w", "gemv_s8",
    "gemv_mma_sb", "gemv_mma", "gemv_tma", "gemv_q" or "gemv". Rows of launches that run the same kernel are bitwise
    equal whatever the other rows (tests rely on it). A call of 9..16 rows runs both its launches with the kernel of
    its first (min(m, 8) rows). `norm`: a fused RMSNorm weight (not a folded one)."""
    if gemv_mma_ok(backend, w, rows, vec_ok, norm, silu):
        if gemv_tma_s8_ok(backend, w, rows, norm, silu):
            return "gemv_tma_s8"
        if gemv_s8w_ok(backend, w, rows):
            return "gemv_s8w"
        if gemv_s8_ok(backend, w, rows):
            return "gemv_s8"
        return "gemv_mma_sb" if _mma_superblocks(backend, w) else "gemv_mma"
    if rows == 1 and not norm and gemv_tma_ok(backend, w, vec_ok, silu):
        return "gemv_tma"
    bucket = next(b for b in kernels.GEMV_ROW_BUCKETS if b >= rows)
    return "gemv_q" if _whole_superblocks(w) and bucket >= GEMV_Q_MIN_ROWS else "gemv"


def attention_xq(backend: Any, w: Any, out: torch.Tensor, group: int) -> tuple[int | None, int, int]:
    """DecodeParams' (xq, xq_fmt, xq_rows): attn_decode writes its output `out` [rows, heads, head_dim] (fp16,
    contiguous, one row per sequence) also quantized for the GEMV on `w` that follows (o_proj), whose launch then
    skips quantize_s8 (`backend.xq_pending`, taken by the next launch_linear). Only where that launch would
    quantize x once per launch (gemv_s8, gemv_s8w over GEMV_S8W_BLOCK_MAX_X) and the kernel's writers hold whole
    32-element blocks (head_dim % 32 == 0, group * head_dim % 128 == 0); else (None, 0, 0). Off under
    VOLTSERVE_ATTN_XQ=off (`backend.attn_xq`)."""
    rows, heads, head_dim = out.shape
    k = heads * head_dim
    if (getattr(backend, "attn_xq", "auto") == "off" or not isinstance(w, CudaLinear) or w.in_features != k
            or not 1 <= rows <= kernels.GEMV_MAX_ROWS or head_dim % 32 or group * head_dim % 128):
        return None, 0, 0
    name = gemv_kernel_name(backend, w, rows)  # gemv_s8 / gemv_s8w: repacked Q4_0 / Q4_1 / Q8_0 rows
    if name not in ("gemv_s8", "gemv_s8w") or not x_per_launch_of(backend, name, rows, k):
        return None, 0, 0
    xq = torch.empty(kernels.gemv_s8_smem_bytes(rows, k), dtype=torch.uint8, device=out.device)
    backend.xq_pending = PendingXq(out, (rows, k), w, xq)
    return xq.data_ptr(), kernels.WTYPES[w.fmt], rows


def swiglu_xq_target(backend: Any, then: Any, n_out: int) -> CudaLinear | None:
    """The weight for which a one-row SwiGLU gemv_s8w launch (gate_up) also writes its output, n_out wide,
    quantized (gemv_int8.launch_gemv_s8w's `xq_for`): `then`, the linear applied next to that output (down), where
    its one-row launch runs gemv_s8w on x quantized once per launch (else a quantize_s8 launch: n_out >
    GEMV_S8W_BLOCK_MAX_X) and n_out is whole 32-output chunks; else None. None under VOLTSERVE_MLP_XQ=off
    (`backend.mlp_xq`). Llama-3-8B Q4 at batch 1: one quantize_s8 launch fewer a layer."""
    if (getattr(backend, "mlp_xq", "auto") == "off" or not isinstance(then, CudaLinear) or then.in_features != n_out
            or n_out % 32):
        return None
    if gemv_kernel_name(backend, then, 1) != "gemv_s8w" or not x_per_launch_of(backend, "gemv_s8w", 1, n_out):
        return None
    return then


def _whole_superblocks(w: CudaLinear) -> bool:
    """Quant rows of whole, 16-byte-aligned 256-weight superblocks (8 GGUF blocks): what gemv_q and gemv_mma_sb
    stream with 16-byte loads."""
    return w.fmt != "F16" and w.in_features % kernels.GEMV_Q_SUPERBLOCK == 0 and w.data.data_ptr() % 16 == 0


def _mma_superblocks(backend: Any, w: CudaLinear) -> bool:
    """gemv_mma_sb (16-byte cp.async copies of whole 256-weight superblocks, SM80+) instead of gemv_mma's
    per-fragment loads: quant rows of whole, 16-byte-aligned superblocks, on a device whose blocks may opt into
    the stages' shared memory (Q8_0 needs 212 KB: SM90 has 227 KB, A100 163 KB, SM86/89 99 KB)."""
    if not _whole_superblocks(w) or w.layout == "repacked" or getattr(backend, "gemv_kernel", "auto") == "mma884":
        return False
    return gemv_mma_sb_fits(backend, w.fmt)


def gemv_mma_sb_fits(backend: Any, fmt: str) -> bool:
    """Whether this device runs gemv_mma_sb for quant format `fmt`: SM80+ and its stages' shared memory within the
    blocks' opt-in limit."""
    smem = kernels.gemv_mma_sb_smem_bytes(fmt) + kernels.GEMV_MMA_STATIC_SMEM
    return backend.loader.compile_arch >= kernels.GEMV_MMA_SB_MIN_ARCH and smem <= backend.loader.max_smem_optin


def gemv_mma_tile(backend: Any, w: CudaLinear, silu: bool, one_pass: bool) -> int:
    """gemv_mma's block height for `w` on this device (kernels.gemv_mma_tile_rows; the 16-row build's occupancy
    is asked only where the rule needs it); `backend.gemv_mma_tile` (0 = per weight, 16 or 32) forces one
    (tests, A/B runs). The SM70 path forced on a newer GPU ("mma884") keeps 32 unless forced, as on a V100."""
    forced = getattr(backend, "gemv_mma_tile", 0)
    if forced:
        return forced
    arch = 70 if getattr(backend, "gemv_kernel", "auto") == "mma884" else backend.loader.compile_arch
    return kernels.gemv_mma_tile_rows(
        w.out_features, w.out_features * w.row_bytes, arch, backend.num_sms,
        lambda: backend._occupancy("gemv_mma", "gemv_mma",
                                   kernels.gemv_mma_spec(w.fmt, silu, one_pass, 16, w.layout == "repacked"), 0,
                                   32 * kernels.GEMV_MMA_WARPS))


def _launch_gemv_mma(backend: Any, x: torch.Tensor, w: CudaLinear, y: torch.Tensor,
                     norm_weight: torch.Tensor | None, eps: float, residual: torch.Tensor | None, silu: bool,
                     vec_ok: int, ready: torch.Tensor | None = None, xq_for: CudaLinear | None = None) -> None:
    """gemv_mma / gemv_mma_sb launches of <= 8 x rows each (fused norm, residual and SwiGLU all in the kernel);
    `residual` has y's row stride; `ready`: x already quantized for gemv_s8 / gemv_s8w (PendingXq); `xq_for`:
    gemv_s8w's (the weight after a SwiGLU launch that takes y quantized)."""
    m = x.shape[0]
    n_out = y.shape[1]
    one_pass = norm_weight is not None and m >= 2
    if gemv_tma_s8_ok(backend, w, m, norm_weight is not None, silu):
        launch_gemv_tma_s8(backend, x, w, y, residual)
        return
    if gemv_s8w_ok(backend, w, m):
        launch_gemv_s8w(backend, x, w, y, norm_weight, eps, residual, silu, vec_ok, ready, xq_for)
        return
    if gemv_s8_ok(backend, w, min(m, kernels.GEMV_MAX_ROWS)):
        launch_gemv_s8(backend, x, w, y, norm_weight, eps, residual, silu, vec_ok, one_pass, ready)
        return
    if _mma_superblocks(backend, w):
        kernel, smem, tile = "gemv_mma_sb", kernels.gemv_mma_sb_smem_bytes(w.fmt), kernels.GEMV_MMA_TILES[0]
    else:
        kernel, smem, tile = "gemv_mma", 0, gemv_mma_tile(backend, w, silu, one_pass)
    grid = (math.ceil(n_out / (tile // 2 if silu else tile)), 1, 1)
    spec = kernels.gemv_mma_spec(w.fmt, silu, one_pass, tile, w.layout == "repacked")
    if getattr(backend, "gemv_kernel", "auto") == "mma884":
        spec["GM_MMA884"] = 1  # the SM70 path on a newer GPU (tests)
    for r0 in range(0, m, kernels.GEMV_MAX_ROWS):
        rows = min(kernels.GEMV_MAX_ROWS, m - r0)
        p = gemv_params(x[r0:r0 + rows], r0, w, y, residual, norm_weight, eps, vec_ok)
        backend._launch("gemv_mma", kernel, spec, grid, (32 * kernels.GEMV_MMA_WARPS, 1, 1), smem, p,
                        gemv_pdl(backend, w, rows))
        launched_gemv(backend, w)


def _prefetch_budget(backend: Any) -> int:
    return getattr(backend, "gemv_prefetch_budget", kernels.GEMV_PREFETCH_L2_BYTES)


def _gemm(backend: Any, x: torch.Tensor, w: CudaLinear, f16_gemm: str) -> torch.Tensor:
    """x @ W^T for m >= GEMM_MIN_ROWS: quantized weights through dequant_f16 + cuBLAS (`dequant_gemm_wanted`) or
    gemm_tc; fp16 weights: cuBLAS through torch, or our SIMT `gemm_tiled` with f16_gemm="tiled" (also the
    quantized fallback for unaligned blocks)."""
    m, k = x.shape
    n = w.out_features
    if w.fmt == "F16" and f16_gemm == "cublas":
        return F.linear(x, w.data)
    y = torch.empty(m, n, dtype=torch.float16, device=x.device)
    wtype = kernels.WTYPES[w.fmt]
    if w.layout == "repacked" and w.data.data_ptr() % 16:
        raise ValueError("repacked quant rows must start 16-byte aligned")
    if w.fmt != "F16" and w.data.data_ptr() % 4 == 0:
        if dequant_gemm_wanted(backend, m, w):
            dequant_gemm(backend, x, w, y)
        else:
            _launch_gemm_tc(backend, x, w, y, wtype)
        return y
    p = P.GemmParams(x.data_ptr(), w.data.data_ptr(), y.data_ptr(), x.stride(0), n, w.row_bytes, m, n, k, 0)
    backend._launch("gemm_tiled", "gemm_tiled", {"WTYPE": wtype}, (math.ceil(n / 64), math.ceil(m / 64), 1),
                    (256, 1, 1), 0, p)
    return y
