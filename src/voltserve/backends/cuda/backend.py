"""CudaBackend: the Backend interface (voltserve.backends.base) on an NVIDIA GPU with our NVRTC kernels.

Layouts are those of backends/cpu.py; activations and the KV cache are fp16 on the GPU. Buffers come from torch's
CUDA allocator (its caching allocator keeps graph capture and NCCL simple). Kernels launch on a stream handle read
once (`refresh_stream()`; `torch.cuda.current_stream()` costs ~8 us per call, DESIGN section 9): call it again
inside a graph-capture context or after switching streams.

Decode paths (embedding, rms_norm, rotary_write_kv, linear / norm_linear with m <= 16, attention and rope_attention
with query_len == 1, silu_and_mul, sample_greedy) do no host sync and allocate only through torch's caching allocator,
so they are capturable in a CUDA graph provided their device inputs (ids, positions, metadata, norm weights,
cos/sin table) already live on the GPU and `AttentionMetadata.max_seq_len` is the bucket's capacity rather than
the step's value (it sizes the split-K grid).
"""

from __future__ import annotations

import math
import os
import weakref
from typing import Any

import torch

from voltserve.backends.base import AttentionMetadata, rope_then_attention
from voltserve.backends.cuda import driver, kernels, kernels_tma
from voltserve.backends.cuda import params as P
from voltserve.backends.cuda.gemv_chain import ChainLink, gemv_chain_ok, launch_gemv_chain
from voltserve.backends.cuda.gemv_int8 import gemv_s8_enabled, gemv_s8_fits
from voltserve.backends.cuda.linear import (CudaEmbedding, CudaLinear, attention_xq, folds_norm, gemv_mma_sb_fits,
                                           launch_linear, repack_wanted)
from voltserve.backends.cuda.module import KernelLoader
from voltserve.backends.cuda.sampling import DeviceSampling


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of environment variable `name`, one of `choices` (the first when unset): the backend's A/B knobs.

    Raises:
        ValueError: any other value.
    """
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected {', '.join(choices[:-1])} or {choices[-1]}")
    return value


# DecodeParams' fused-rotary fields (k_new ... interleaved) when attn_decode does not rotate: cos_sin nullptr = off
_NO_ROPE = (None,) * 5 + (0,) * 4


class CudaBackend(DeviceSampling):
    """Backend ops on one CUDA device. See `voltserve.backends.base.Backend` for each op's contract.

    Args:
        device_index: CUDA device ordinal.
        pdl: launch kernels with programmatic dependent launch when the device supports it (SM90+).
    Raises:
        CudaError: no usable device or cuda-python missing.
    """

    def __init__(self, device_index: int = 0, pdl: bool = True):
        self.device = torch.device("cuda", device_index)
        self.dtype = torch.float16
        torch.cuda.set_device(self.device)
        torch.empty(1, device=self.device)  # makes the primary context current on this thread
        self.loader = KernelLoader(device_index)
        self.pdl = pdl and self.loader.arch >= 90
        # decode GEMV kernel choice (linear.gemv_mma_ok): "auto" (tensor-core gemv_mma / gemv_mma_sb where they
        # measured faster), "scalar" (gemv / gemv_q everywhere; weights prepared under it stay GGUF, since only
        # gemv_mma reads repacked rows), "mma" (gemv_mma wherever its shape rules allow),
        # "mma884" (as "mma" with the SM70 m8n8k4 path, to test it on newer GPUs); VOLTSERVE_GEMV_KERNEL sets it
        # for A/B runs (tools/bench_decode.py --gemv-kernel)
        self.gemv_kernel = _env_choice("VOLTSERVE_GEMV_KERNEL", ("auto", "scalar", "mma", "mma884"))
        # gemv_mma block height: 0 = per weight (linear.gemv_mma_tile), 16 or 32 forces one (tests, A/B runs:
        # VOLTSERVE_GEMV_MMA_TILE)
        self.gemv_mma_tile = int(_env_choice("VOLTSERVE_GEMV_MMA_TILE", ("0", "16", "32")))
        # quant weights stored repacked for 16-byte loads (linear.repack_wanted): "auto", "on" or "off";
        # VOLTSERVE_QUANT_REPACK for A/B runs (read when weights are prepared)
        self.quant_repack = _env_choice("VOLTSERVE_QUANT_REPACK", ("auto", "on", "off"))
        # quantized weights at m >= GEMM_MIN_ROWS (dequant_gemm.dequant_gemm_wanted): "auto" (dequant_f16 + cuBLAS
        # on weights of >= kernels.DEQUANT_GEMM_MIN_WEIGHTS from dequant_gemm_min_rows, else gemm_tc), "tc"
        # (gemm_tc always) or "dequant" (always); VOLTSERVE_QUANT_GEMM for A/B runs
        self.quant_gemm = _env_choice("VOLTSERVE_QUANT_GEMM", ("auto", "tc", "dequant"))
        # gemm_tc's split-K at 65-128 rows: that of a 64-row launch ("rows", kernels.gemm_tc_plan's per_m_tile) or
        # 2 blocks an SM at any row count ("fixed", before session 26); VOLTSERVE_GEMM_TC_SPLIT
        self.gemm_tc_split = _env_choice("VOLTSERVE_GEMM_TC_SPLIT", ("rows", "fixed"))
        # decode GEMV on repacked quant rows through int8 MMAs (gemv_s8, x quantized per 32 like llama.cpp's Q8_1):
        # "auto" (gemv_int8.gemv_s8_ok; SwiGLU pairs are then repacked too), "on" (wherever it fits, even under
        # a forced gemv_kernel) or "off" (gemv_mma); VOLTSERVE_GEMV_S8 sets it for A/B runs (read here; the
        # attribute decides when weights are prepared and at each launch)
        self.gemv_s8 = _env_choice("VOLTSERVE_GEMV_S8", ("auto", "on", "off"))
        # fp16 one-row GEMVs through gemv_tma (SM90+, bulk copies into a smem ring): "folded" (the default:
        # folded-norm weights without SwiGLU, the shapes where the step measured faster), "off" (gemv) or "on"
        # (every weight it takes); gemv_tma.gemv_tma_ok. Its ring, stages x 2 KB spans per stage:
        # VOLTSERVE_GEMV_TMA_RING
        self.gemv_tma = _env_choice("VOLTSERVE_GEMV_TMA", ("folded", "off", "on"))
        ring = _env_choice("VOLTSERVE_GEMV_TMA_RING",
                           ("x".join(map(str, kernels_tma.GEMV_TMA_RING)), "8x4", "16x2", "24x4", "32x2"))
        self.gemv_tma_ring = tuple(int(v) for v in ring.split("x"))
        # gemv_tma blocks an SM may hold: 1 (the default: smem sized so that one fits) or 2 (registers capped and smem
        # sized so that the next launch's block fits beside the running one and fills its ring meanwhile; needs a
        # ring of <= 64 KB, e.g. VOLTSERVE_GEMV_TMA_RING=8x4); VOLTSERVE_GEMV_TMA_BLOCKS for A/B runs
        self.gemv_tma_blocks = int(_env_choice("VOLTSERVE_GEMV_TMA_BLOCKS", ("1", "2")))
        # one-row GEMVs on repacked quant rows through gemv_tma_s8 (SM90+: a bulk-copy ring as gemv_tma, int8
        # MMAs as gemv_s8): "off" (the default: slower than gemv_s8 / gemv_s8w on every 8B shape measured,
        # docs/performance.md session 11) or "on" (every call it can take: one row, no fused norm, no SwiGLU;
        # gemv_tma.gemv_tma_s8_ok); VOLTSERVE_GEMV_TMA_S8
        self.gemv_tma_s8 = _env_choice("VOLTSERVE_GEMV_TMA_S8", ("off", "on"))
        # its consumer warps per block (VOLTSERVE_GEMV_TMA_S8_WARPS, A/B runs)
        self.gemv_tma_s8_warps = int(_env_choice("VOLTSERVE_GEMV_TMA_S8_WARPS",
                                                 (str(kernels_tma.GEMV_TMA_S8_CONSUMERS), "8", "24")))
        # gemv_s8's and gemv_s8w's grid: "persistent" (the blocks the GPU holds at once, looping over the tiles /
        # outputs) or "full" (one block per tile / per S8W_WARPS outputs); VOLTSERVE_GEMV_S8_GRID for A/B runs
        self.gemv_s8_grid = _env_choice("VOLTSERVE_GEMV_S8_GRID", ("persistent", "full"))
        # where gemv_s8 quantizes x: "auto" (gemv_int8.gemv_s8_x_per_launch), "block" (every block, in its prologue)
        # or "launch" (once, by a quantize_s8 launch before it); VOLTSERVE_GEMV_S8_X for A/B runs
        self.gemv_s8_x = _env_choice("VOLTSERVE_GEMV_S8_X", ("auto", "block", "launch"))
        # gemv_s8's weight rows per block from 2 x rows: "auto" (gemv_int8.gemv_s8_tile_rows: 16 where 3 blocks'
        # x fit an SM), "32" or "16"; VOLTSERVE_GEMV_S8_TILES for A/B runs
        self.gemv_s8_tiles = _env_choice("VOLTSERVE_GEMV_S8_TILES", ("auto", "32", "16"))
        # x rows per gemv_s8 launch from 9 rows: "auto" (gemv_int8.gemv_s8_launch_rows: 32 or 16, the S8_NCOL = 4 /
        # 2 builds, where x fits the shared memory whole or, without SwiGLU, in k ranges), "16" (no 32-row
        # launches), "whole" (no k ranges) or "8" (8-row launches, and then no decode GEMV past 16 rows);
        # VOLTSERVE_GEMV_S8_ROWS for A/B runs
        self.gemv_s8_rows = _env_choice("VOLTSERVE_GEMV_S8_ROWS", ("auto", "16", "whole", "8"))
        # the most x rows a call on repacked quant rows runs as gemv_s8 launches before it takes the GEMM
        # (linear.gemv_max_rows): "auto" (kernels.quant_gemv_max_rows) or a number; VOLTSERVE_QUANT_GEMV_ROWS for
        # A/B runs
        self.quant_gemv_rows = _env_choice("VOLTSERVE_QUANT_GEMV_ROWS", ("auto", "16", "24", "32", "40", "48",
                                                                         "64", "128"))
        # gemv_s8's one-row launches: "warp" (gemv_s8w: a warp per weight row, dp4a; gemv_int8.gemv_s8w_ok) or
        # "mma" (what ran before: gemv_s8's S8_M1 build, or gemv_mma where gemv_s8 does not run, e.g. Q8_0 under
        # auto); VOLTSERVE_GEMV_S8_M1 for A/B runs
        self.gemv_s8_m1 = _env_choice("VOLTSERVE_GEMV_S8_M1", ("warp", "mma"))
        # the RMSNorm before a decode GEMV: fused into it where that measured faster ("auto", linear.fuses_norm),
        # always where the kernel can ("on"), or always its own kernel first ("off"); VOLTSERVE_FUSE_NORM for A/B
        self.fuse_norm = _env_choice("VOLTSERVE_FUSE_NORM", ("auto", "on", "off"))
        # fp16 weights with the RMSNorm before them folded in (linear.folds_norm; read when weights are prepared):
        # "auto" (where the norm would otherwise be its own launch), "on" (every fp16 weight behind a norm) or
        # "off"; VOLTSERVE_NORM_FOLD for A/B runs
        self.norm_fold = _env_choice("VOLTSERVE_NORM_FOLD", ("auto", "on", "off"))
        # decode attention path (attention_decode.cu): "auto" (tensor cores on SM80+ where the GQA group fits,
        # else CUDA cores) or "simt" (the CUDA-core path, V100's, on any GPU: tests and A/B runs)
        self.attn_kernel = _env_choice("VOLTSERVE_ATTN_KERNEL", ("auto", "simt"))
        # rotary + KV write inside the attention kernels (rope_attention): "auto" (decode steps and steps of <= 64
        # prompt tokens, kernels.rope_fused), "decode" (decode-only steps only, as before session 27) or "off" (the
        # rope_kv_write launch first, then the plain attention); VOLTSERVE_ROPE_ATTN for A/B runs
        self.rope_attn = _env_choice("VOLTSERVE_ROPE_ATTN", ("auto", "decode", "off"))
        # a verify step's attention (AttentionMetadata.rows_as_decodes): "decode" (attn_decode over its query
        # rows, since session 33) or "prefill" (attn_prefill, the fused rotary where rope_fused allows);
        # VOLTSERVE_ATTN_VERIFY for A/B runs
        self.attn_verify = _env_choice("VOLTSERVE_ATTN_VERIFY", ("decode", "prefill"))
        # attn_decode writing its output also quantized for the o_proj gemv_s8 / gemv_s8w launch after it, which
        # then skips quantize_s8 ("auto", linear.attention_xq) or not ("off"); VOLTSERVE_ATTN_XQ for A/B runs
        self.attn_xq = _env_choice("VOLTSERVE_ATTN_XQ", ("auto", "off"))
        # a one-row gate_up gemv_s8w writing its output also quantized for the down gemv_s8w launch after it, which
        # then skips quantize_s8 ("auto", linear.swiglu_xq_target) or not ("off"); VOLTSERVE_MLP_XQ for A/B runs
        self.mlp_xq = _env_choice("VOLTSERVE_MLP_XQ", ("auto", "off"))
        self.xq_pending = None  # attention_xq's and swiglu_xq_target's handoff to the next launch_linear
        # gemv_s8's load groups a warp issues early (gemv_int8.gemv_s8_launch_spec): "auto" both register buffers'
        # where a block has several tiles, "1" one (before session 45), "2" both on every grid;
        # VOLTSERVE_GEMV_S8_PRELOAD for A/B runs
        self.gemv_s8_preload = _env_choice("VOLTSERVE_GEMV_S8_PRELOAD", ("auto", "1", "2"))
        # gemv_s8's copy of x quantized per launch (gemv_int8.gemv_s8_launch_spec): each warp its own k range in
        # two parts (S8_XWARP) on the S8_KSPLIT launches ("split"), on every launch ("warp"), or on none (the whole
        # x by the block, then a barrier: "block"); VOLTSERVE_GEMV_S8_XCOPY for A/B runs
        self.gemv_s8_xcopy = _env_choice("VOLTSERVE_GEMV_S8_XCOPY", ("split", "block", "warp"))
        # gemv_s8 at 2-8 rows with one 8-warp block an SM: 16 warps a block ("auto", gemv_int8.gemv_s8_wide_block)
        # or 8 ("8"); VOLTSERVE_GEMV_S8_WARPS for A/B runs
        self.gemv_s8_warps = _env_choice("VOLTSERVE_GEMV_S8_WARPS", ("auto", "8"))
        # attn_decode's fewest keys per split (kernels.decode_plan's min_part); VOLTSERVE_ATTN_MIN_PART for A/B runs
        self.attn_min_part = int(_env_choice("VOLTSERVE_ATTN_MIN_PART", (str(kernels.DECODE_MIN_PART), "32", "128",
                                                                         "256", "512", "1024")))
        # attn_decode in a grid sized for a capacity (CUDA graphs): splits planned on the host for each step's
        # longest context ("auto", graph_decode_splits -> AttentionMetadata.decode_splits) or the capacity's plan
        # for every step ("off", the rule before); VOLTSERVE_ATTN_STEP_SPLITS for A/B runs
        self.attn_step_splits = _env_choice("VOLTSERVE_ATTN_STEP_SPLITS", ("auto", "off"))
        # programmatic dependent launch of decode GEMVs (gemv_launch.gemv_pdl): "auto" (all but a large GEMV right
        # after another), "small" (only weights of at most kernels.GEMV_PDL_MAX_WEIGHT_BYTES), "on" (every GEMV)
        # or "off" (none); VOLTSERVE_GEMV_PDL for A/B runs
        self.gemv_pdl = _env_choice("VOLTSERVE_GEMV_PDL", ("auto", "small", "on", "off"))
        # gemv's L2 prefetch under PDL, bytes for all its warps' first rows together (kernels.gemv_prefetch_bytes);
        # VOLTSERVE_GEMV_PREFETCH_MB for A/B runs
        self.gemv_prefetch_budget = int(_env_choice("VOLTSERVE_GEMV_PREFETCH_MB", (
            str(kernels.GEMV_PREFETCH_L2_BYTES >> 20), "0", "4", "16", "32"))) << 20
        # a decoder layer's one-row GEMVs after attention in one persistent launch (gemv_chain.gemv_chain_ok,
        # fused_decoder_tail): "off" (measured faster, docs/performance.md session 15) or "on";
        # VOLTSERVE_GEMV_CHAIN for A/B runs
        self.gemv_chain = _env_choice("VOLTSERVE_GEMV_CHAIN", ("off", "on"))
        # weight bytes the last launch streamed (a decode GEMV's; 0 after any other kernel): gemv_launch.gemv_pdl
        self.last_launch_weight_bytes = 0
        self._device_copies: dict[int, tuple[Any, torch.Tensor]] = {}
        self._blocks_per_sm: dict[tuple, int] = {}
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # split-K arrival counters of gemm_tc (zero between launches; allocated here, before any graph capture)
        self.gemm_counters = torch.zeros(kernels.GEMM_TC_MAX_COUNTERS, dtype=torch.int32, device=self.device)
        # attn_decode's split arrival counters, one per (sequence, KV head); zero between launches
        self.attn_counters = torch.zeros(kernels.ATTN_MAX_COUNTERS, dtype=torch.int32, device=self.device)
        self.argmax_counters = torch.zeros(kernels.ARGMAX_MAX_ROWS, dtype=torch.int32, device=self.device)
        # sample_chunks' arrival counters, one per row, and its top-p rows' weight histograms (a launch with a
        # top-p row and >= 2 blocks a row has at most one block an SM, so at most num_sms // 2 rows); zero between
        # launches
        self.sample_counters = torch.zeros(kernels.SAMPLE_MAX_CHUNKED_ROWS, dtype=torch.int32, device=self.device)
        self.sample_hist = torch.zeros(self.num_sms // 2, kernels.SAMPLE_BINS + 1, dtype=torch.int64,
                                       device=self.device)
        # rows without top-k / logprobs over many blocks (sample_chunks): all of them (auto), only those without
        # top-p / min-p (plain), or always a block a row (off)
        self.sample_chunks = _env_choice("VOLTSERVE_SAMPLE_CHUNKS", ("auto", "plain", "off"))
        # attn_decode's split count per longest context, per (graph capacity, sequences): graph_decode_splits
        self._graph_plans: dict[tuple[int, int], tuple[tuple[int, ...], int]] = {}
        # gemv_chain's grid barrier: an arrival counter that only grows, by kernels_tma.GEMV_CHAIN_BARRIER_QUANTUM a
        # launch
        self.chain_barrier = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.refresh_stream()

    def refresh_stream(self) -> None:
        """Re-read torch's current stream on this device; later launches go there."""
        self.stream = torch.cuda.current_stream(self.device).cuda_stream

    def _launch(self, op: str, kernel: str, spec: dict[str, int] | None, grid, block, smem: int, params,
                pdl: bool | None = None) -> None:
        """Launch `kernel` of `op` on this backend's stream; pdl None = the backend's setting (the launcher may
        turn it off for a launch where it does not pay)."""
        fn = self.loader.function(op, kernel, spec, smem)
        driver.launch(fn, tuple(grid), tuple(block), smem, self.stream, params, kernel,
                      self.pdl if pdl is None else pdl)
        self.last_launch_weight_bytes = 0  # launch_linear sets it after a GEMV

    def _occupancy(self, op: str, kernel: str, spec: dict[str, int], smem: int, threads: int = 128) -> int:
        """Blocks of `kernel` one SM holds at once (the driver's occupancy calculator), memoised."""
        key = (op, kernel, tuple(sorted(spec.items())), smem, threads)
        hit = self._blocks_per_sm.get(key)
        if hit is None:
            hit = self._blocks_per_sm[key] = max(1, driver.blocks_per_sm(
                self.loader.function(op, kernel, spec, smem), threads, smem))
        return hit

    def _on_device(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t` as a contiguous device tensor of `dtype`; host tensors are copied once and memoised per object."""
        if t.device == self.device and t.dtype == dtype and t.is_contiguous():
            return t
        hit = self._device_copies.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        dev = t.detach().to(self.device, dtype).contiguous()
        self._device_copies[id(t)] = (weakref.ref(t), dev)
        return dev

    # -- weights -------------------------------------------------------------------------------------------

    def prepare_linear(self, weight: torch.Tensor, quant: Any | None = None, swiglu: bool = False,
                       norm: torch.Tensor | None = None, logits: bool = False) -> CudaLinear:
        if norm is not None and not folds_norm(self, weight.shape, quant):
            norm = None
        repack = quant is not None and self.gemv_kernel != "scalar" and repack_wanted(
            self.quant_repack, self.loader.compile_arch, quant.qtype, weight.shape[1], int(quant.data.nbytes),
            swiglu, superblocks=gemv_mma_sb_fits(self, quant.qtype),
            s8=gemv_s8_enabled(self) and gemv_s8_fits(self, kernels.GEMV_MAX_ROWS, weight.shape[1]))
        return CudaLinear.upload(weight, quant, self.device, repack=repack, norm=norm)

    def prepare_embedding(self, weight: torch.Tensor, quant: Any | None = None) -> CudaEmbedding:
        return CudaEmbedding.upload(weight, quant, self.device)

    def prepare_norm(self, weight: torch.Tensor) -> torch.Tensor:
        """[hidden] norm weight as fp32 on the device (what rms_norm reads)."""
        return weight.detach().to(self.device, torch.float32).contiguous()

    # -- ops -----------------------------------------------------------------------------------------------

    def embedding(self, token_ids: torch.Tensor, table: CudaEmbedding) -> torch.Tensor:
        ids = self._on_device(token_ids, torch.int64)
        n = ids.numel()
        out = torch.empty(n, table.hidden, dtype=self.dtype, device=self.device)
        if n == 0:
            return out
        p = P.EmbeddingParams(ids.data_ptr(), table.data.data_ptr(), out.data_ptr(), n, table.hidden, table.vocab,
                              table.row_bytes)
        kernel = "embedding_q8_0" if table.fmt == "Q8_0" else "embedding_f16"
        self._launch("embedding", kernel, None, (n, math.ceil(table.hidden / 1024), 1), (128, 1, 1), 0, p)
        return out

    def rms_norm(self, x, weight, eps, residual=None):
        _check_rows(x, "x")
        num_tokens, hidden = x.shape
        w = self._on_device(weight, torch.float32)
        out = torch.empty(num_tokens, hidden, dtype=self.dtype, device=self.device)
        res_out = x
        if residual is not None:
            _check_rows(residual, "residual")
            if residual.shape != x.shape:
                raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
            res_out = torch.empty_like(out)
        if num_tokens == 0:
            return out, res_out
        # the 16-byte path: every row (x, residual, the outputs: contiguous here) and the weight 16-byte aligned;
        # not for hidden 0 (its clamped weight index would read past an empty weight)
        vec_ok = hidden > 0 and hidden % 8 == 0 and w.data_ptr() % 16 == 0 and all(
            t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 for t in (x, out, res_out)
            + ((residual,) if residual is not None else ()))
        p = P.RmsNormParams(x.data_ptr(), residual.data_ptr() if residual is not None else None, w.data_ptr(),
                            out.data_ptr(), res_out.data_ptr(), x.stride(0),
                            residual.stride(0) if residual is not None else 0, num_tokens, hidden, eps, int(vec_ok))
        self._launch("rmsnorm", "rms_norm", None, (num_tokens, 1, 1), (256, 1, 1), 0, p)
        return out, res_out

    def linear(self, x, weight: CudaLinear, residual=None):
        _check_rows(x, "x")
        if weight.norm_folded:
            raise ValueError("this weight has its RMSNorm folded in: call norm_linear")
        if x.shape[1] != weight.in_features:
            raise ValueError(f"x {tuple(x.shape)} does not match weight in_features {weight.in_features}")
        if residual is not None:
            _check_rows(residual, "residual")
        return launch_linear(self, x, weight, residual=residual)

    def norm_linear(self, x, norm_weight, eps, weight: CudaLinear, silu=False, then=None):
        _check_rows(x, "x")
        if x.shape[1] != weight.in_features:
            raise ValueError(f"x {tuple(x.shape)} does not match weight in_features {weight.in_features}")
        if weight.norm_folded:  # norm_weight's g is in the weight already (prepare_linear's `norm`)
            return launch_linear(self, x, weight, eps=eps, silu=silu, norm_post=True, then=then)
        return launch_linear(self, x, weight, norm_weight=self._on_device(norm_weight, torch.float32), eps=eps,
                             silu=silu, then=then)

    def fused_decoder_tail(self, o, h, o_proj, post_norm, gate_up, down, eps, then=None):
        """`base.decoder_tail` as one gemv_chain launch (one row, gate_up and `then`'s linear with their norms
        folded in, `gemv_chain.gemv_chain_ok`), else None (the caller composes it)."""
        weights = [o_proj, gate_up, down] + ([] if then is None else [then[1]])
        if o.shape[0] != 1 or not gate_up.norm_folded or (then is not None and not then[1].norm_folded) or \
                o_proj.norm_folded or down.norm_folded or not gemv_chain_ok(self, weights):
            return None
        _check_rows(o, "x")
        _check_rows(h, "residual")
        new = lambda n: torch.empty(1, n, dtype=torch.float16, device=self.device)  # noqa: E731
        h1, act, h2 = new(o_proj.out_features), new(gate_up.out_features // 2), new(down.out_features)
        links = [ChainLink(o_proj, o, h1, h), ChainLink(gate_up, h1, act, silu_out=True),
                 ChainLink(down, act, h2, h1)]
        out = None
        if then is not None:
            out = new(then[1].out_features)
            links.append(ChainLink(then[1], h2, out))
        launch_gemv_chain(self, links, eps)
        return h2, out

    def _rope_inputs(self, q, k, v, positions, cos_sin, style, kv_layer, slot_mapping):
        """Checks of rotary_write_kv's arguments; (cos_sin fp32, positions int64, slot_mapping int64) on the device.

        Raises:
            ValueError: unknown style, q / k / v not [tokens, heads, head_dim] with packed heads, a kv_layer that
                does not match k, a cos_sin width other than head_dim.
        """
        if style not in ("neox", "interleaved"):
            raise ValueError(f"unknown rotary style {style!r}")
        num_tokens, _, head_dim = q.shape
        packed = all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (q, k, v))
        if not packed or k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim:
            raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)} / v {tuple(v.shape)}: need [tokens, heads, "
                             "head_dim] with packed heads")
        if kv_layer.dtype != self.dtype or not kv_layer.is_contiguous() or kv_layer.shape[3:] != k.shape[1:]:
            raise ValueError(f"kv_layer {tuple(kv_layer.shape)} {kv_layer.dtype} does not match k {tuple(k.shape)}")
        cs = self._on_device(cos_sin, torch.float32)
        if cs.shape[1] != head_dim:
            raise ValueError(f"cos_sin width {cs.shape[1]} != head_dim {head_dim} (partial rotary unsupported)")
        return cs, self._on_device(positions, torch.int64), self._on_device(slot_mapping, torch.int64)

    def rotary_write_kv(self, q, k, v, positions, cos_sin, style, kv_layer, slot_mapping):
        cs, pos, slots = self._rope_inputs(q, k, v, positions, cos_sin, style, kv_layer, slot_mapping)
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        q_out = torch.empty(q.shape, dtype=self.dtype, device=self.device)
        if num_tokens == 0:
            return q_out
        p = P.RopeKvParams(q.data_ptr(), k.data_ptr(), v.data_ptr(), q_out.data_ptr(), kv_layer.data_ptr(),
                           pos.data_ptr(), slots.data_ptr(), cs.data_ptr(), q.stride(0), k.stride(0), v.stride(0),
                           kv_layer[0].numel(), num_tokens, num_heads, num_kv_heads, head_dim,
                           int(style == "interleaved"), cs.shape[0])
        self._launch("rope_kv", "rope_kv_write", None, (num_tokens, num_heads + 2 * num_kv_heads, 1), (64, 1, 1),
                     0, p)
        return q_out

    def rope_attention(self, q, k, v, positions, cos_sin, style, kv_layer, attn: AttentionMetadata, scale,
                       out_linear=None):
        """The rotary and the KV write inside the attention kernels (one launch less than rotary_write_kv +
        attention). Decode-only steps: attn_decode rotates q and the new key and writes the cache, and where
        `out_linear` runs gemv_s8 / gemv_s8w on x quantized per launch, also writes its output quantized for it
        (linear.attention_xq). Other steps of at most kernels.ROPE_PREFILL_MAX_TOKENS prompt tokens (a CUDA
        graph's: its bucket): in mixed steps (`split_decode`) attn_decode likewise for the one-token sequences,
        then attn_prefill rotates the other sequences' q and new keys (prompts, verifies of drafts) and writes
        their keys (session 27: the mixed step of the default model at 64 streams 2.00 -> 1.91 ms; attn_decode's
        loads before its PDL wait overlap the QKV GEMM again); other steps attn_prefill alone. Longer steps,
        VOLTSERVE_ROPE_ATTN=off (=decode: decode-only steps only), q / k / v head rows not 16-byte aligned, or
        neox with head_dim % 16 != 0: the two ops (a fused pp512 was 3-8% slower: every key tile rotates its
        keys again). Steps whose rows run as decodes (`_rows_as_decodes`): the two ops."""
        # neox pairs dims d and d + head_dim / 2: the kernels rotate 8-dim vectors, so head_dim / 2 % 8 == 0
        vectors_pair = style != "neox" or q.shape[2] % 16 == 0
        fuse = kernels.rope_fused(self.rope_attn, attn.is_decode_only, q.shape[0], attn.num_seqs)
        # rows as decodes read the step's other new keys from the cache: rope_kv_write writes them first
        rows = self._rows_as_decodes(attn)
        if rows or not fuse or not vectors_pair or not all(_rows_aligned(t) for t in (q, k, v)):
            return rope_then_attention(self, q, k, v, positions, cos_sin, style, kv_layer, attn, scale)
        cs, pos, slots = self._rope_inputs(q, k, v, positions, cos_sin, style, kv_layer, attn.slot_mapping)
        rope = (k.data_ptr(), v.data_ptr(), pos.data_ptr(), slots.data_ptr(), cs.data_ptr(), k.stride(0),
                v.stride(0), cs.shape[0], int(style == "interleaved"))
        # attn_decode reads positions, slot_mapping and the cos / sin table before its PDL wait, as the metadata
        return self._attention(q, kv_layer, attn, scale, rope,
                               ((positions, torch.int64), (attn.slot_mapping, torch.int64), (cos_sin, torch.float32)),
                               out_linear)

    def attention(self, q, kv_layer, attn: AttentionMetadata, scale):
        return self._attention(q, kv_layer, attn, scale)

    def _rows_as_decodes(self, attn: AttentionMetadata) -> bool:
        """Whether a step runs attn_decode over its query rows, each a decode of the keys up to its position
        (`AttentionMetadata.rows_as_decodes`: verify steps; VOLTSERVE_ATTN_VERIFY=prefill keeps attn_prefill):
        the keys split over the SMs as in decode steps, where attn_prefill runs one block a 16-row query tile and
        head (a verify at batch 1: one tile a head) through every key."""
        return attn.rows_as_decodes and not attn.is_decode_only and self.attn_verify == "decode"

    def _attention(self, q, kv_layer, attn: AttentionMetadata, scale, rope: tuple = _NO_ROPE, rope_meta: tuple = (),
                   out_linear=None):
        """attention; with `rope` (the fused-rotary fields DecodeParams and PrefillParams share) both kernels also
        rotate q and the new keys and write the cache; `rope_meta`: (tensor, dtype) of the inputs behind its
        positions, slot_mapping and cos / sin table (read before the PDL wait); `out_linear`: rope_attention's."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = kv_layer.shape[3], kv_layer.shape[2]
        if q.stride(2) != 1 or kv_layer.shape[4] != head_dim or num_heads % num_kv_heads or head_dim % 8:
            raise ValueError(f"q {tuple(q.shape)} / kv_layer {tuple(kv_layer.shape)}: unsupported shapes")
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=self.dtype, device=self.device)
        num_seqs = attn.num_seqs
        if num_tokens == 0 or num_seqs == 0:
            return out
        meta = (attn.query_start_loc, attn.seq_lens, attn.block_tables)
        # attn_decode and attn_prefill read the metadata before their PDL wait: fine for host copies, not for a
        # cast kernel just launched on the device (its writes are visible only after the wait), so such a launch
        # goes without PDL
        on_device = [(t, torch.int32) for t in meta] + list(rope_meta)
        meta_pdl = None if all(t.device != self.device or (t.dtype == dtype and t.is_contiguous())
                               for t, dtype in on_device) else False
        qsl, seq_lens, tables = (self._on_device(t, torch.int32) for t in meta)
        common = (q.data_ptr(), kv_layer.data_ptr(), tables.data_ptr(), seq_lens.data_ptr(), qsl.data_ptr(),
                  out.data_ptr())
        plane = kv_layer[0].numel()
        rows = self._rows_as_decodes(attn)
        if rows or attn.is_decode_only or attn.split_decode:
            # attn_decode reads q's head rows as 16-byte vectors (rope_attention checked its q)
            dq = q if _rows_aligned(q) else torch.empty(q.shape, dtype=q.dtype, device=q.device).copy_(q)
            if rows:  # every query row a decode of its own
                if rope is not _NO_ROPE:
                    raise ValueError("rows as decodes take the step's new keys from the cache: no fused rotary")
                self._attention_decode(dq, attn, scale, (dq.data_ptr(),) + common[1:], plane, num_kv_heads,
                                       block_size, tables.shape[1], meta_pdl, rope, per_row=True)
                return out
            # a mixed step: attn_decode computes the sequences of one query token (it leaves the others at once),
            # then attn_prefill the sequences of >= 2
            xq = attention_xq(self, out_linear, out, num_heads // num_kv_heads) \
                if attn.is_decode_only and out_linear is not None else (None, 0, 0)
            self._attention_decode(dq, attn, scale, (dq.data_ptr(),) + common[1:], plane, num_kv_heads, block_size,
                                   tables.shape[1], meta_pdl, rope, xq)
            if attn.is_decode_only:
                return out
        p = P.PrefillParams(*common, q.stride(0), q.stride(1), plane, num_seqs, num_heads, num_kv_heads, block_size,
                            tables.shape[1], scale, 2 if attn.split_decode else 0, *rope)
        grid = (kernels.prefill_tile_slots(num_tokens, num_seqs), num_heads, 1)
        self._launch("attention_prefill", "attn_prefill", {"HEAD_DIM": head_dim}, grid, (128, 1, 1),
                     kernels.prefill_smem_bytes(head_dim), p, meta_pdl)
        return out

    def _attention_decode(self, q, attn: AttentionMetadata, scale, common, plane, num_kv_heads, block_size,
                          max_blocks, meta_pdl, rope: tuple, xq: tuple = (None, 0, 0), per_row: bool = False) -> None:
        """attn_decode (+ its split reduce) for the last query row of each of the step's sequences, or with
        `per_row` for each of q's rows (a unit of the grid each; rows past the step's tokens leave at once);
        `rope`: DecodeParams' fused-rotary fields (cos_sin None: off); `xq`: its quantized-output fields
        (linear.attention_xq)."""
        num_seqs, num_heads, head_dim = attn.num_seqs, q.shape[1], q.shape[2]
        units = q.shape[0] if per_row else num_seqs  # grid.y
        group = num_heads // num_kv_heads
        spec = kernels.decode_spec(head_dim, group, simt=self.attn_kernel == "simt", per_row=per_row)
        smem = kernels.decode_smem_bytes(head_dim, group, block_size, spec["PARTITION"])
        plan = (attn.max_seq_len, units, num_kv_heads, spec["PARTITION"], self.num_sms,
                self._occupancy("attention_decode", "attn_decode", spec, smem), self.attn_min_part)
        num_splits, min_part = kernels.decode_plan(*plan)
        # a grid sized for a capacity (CUDA graphs): the splits of the step's longest context, planned on the host
        # each step (graph_decode_splits, from the plan registered here as the graph's eager run makes this launch)
        step_splits = None
        if attn.decode_splits is not None and num_splits > 1 and self.attn_step_splits == "auto":
            self._register_graph_plan(plan, min_part, (num_kv_heads, head_dim, group))
            step_splits = attn.decode_splits.data_ptr()
        acc = torch.empty(units * num_heads * num_splits * head_dim if num_splits > 1 else 1,
                          dtype=torch.float32, device=self.device)
        ml = torch.empty(units * num_heads * num_splits * 2, dtype=torch.float32, device=self.device)
        # the last split block merges (one launch) while the counters cover every (sequence, KV head)
        merge_in_kernel = num_splits <= kernels.decode_max_merged_splits(head_dim) and \
            units * num_kv_heads <= self.attn_counters.numel()
        p = P.DecodeParams(*common, acc.data_ptr(), ml.data_ptr(),
                           self.attn_counters.data_ptr() if merge_in_kernel else None, q.stride(0), q.stride(1),
                           plane, num_seqs, num_heads, num_kv_heads, block_size, max_blocks, num_splits,
                           scale, min_part, *rope, *xq, step_splits, int(attn.split_decode and not per_row))
        self._launch("attention_decode", "attn_decode", spec, (num_kv_heads, units, num_splits),
                     (128, 1, 1), smem, p, meta_pdl)
        if num_splits > 1 and not merge_in_kernel:
            self._launch("attention_decode", "attn_decode_reduce", spec, (num_kv_heads, units, 1),
                         (128, 1, 1), 8 * group * num_splits, p)

    def _register_graph_plan(self, plan: tuple, min_part: int, shape: tuple[int, int, int] | None = None) -> None:
        """Keep kernels.decode_split_table for `plan` (decode_plan's arguments; plan[0] the graph's capacity,
        plan[1] its sequences; `min_part` the plan's, the table's keys per entry) for graph_decode_splits, under
        (capacity, sequences) (the latest launch's plan wins) and, with `shape` (the model's KV heads, head dim,
        query heads per KV head), under (capacity, sequences, *shape): a draft model's graphs on the same backend
        keep their own (any count is correct, seq_splits clamps it per sequence; the right one is faster)."""
        entry = (kernels.decode_split_table(*plan), min_part)
        self._graph_plans[plan[:2]] = entry
        if shape is not None:
            self._graph_plans[plan[:2] + tuple(shape)] = entry

    def graph_decode_splits(self, capacity: int, num_seqs: int, longest: int,
                            shape: tuple[int, int, int] | None = None) -> int:
        """attn_decode's split count for a CUDA graph step (`AttentionMetadata.decode_splits`): the graph's grid
        is sized for `capacity` keys and `num_seqs` sequences, the step's longest context is `longest` keys;
        `shape` (KV heads, head dim, group): the plan registered for that attention shape, else the latest one.
        0 (the grid's own) where no launch of that graph registered a plan (its eager run does, before capture).
        Host arithmetic, once per step: a dict lookup and an index."""
        entry = self._graph_plans.get((capacity, num_seqs) + tuple(shape)) if shape is not None else None
        if entry is None:
            entry = self._graph_plans.get((capacity, num_seqs))
        if entry is None:
            return 0
        table, min_part = entry
        return table[min(len(table) - 1, max(0, longest - 1) // min_part)]

    def silu_and_mul(self, x):
        _check_rows(x, "x")
        num_tokens, inner = x.shape[0], x.shape[1] // 2
        out = torch.empty(num_tokens, inner, dtype=self.dtype, device=self.device)
        if num_tokens == 0 or inner == 0:
            return out
        p = P.SiluMulParams(x.data_ptr(), out.data_ptr(), x.stride(0), num_tokens, inner)
        self._launch("silu_mul", "silu_mul", None, (math.ceil(inner / 256), num_tokens, 1), (256, 1, 1), 0, p)
        return out

    def allocate_kv_cache(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim):
        return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=self.dtype,
                           device=self.device)


def _rows_aligned(t: torch.Tensor) -> bool:
    """Every [.., head, :] row of t (fp16) starts on a 16-byte boundary (attn_decode's vector loads)."""
    return t.data_ptr() % 16 == 0 and all(t.stride(i) % 8 == 0 for i in range(t.dim() - 1))


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.dtype != torch.float16 or not x.is_cuda or x.stride(1) != 1:
        raise ValueError(f"{name}: need a 2-D fp16 CUDA tensor with contiguous rows, got {tuple(x.shape)} "
                         f"{x.dtype} {x.device} strides {x.stride()}")
