// rmsnorm.cu: RMSNorm fused with the residual add (Zhang & Sennrich 2019, "Root Mean Square Layer Norm").
//
//   s = x + residual (rounded to fp16, as the fp16 reference does); residual_out = s
//   out = s * rsqrt(mean(s^2) + eps) * weight
// With residual == nullptr: s = x and residual_out is not written.
// Grid: (num_tokens); block RN_THREADS (256) threads; 32 floats of static shared memory for the block reduction.
// vec_ok (hidden % 8 == 0, rows and strides 16-byte aligned): 16-byte loads and stores, all of a row's loads
// issued together and s kept in registers for the output pass (up to RN_CACHE vectors a thread, hidden <= 8192;
// wider rows stream the rest and re-read it), the weight's loads written before pdl_enter (it is constant; the
// sm_90 SASS still places the grid-dependency wait first). A decode row
// is then one memory round trip, one block reduction and one store: the old 2-byte loop (16 dependent loads a
// thread, then 16 more for the output) took ~10 us per launch at hidden 4096 on an H200.
// Otherwise 2-byte loads in a loop (unaligned slices). SM70 path: the only path, fp32 math.
// Reference: voltserve.backends.cpu.CpuBackend.rms_norm.
#include "common.cuh"

#define RN_THREADS 256
#define RN_CACHE 4  // 16-byte vectors of s a thread keeps in registers between the two passes

struct RmsNormParams {
    const half_t* x;         // [num_tokens, hidden] fp16, row stride x_stride
    const half_t* residual;  // [num_tokens, hidden] fp16, row stride residual_stride, or nullptr
    const float* weight;     // [hidden] fp32
    half_t* out;             // [num_tokens, hidden] fp16, contiguous
    half_t* residual_out;    // [num_tokens, hidden] fp16, contiguous (unused without residual)
    i64 x_stride;            // elements
    i64 residual_stride;     // elements
    int num_tokens;
    int hidden;
    float eps;
    int vec_ok;              // the 16-byte path's alignment holds (see above)
};
VOLT_CHECK_PARAMS(RmsNormParams, VOLT_RMSNORM_PARAMS_BYTES);

// s of 8 elements: x + residual rounded to fp16 (x alone without a residual), as packed fp16; sum_sq += s^2.
VOLT_DEVICE uint4 rn_sum8(const uint4& xv, bool add, const uint4& rv, float& sum_sq) {
    float s[8];
    unpack8(xv, s);
    if (add) {
        float r[8];
        unpack8(rv, r);
#pragma unroll
        for (int e = 0; e < 8; ++e) s[e] = round_h(s[e] + r[e]);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) sum_sq += s[e] * s[e];
    return pack8(s);
}

VOLT_DEVICE float4 ldg_f4(const float* p) { return __ldg(reinterpret_cast<const float4*>(p)); }

// The 16-byte path (vec_ok) of row t.
VOLT_DEVICE void rms_norm_vec(const RmsNormParams& p, i64 t, float* scratch) {
    const int nvec = p.hidden >> 3;
    float4 w[RN_CACHE][2];
#pragma unroll
    for (int i = 0; i < RN_CACHE; ++i) {  // constant: in flight across the PDL wait
        const int v = min(threadIdx.x + i * RN_THREADS, nvec - 1);  // past the row's end: unused
        w[i][0] = ldg_f4(p.weight + v * 8);
        w[i][1] = ldg_f4(p.weight + v * 8 + 4);
    }
    pdl_enter();
    const uint4* x = reinterpret_cast<const uint4*>(p.x + t * p.x_stride);
    const uint4* res = p.residual != nullptr ? reinterpret_cast<const uint4*>(p.residual + t * p.residual_stride)
                                             : nullptr;
    uint4* res_out = reinterpret_cast<uint4*>(p.residual_out + t * p.hidden);
    uint4 xv[RN_CACHE], rv[RN_CACHE];
#pragma unroll
    for (int i = 0; i < RN_CACHE; ++i) {  // all loads of the row first
        const int v = threadIdx.x + i * RN_THREADS;
        rv[i] = make_uint4(0u, 0u, 0u, 0u);
        if (v < nvec) {
            xv[i] = x[v];
            if (res != nullptr) rv[i] = res[v];
        }
    }
    float sum_sq = 0.f;
#pragma unroll
    for (int i = 0; i < RN_CACHE; ++i) {
        const int v = threadIdx.x + i * RN_THREADS;
        if (v < nvec) {
            xv[i] = rn_sum8(xv[i], res != nullptr, rv[i], sum_sq);  // xv now holds s
            if (res != nullptr) res_out[v] = xv[i];
        }
    }
    for (int v = threadIdx.x + RN_CACHE * RN_THREADS; v < nvec; v += RN_THREADS) {  // rows wider than the cache
        uint4 r = make_uint4(0u, 0u, 0u, 0u);
        if (res != nullptr) r = res[v];
        const uint4 sv = rn_sum8(x[v], res != nullptr, r, sum_sq);
        if (res != nullptr) res_out[v] = sv;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / (float)p.hidden + p.eps);
    uint4* out = reinterpret_cast<uint4*>(p.out + t * p.hidden);
#pragma unroll
    for (int i = 0; i < RN_CACHE; ++i) {
        const int v = threadIdx.x + i * RN_THREADS;
        if (v < nvec) out[v] = norm_scale8(xv[i], inv_rms, w[i][0], w[i][1]);
    }
    // each thread re-reads only the elements it wrote itself, so no barrier is needed for res_out
    const uint4* src = res != nullptr ? res_out : x;
    for (int v = threadIdx.x + RN_CACHE * RN_THREADS; v < nvec; v += RN_THREADS)
        out[v] = norm_scale8(src[v], inv_rms, ldg_f4(p.weight + v * 8), ldg_f4(p.weight + v * 8 + 4));
}

extern "C" __global__ void __launch_bounds__(RN_THREADS) rms_norm(const RmsNormParams p) {
    __shared__ float scratch[32];
    const i64 t = blockIdx.x;
    if (p.vec_ok) {
        rms_norm_vec(p, t, scratch);
        return;
    }
    pdl_enter();
    const half_t* x = p.x + t * p.x_stride;
    half_t* res_out = p.residual_out + t * p.hidden;
    float sum_sq = 0.f;
    for (int j = threadIdx.x; j < p.hidden; j += blockDim.x) {
        float s = h2f(x[j]);
        if (p.residual != nullptr) {
            s = round_h(s + h2f(p.residual[t * p.residual_stride + j]));
            res_out[j] = f2h(s);
        }
        sum_sq += s * s;
    }
    const float inv_rms = rsqrtf(block_sum(sum_sq, scratch) / (float)p.hidden + p.eps);
    half_t* out = p.out + t * p.hidden;
    // each thread re-reads only the elements it wrote itself, so no barrier is needed for res_out
    const half_t* src = p.residual != nullptr ? res_out : x;
    for (int j = threadIdx.x; j < p.hidden; j += blockDim.x) out[j] = f2h(h2f(src[j]) * inv_rms * p.weight[j]);
}
