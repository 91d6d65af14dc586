// silu_mul.cu: SwiGLU activation (Shazeer 2020), out[t, i] = silu(x[t, i]) * x[t, inner + i], silu(a) = a / (1 + e^-a).
//
// Grid: (ceil(inner / blockDim.x), num_tokens); block 256 threads; no smem.
// SM70 path: the only path, fp32 math, one fp16 rounding. Reference: voltserve.backends.cpu.CpuBackend.silu_and_mul.
#include "common.cuh"

struct SiluMulParams {
    const half_t* x;   // [num_tokens, 2 * inner] fp16, row stride x_stride
    half_t* out;       // [num_tokens, inner] fp16, contiguous
    i64 x_stride;      // elements
    int num_tokens;
    int inner;
};
VOLT_CHECK_PARAMS(SiluMulParams, VOLT_SILU_MUL_PARAMS_BYTES);

extern "C" __global__ void silu_mul(const SiluMulParams p) {
    pdl_enter();
    const i64 t = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= p.inner) return;
    const half_t* x = p.x + t * p.x_stride;
    const float a = h2f(x[i]), b = h2f(x[p.inner + i]);
    p.out[t * p.inner + i] = f2h(a / (1.f + __expf(-a)) * b);
}
