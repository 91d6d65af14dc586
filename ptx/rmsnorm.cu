// rmsnorm.cu: RMSNorm fused with the residual add (Zhang & Sennrich 2019, "Root Mean Square Layer Norm").
//
//   s = x + residual (rounded to fp16, as the fp16 reference does); residual_out = s
//   out = s * rsqrt(mean(s^2) + eps) * weight
// With residual == nullptr: s = x and residual_out is not written.
// Grid: (num_tokens); block 256 threads; 32 floats of static shared memory for the block reduction.
// SM70 path: the only path, fp32 math. Reference: voltserve.backends.cpu.CpuBackend.rms_norm.
#include "common.cuh"

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
    int pad_;
};
VOLT_CHECK_PARAMS(RmsNormParams, VOLT_RMSNORM_PARAMS_BYTES);

extern "C" __global__ void rms_norm(const RmsNormParams p) {
    pdl_enter();
    __shared__ float scratch[32];
    const i64 t = blockIdx.x;
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
