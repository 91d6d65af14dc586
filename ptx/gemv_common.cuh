// gemv_common.cuh: what the decode GEMV kernels (gemv.cu, gemv_mma.cu, gemv_s8.cu, gemv_tma.cu) share: their
// params struct, the fused epilogue value and the fused RMSNorm's 1 / rms.
#pragma once
#include "quant.cuh"

struct GemvParams {
    const half_t* x;       // [m, k] fp16, row stride x_stride
    const u8* w;           // [n, w_row_bytes] weight rows (fp16 or GGUF blocks)
    half_t* y;             // [m, n] fp16 (SILU: [m, n / 2]), row stride y_stride
    const half_t* res;     // residual added to the output ([m, n] fp16, row stride y_stride), or nullptr
    const float* norm_w;   // [k] fp32: x rows are RMS-normalized and scaled by it before the product, or nullptr
    i64 x_stride;          // elements
    i64 y_stride;          // elements
    i64 w_row_bytes;
    int m;                 // <= MROWS
    int n;
    int k;
    int vec_ok;            // x 16-byte aligned with x_stride % 8 == 0 and k % 8 == 0 (fp16 W rows likewise)
    float eps;             // RMSNorm epsilon (norm_w, and NORM_POST builds)
    int prefetch_bytes;    // gemv, SM90+: leading bytes of each warp's first weight row(s) prefetched into L2
                           // before pdl_enter (the launcher bounds the total so the prefetch cannot thrash L2)
    u8* xq;                // gemv_s8 with S8_XG: x quantized once per launch (quantize_s8 writes, gemv_s8 reads)
    int stages;            // gemv_tma: stages in its shared-memory ring
    int stage_spans;       // gemv_tma: 2 KB spans per stage; gemv_tma_s8: weight rows per stage
    float* part;           // gemv_s8 S8_KSPLIT: fp32 partial sums [m, n] of the launches before (part_in) / for
                           // the launch after (part_out) this one
    int kb_begin;          // gemv_s8 S8_KSPLIT: this launch's 32-weight blocks of each row, [kb_begin, kb_end)
    int kb_end;
    int part_in;           // gemv_s8 S8_KSPLIT: 1 = add part to the launch's sums (fixed order: part + own)
    int part_out;          // gemv_s8 S8_KSPLIT: 1 = store the sums to part instead of y (no epilogue fusions)
    u8* xq_out;            // gemv_s8w SILU: y also quantized for the one-row gemv_s8w launch on the next weight
                           // (quantize_s8's bytes, s8_xq.cuh), or nullptr
    int xq_out_fmt;        // that weight's format (WTYPE_Q4_0 / Q4_1 / Q8_0)
};
VOLT_CHECK_PARAMS(GemvParams, VOLT_GEMV_PARAMS_BYTES);

// Fused epilogue value of one output: the fp16 rounding of each unfused op is kept, so a fused launch equals
// linear -> (+ residual | silu_mul) bit for bit (rows of the same kernel and bucket).
VOLT_DEVICE float gemv_out(const GemvParams& p, int r, int row, float v) {
    if (p.res != nullptr) v = round_h(v) + h2f(p.res[r * p.y_stride + row]);
    return v;
}

// 1 / rms of x row r (fp32 sum of squares by all threads of the block; every thread gets it).
// Needs all threads of the block (two barriers inside block_sum). A thread's 16-byte loads are issued BATCH at
// a time (quantize_s8: 4, one L2 round trip for a 4,096-wide row at 256 threads instead of two); the sum adds
// them in the same order whatever BATCH is, so 1 / rms is the same bit for bit.
template <int BATCH = 1>
VOLT_DEVICE float row_inv_rms(const GemvParams& p, int r, float* scratch) {
    const half_t* x = p.x + r * p.x_stride;
    float ss = 0.f;
    if (p.vec_ok) {
        const int step = blockDim.x * 8;
        for (int j0 = threadIdx.x * 8; j0 < p.k; j0 += BATCH * step) {
            uint4 raw[BATCH];
#pragma unroll
            for (int i = 0; i < BATCH; ++i)
                if (j0 + i * step < p.k) raw[i] = *reinterpret_cast<const uint4*>(x + j0 + i * step);
#pragma unroll
            for (int i = 0; i < BATCH; ++i)
                if (j0 + i * step < p.k) {
                    float v[8];
                    unpack8(raw[i], v);
#pragma unroll
                    for (int e = 0; e < 8; ++e) ss += v[e] * v[e];
                }
        }
    } else {
        for (int j = threadIdx.x; j < p.k; j += blockDim.x) {
            const float v = h2f(x[j]);
            ss += v * v;
        }
    }
    return rsqrtf(block_sum(ss, scratch) / (float)p.k + p.eps);
}

// inv_rms[r] = 1 / rms of x row r for every r < m, in shared memory; block-wide, ends synced.
VOLT_DEVICE void rows_inv_rms(const GemvParams& p, float* scratch, float* inv_rms) {
    for (int r = 0; r < p.m; ++r) {
        const float inv = row_inv_rms(p, r, scratch);
        if (threadIdx.x == 0) inv_rms[r] = inv;
    }
    __syncthreads();
}

#define GEMV_NORM_SCRATCH (8 * 32)  // floats of rows_inv_rms's scratch: [x row][warp]

// rows_inv_rms in one pass over x for all rows (their loads in flight together, one barrier pair) instead of
// a pass per row, whose m dependent L2 round trips and 2m barriers come before every block's first product.
// The same sums as row_inv_rms bit for bit (same per-thread order, same warp and cross-warp reductions).
// scratch: GEMV_NORM_SCRATCH floats.
VOLT_DEVICE void rows_inv_rms_one_pass(const GemvParams& p, float* scratch, float* inv_rms) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    float ss[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) ss[r] = 0.f;
    if (p.vec_ok) {
        for (int j = threadIdx.x * 8; j < p.k; j += blockDim.x * 8) {
            uint4 raw[8];  // packed: 4 registers a row while the loads are in flight
#pragma unroll
            for (int r = 0; r < 8; ++r)
                if (r < p.m) raw[r] = *reinterpret_cast<const uint4*>(p.x + r * p.x_stride + j);
#pragma unroll
            for (int r = 0; r < 8; ++r)
                if (r < p.m) {
                    float v[8];
                    unpack8(raw[r], v);
#pragma unroll
                    for (int e = 0; e < 8; ++e) ss[r] += v[e] * v[e];
                }
        }
    } else {
        for (int j = threadIdx.x; j < p.k; j += blockDim.x) {
#pragma unroll
            for (int r = 0; r < 8; ++r)
                if (r < p.m) {
                    const float v = h2f(p.x[r * p.x_stride + j]);
                    ss[r] += v * v;
                }
        }
    }
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        const float v = warp_sum(ss[r]);
        if (lane == 0 && r < p.m) scratch[r * 32 + warp] = v;
    }
    __syncthreads();
    if (warp < p.m) {  // warp r sums row r's per-warp partials (block_sum's cross-warp step)
        const float v = warp_sum(lane < num_warps ? scratch[warp * 32 + lane] : 0.f);
        if (lane == 0) inv_rms[warp] = rsqrtf(v / (float)p.k + p.eps);
    }
    __syncthreads();
}

// NORM_POST builds (gemv, fp16): the RMSNorm before the GEMV with its weight folded into W at load time
// (W' = W diag(g), CudaLinear.norm_folded), so rms_norm(x) . W = (x . W') / rms(x): each warp sums x^2 over the
// x it multiplies anyway and scales its outputs by 1 / rms. No prologue pass over x and no separate rms_norm
// launch; the products differ from rms_norm -> linear by the fp16 rounding of W' instead of the normalized x.
// 1 / rms of an x row from its fp32 sum of squares.
VOLT_DEVICE float post_inv_rms(const GemvParams& p, float sum_sq) { return rsqrtf(sum_sq / (float)p.k + p.eps); }

VOLT_DEVICE uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
