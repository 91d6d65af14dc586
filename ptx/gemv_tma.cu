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
// is held for one smem round trip, not for the products; then per span fp32 products with x (staged once per
// block as fp32 in smem, tma_x_pos), one warp sum -> partial[row][span][r] in smem. The epilogue adds a row's
// spans in order: fixed-order sums, no atomics, so an output depends neither on the grid, the ring nor the other
// rows.
// Fusions (gemv.cu's semantics, fp16 roundings kept): NORM_POST (the RMSNorm folded into W: outputs scaled by
// 1 / rms(x), x^2 summed once per block), SILU (silu(gate) * up of a [gate; up] weight), `res` (residual).
// Compile-time: SILU, NORM_POST; MROWS (x rows) is built for 1 only (x's fp32 copy takes MROWS * k * 4 bytes of
// smem). Runtime: p.stages (ring depth, a multiple of 8, <= TMA_MAX_STAGES) and p.stage_spans (<=
// TMA_STAGE_SPANS); the launcher sizes the dynamic smem as the ring, x and the partials (kernels.gemv_tma_plan).
// Below SM90 the kernel is a trapping stub (no bulk copies there); the launcher routes SM90+ only.
// Reference: voltserve.backends.cpu.CpuBackend.linear.
#include "gemv_common.cuh"

#ifndef MROWS
#define MROWS 1
#endif
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
#define TMA_SPAN_HALVES 1024                       // a warp's unit of work: 4 x 16 bytes a lane, one warp sum
#define TMA_SPAN_BYTES (TMA_SPAN_HALVES * 2)
#define TMA_MAX_STAGES 32
#define TMA_STAGE_SPANS 4                          // most spans per stage (p.stage_spans <= it)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
VOLT_DEVICE void mbar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Arm `bar` for `bytes` of bulk copies (this thread's arrival counts as the phase's one expected arrival).
VOLT_DEVICE void mbar_expect_tx(unsigned long long* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

// One arrival on `bar` (a consumer's release of its slot).
VOLT_DEVICE void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over the first `threads` threads of the block.
VOLT_DEVICE void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Wait until `bar`'s phase of parity `parity` has completed (its bytes landed in smem).
VOLT_DEVICE void mbar_wait(unsigned long long* bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}

// One bulk copy global -> smem of `bytes` (16-byte multiple, both addresses 16-byte aligned), completing on `bar`.
VOLT_DEVICE void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}

// Position in the fp32 x staging of element c (c % 8 == 0 for a lane's 8): within each 256-element group the
// elements 0-3 of every lane's 8 come first, then 4-7, so a warp's two float4 reads are each 512 contiguous
// bytes (no bank conflicts), as a lane's 16-byte weight piece is.
VOLT_DEVICE int tma_x_pos(int c) { return (c & ~255) + ((c >> 3) & 31) * 4; }

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

extern "C" __global__ void __launch_bounds__(TMA_THREADS, 1) gemv_tma(const GemvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 tma_smem[];  // [stages][stage bytes] ring, x (fp32), the partials
    __shared__ unsigned long long full[TMA_MAX_STAGES], empty[TMA_MAX_STAGES];
    __shared__ float scratch[MROWS * TMA_CONSUMERS];
    // the launcher's bound on this static smem (linear.GEMV_TMA_STATIC_SMEM)
    static_assert(sizeof(full) + sizeof(empty) + 4 * MROWS * (TMA_CONSUMERS + 1) <= 1024, "static smem");
    __shared__ float inv_rms[MROWS];
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
    // [2 rows][spans][MROWS] fp32, after the ring (and x)
    float* partial = reinterpret_cast<float*>(tma_smem + (i64)ring * stage_bytes + MROWS * p.k * 4);

    if (ring <= 0 || ring % TMA_CONSUMERS || ring > TMA_MAX_STAGES || p.stage_spans <= 0 ||
        p.stage_spans > TMA_STAGE_SPANS || p.m > MROWS)
        __trap();  // the launcher's contract (kernels.gemv_tma_plan; the parity waits below rely on it)
    if (threadIdx.x == 0) {
        for (int s = 0; s < ring; ++s) {
            mbar_init(&full[s], 1);   // the producer's expect_tx arrival (+ the stage's bytes)
            mbar_init(&empty[s], 1);  // the consuming warp's arrival
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
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
        // x rows -> fp32 smem (NORM_POST: with each row's sum of squares, the same fixed order in every block)
        float* xs = reinterpret_cast<float*>(tma_smem + (i64)ring * stage_bytes);  // [MROWS][k] fp32, tma_x_pos
        float ss[MROWS];
#pragma unroll
        for (int r = 0; r < MROWS; ++r) ss[r] = 0.f;
        for (int j = threadIdx.x * 8; j < p.k; j += TMA_CONSUMERS * 32 * 8)
#pragma unroll
            for (int r = 0; r < MROWS; ++r) {
                if (r >= p.m) continue;
                float v[8];
                load8(p.x + r * p.x_stride + j, v);
                float* dst = xs + r * p.k + tma_x_pos(j);
                *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
                *reinterpret_cast<float4*>(dst + 128) = make_float4(v[4], v[5], v[6], v[7]);
#pragma unroll
                for (int e = 0; e < 8; ++e) ss[r] += v[e] * v[e];
            }
#if NORM_POST
#pragma unroll
        for (int r = 0; r < MROWS; ++r) {
            const float t = warp_sum(ss[r]);
            if (lane == 0) scratch[r * TMA_CONSUMERS + warp] = t;
        }
#endif
        named_sync(1, TMA_CONSUMERS * 32);
#if NORM_POST
        if (threadIdx.x < p.m) {  // read by the epilogue, after the block's last barrier
            float t = 0.f;
            for (int w = 0; w < TMA_CONSUMERS; ++w) t += scratch[threadIdx.x * TMA_CONSUMERS + w];
            inv_rms[threadIdx.x] = post_inv_rms(p, t);
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
            // the whole stage into registers (16 x 16 bytes a lane), then the slot goes back to the producer at
            // once: it is held for one smem round trip, not for the products
            const u8* stage = tma_smem + slot * stage_bytes + lane * 16;
            uint4 raw[TMA_STAGE_SPANS][4];
#pragma unroll
            for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    if (sp < num_sp)
                        raw[sp][j] = *reinterpret_cast<const uint4*>(stage + sp * TMA_SPAN_BYTES + j * 512);
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);  // release: orders the warp's reads before the refill
            const int first = (int)(s.offset / TMA_SPAN_BYTES);  // the stage's first span in its segment
            const int row0 = first / spans, sp0 = first - row0 * spans;
            float acc[TMA_STAGE_SPANS][2][MROWS];
#pragma unroll
            for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp) {
                const int col = ((sp0 + sp) % spans) * TMA_SPAN_HALVES;
#pragma unroll
                for (int r = 0; r < MROWS; ++r) acc[sp][0][r] = acc[sp][1][r] = 0.f;
                if (sp >= num_sp) continue;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    float w[8];
                    unpack8(raw[sp][j], w);
#pragma unroll
                    for (int r = 0; r < MROWS; ++r) {
                        if (r < p.m) {
                            const float* xp = xs + r * p.k + tma_x_pos(col + j * 256 + lane * 8);
                            const float4 x0 = *reinterpret_cast<const float4*>(xp);
                            const float4 x1 = *reinterpret_cast<const float4*>(xp + 128);
                            const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[sp][j & 1][r] = fmaf(w[e], xv[e], acc[sp][j & 1][r]);
                        }
                    }
                }
            }
#pragma unroll
            for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp) {
                const int t = sp0 + sp, row = row0 + t / spans;
#pragma unroll
                for (int r = 0; r < MROWS; ++r) {
                    const float v = warp_sum(acc[sp][0][r] + acc[sp][1][r]);
                    if (lane == 0 && sp < num_sp) partial[((s.seg * rows + row) * spans + t % spans) * MROWS + r] = v;
                }
            }
        }
    }
    __syncthreads();  // every partial is in smem
    for (int idx = threadIdx.x; idx < rows * MROWS; idx += TMA_THREADS) {
        const int f = idx / MROWS, r = idx % MROWS;
        if (r >= p.m) continue;
        float v = 0.f;
        for (int sp = 0; sp < spans; ++sp) v += partial[(f * spans + sp) * MROWS + r];
#if NORM_POST
        v *= inv_rms[r];
#endif
#if SILU
        float u = 0.f;
        for (int sp = 0; sp < spans; ++sp) u += partial[((rows + f) * spans + sp) * MROWS + r];
#if NORM_POST
        u *= inv_rms[r];
#endif
        const float g = round_h(v);
        v = g / (1.f + __expf(-g)) * round_h(u);
#endif
        const int feat = f0 + f;
        v = gemv_out(p, r, feat, v);
        p.y[r * p.y_stride + feat] = f2h(v);
    }
#else
    pdl_enter();
    __trap();  // no bulk copies below SM90: the launcher never takes this build there
#endif
}
