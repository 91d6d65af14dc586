// gemv_tma.cu: the one-row fp16 decode GEMV that streams its weights through a shared-memory ring filled by
// bulk asynchronous copies (SM90+ "TMA" cp.async.bulk, PTX ISA 8.0), y[m, n] = x[m, k] . W[n, k]^T.
//
// Why: a decode GEMV that loads its weights with per-thread loads (gemv) cannot start them until its blocks
// are resident and pays a ramp and a drain per launch (~2-4 us on the H200, docs/performance.md). Here one
// block per SM owns a contiguous run of weight rows, and a producer warp fills a ring of p.stages stages of
// p.stage_spans x 2 KB before pdl_enter: under PDL those copies start as soon as the previous kernel's block
// leaves the SM (they need no x), so each SM goes from one kernel's weights to the next without an idle gap,
// and the bytes in flight do not depend on how many warps are resident.
//
// Layout: block b of G owns output features [b n_out / G, (b + 1) n_out / G) (SILU: those gate rows, then the
// matching up rows at n_out + f); its rows are contiguous bytes (row stride 2k), cut into stages of p.stage_spans
// 2 KB spans (1024 halves; k % 1024 == 0, so a span lies in one row), each one cp.async.bulk completing on its
// `full` mbarrier. 8 consumer warps take whole stages in turn (warp w: stages w, w + 8, ...): a warp loads its
// stage into registers (16 x 16 bytes a lane) and hands the slot back on its `empty` mbarrier at once, so a slot
// is held for one smem round trip, not for the products. The products run on tensor cores (mma.m16n8k16, fp16 x
// fp16 -> fp32) with x, staged once per block in smem as it is (fp16), as the A operand: per 256-half chunk two
// MMAs whose diagonal is the chunk's dot product (tma_span_dots), so a 16-byte weight piece costs two MMA
// operands and one x load instead of 8 conversions and 8 FMAs. One warp sum per span -> partial[row][span] in
// smem; the epilogue adds a row's spans in order: fixed-order sums, no atomics, so an output depends neither on
// the grid, the ring nor the other rows.
// Fusions (gemv.cu's semantics, fp16 roundings kept): NORM_POST (the RMSNorm folded into W: outputs scaled by
// 1 / rms(x), x^2 summed once per block), SILU (silu(gate) * up of a [gate; up] weight), `res` (residual).
// Compile-time: SILU, NORM_POST; one x row (p.m == 1). Runtime: p.stages (ring depth, a multiple of 8, <=
// TMA_MAX_STAGES) and p.stage_spans (<= TMA_STAGE_SPANS); the launcher sizes the dynamic smem as the ring, x and
// the partials (kernels_tma.gemv_tma_plan).
// Below SM90 the kernel is a trapping stub (no bulk copies there); the launcher routes SM90+ only.
// Reference: voltserve.backends.cpu.CpuBackend.linear.
#include "gemv_common.cuh"
#include "mma.cuh"
#include "tma_dots.cuh"

#ifndef SILU
#define SILU 0
#endif
#ifndef NORM_POST
#define NORM_POST 0
#endif

#ifndef TMA_CONSUMERS
#define TMA_CONSUMERS 8
#endif
// TMA_CONSUMERS: warps that read the stages; one more warp issues the copies
#define TMA_THREADS ((TMA_CONSUMERS + 1) * 32)
#ifndef TMA_MIN_BLOCKS
#define TMA_MIN_BLOCKS 1  // 2: registers capped so that the next launch's block fits beside this one (its ring
                          // fills while this block still streams; the launcher then sizes smem for two)
#endif

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The block's weight bytes as 1 (SILU: 2) contiguous segments of `seg_bytes` each; stage i of the block.
struct TmaStage {
    const u8* src;
    int seg;     // 0, or 1 for SILU's up rows
    i64 offset;  // bytes from the segment's start
    u32 bytes;
};

VOLT_DEVICE TmaStage tma_stage(const GemvParams& p, int f0, int n_out, i64 seg_bytes, int seg_stages, int stage_bytes,
                               int i) {
    TmaStage s;
    s.seg = i >= seg_stages;
    s.offset = (i64)(i - s.seg * seg_stages) * stage_bytes;
    s.bytes = (u32)min((i64)stage_bytes, seg_bytes - s.offset);
    s.src = p.w + (i64)(f0 + s.seg * n_out) * p.w_row_bytes + s.offset;
    return s;
}

#endif

extern "C" __global__ void __launch_bounds__(TMA_THREADS, TMA_MIN_BLOCKS) gemv_tma(const GemvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 tma_smem[];  // [stages][stage bytes] ring, x (fp16), the partials
    __shared__ unsigned long long full[TMA_MAX_STAGES], empty[TMA_MAX_STAGES];
    __shared__ float scratch[TMA_CONSUMERS];
    // the launcher's bound on this static smem (gemv_tma.GEMV_TMA_STATIC_SMEM)
    static_assert(sizeof(full) + sizeof(empty) + 4 * (TMA_CONSUMERS + 1) <= 1024, "static smem");
    __shared__ float inv_rms;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_out = SILU ? p.n / 2 : p.n;
    const int f0 = (int)((i64)blockIdx.x * n_out / gridDim.x), f1 = (int)((i64)(blockIdx.x + 1) * n_out / gridDim.x);
    const int rows = f1 - f0;                      // features of this block (SILU: gate rows; as many up rows)
    const i64 seg_bytes = (i64)rows * p.w_row_bytes;
    const int stage_bytes = p.stage_spans * TMA_SPAN_BYTES;
    const int seg_stages = (int)((seg_bytes + stage_bytes - 1) / stage_bytes);
    const int num_stages = seg_stages * (SILU ? 2 : 1);
    const int ring = p.stages;                    // a multiple of TMA_CONSUMERS (see the consumer loop)
    const int spans = p.k / TMA_SPAN_HALVES;      // spans per weight row
    half_t* xh = reinterpret_cast<half_t*>(tma_smem + (i64)ring * stage_bytes);  // x [k] fp16, after the ring
    float* partial = reinterpret_cast<float*>(xh + p.k);  // [(SILU ? 2 : 1) * rows][spans] fp32

    if (ring <= 0 || ring % TMA_CONSUMERS || ring > TMA_MAX_STAGES || p.stage_spans <= 0 ||
        p.stage_spans > TMA_STAGE_SPANS || p.m != 1)
        __trap();  // the launcher's contract (kernels_tma.gemv_tma_plan; the parity waits below rely on it)
    ring_init(full, empty, ring, 1);  // empty: the consuming warp's arrival
    __syncthreads();
    if (warp == TMA_CONSUMERS) {
        // producer warp (one lane): the first `ring` stages before the previous kernel ends (PDL; weights only,
        // so no griddepcontrol.wait here), then each slot again as soon as its warp has read it
        if (lane == 0) {
            for (int i = 0; i < num_stages; ++i) {
                const int slot = i % ring;
                if (i >= ring) mbar_wait(&empty[slot], (u32)(i / ring - 1) & 1u);
                const TmaStage s = tma_stage(p, f0, n_out, seg_bytes, seg_stages, stage_bytes, i);
                mbar_expect_tx(&full[slot], s.bytes);
                bulk_copy(tma_smem + slot * stage_bytes, s.src, s.bytes, &full[slot]);
            }
        }
        pdl_enter();  // before the epilogue's reads of x-dependent data (all threads take part in it)
    } else {
        pdl_enter();  // x (and the residual, y) only after the previous kernel
        // x -> smem as it is (16-byte vectors: the launcher's vec_ok), NORM_POST: with its sum of squares, the
        // same fixed order in every block
#if NORM_POST
        float ss = 0.f;
#endif
        for (int j = threadIdx.x * 8; j < p.k; j += TMA_CONSUMERS * 32 * 8) {
            const uint4 v = *reinterpret_cast<const uint4*>(p.x + j);
            *reinterpret_cast<uint4*>(xh + j) = v;
#if NORM_POST
            float f[8];
            unpack8(v, f);
#pragma unroll
            for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
#endif
        }
#if NORM_POST
        ss = warp_sum(ss);
        if (lane == 0) scratch[warp] = ss;
#endif
        named_sync(1, TMA_CONSUMERS * 32);
#if NORM_POST
        if (threadIdx.x == 0) {  // read by the epilogue, after the block's last barrier
            float t = 0.f;
            for (int w = 0; w < TMA_CONSUMERS; ++w) t += scratch[w];
            inv_rms = post_inv_rms(p, t);
        }
#endif
        // consumer warp w: whole stages w, w + TMA_CONSUMERS, ... (the warps read different stages at once). With
        // ring % TMA_CONSUMERS == 0 each slot has one consumer warp, which waits on every phase of its slots in
        // order: a parity wait can never mistake a phase two behind for the one it wants.
        for (int i = warp; i < num_stages; i += TMA_CONSUMERS) {
            const int slot = i % ring;
            const TmaStage s = tma_stage(p, f0, n_out, seg_bytes, seg_stages, stage_bytes, i);
            const int num_sp = (int)s.bytes / TMA_SPAN_BYTES;
            mbar_wait(&full[slot], (u32)(i / ring) & 1u);
            tma_read_stage(tma_smem + slot * stage_bytes, &empty[slot], num_sp, s.offset, spans, xh, partial,
                           s.seg * rows);
        }
    }
    __syncthreads();  // every partial is in smem
    for (int f = threadIdx.x; f < rows; f += TMA_THREADS) {
        float v = 0.f;
        for (int sp = 0; sp < spans; ++sp) v += partial[f * spans + sp];
#if NORM_POST
        v *= inv_rms;
#endif
#if SILU
        float u = 0.f;
        for (int sp = 0; sp < spans; ++sp) u += partial[(rows + f) * spans + sp];
#if NORM_POST
        u *= inv_rms;
#endif
        const float g = round_h(v);
        v = g / (1.f + __expf(-g)) * round_h(u);
#endif
        const int feat = f0 + f;
        v = gemv_out(p, 0, feat, v);
        p.y[feat] = f2h(v);
    }
#else
    pdl_enter();
    __trap();  // no bulk copies below SM90: the launcher never takes this build there
#endif
}
