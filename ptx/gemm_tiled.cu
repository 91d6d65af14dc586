// gemm_tiled.cu: y[m, n] = sum_k x[m, k] * W[n, k] for larger m (prefill on quantized weights), W fp16 or GGUF
// Q4_0/Q4_1/Q8_0; each 64x32 weight tile is dequantized in registers into shared memory (never to global memory).
//
// Grid: (ceil(n / 64), ceil(m / 64)); block 256 threads, each computing a 4x4 micro-tile of the 64x64 output tile.
// Shared memory (static): x tile [32][64] fp32 + W tile [32][64] fp32 = 16 KiB, k-major so the inner loop reads
// 4 consecutive floats of each.
// Compile-time: WTYPE (quant.cuh). Requirements: quant k % 32 == 0; fp16 any k.
// SM70 path: SIMT fp32 FMA. A WMMA (m16n16k16) / mma.m8n8k4 tensor-core path is the next tuning step.
// Reference: voltserve.backends.cpu.CpuBackend.linear.
#include "quant.cuh"

#define TM 64
#define TN 64
#define TK 32

struct GemmParams {
    const half_t* x;   // [m, k] fp16, row stride x_stride
    const u8* w;       // [n, w_row_bytes] weight rows (fp16 or GGUF blocks)
    half_t* y;         // [m, n] fp16, row stride y_stride
    i64 x_stride;      // elements
    i64 y_stride;      // elements
    i64 w_row_bytes;
    int m;
    int n;
    int k;
    int pad_;
};
VOLT_CHECK_PARAMS(GemmParams, VOLT_GEMM_PARAMS_BYTES);

extern "C" __global__ void __launch_bounds__(256) gemm_tiled(const GemmParams p) {
    pdl_enter();
    __shared__ float xs[TK][TM];
    __shared__ float ws[TK][TN];
    const int tid = threadIdx.x;
    const int tx = tid % 16, ty = tid / 16;
    const int n0 = blockIdx.x * TN, m0 = blockIdx.y * TM;
    // loader roles: 64 rows x 4 chunks of 8 along k
    const int lr = tid / 4, lc = (tid % 4) * 8;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;

    for (int k0 = 0; k0 < p.k; k0 += TK) {
        float xv[8], wv[8];
        const int xm = m0 + lr, wn = n0 + lr;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int kk = k0 + lc + j;
            xv[j] = (xm < p.m && kk < p.k) ? h2f(p.x[(i64)xm * p.x_stride + kk]) : 0.f;
        }
        if (wn < p.n) {
            const u8* wrow = p.w + (i64)wn * p.w_row_bytes;
#if WTYPE == WTYPE_F16
            const half_t* wh = reinterpret_cast<const half_t*>(wrow);
#pragma unroll
            for (int j = 0; j < 8; ++j) wv[j] = k0 + lc + j < p.k ? h2f(wh[k0 + lc + j]) : 0.f;
#else
            dequant8(wrow + (i64)(k0 / 32) * BLOCK_BYTES, lc, wv);
#endif
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) wv[j] = 0.f;
        }
        __syncthreads();  // previous tile consumed
#pragma unroll
        for (int j = 0; j < 8; ++j) { xs[lc + j][lr] = xv[j]; ws[lc + j][lr] = wv[j]; }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < TK; ++kk) {
            const float4 a = *reinterpret_cast<const float4*>(&xs[kk][ty * 4]);
            const float4 b = *reinterpret_cast<const float4*>(&ws[kk][tx * 4]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int mm = m0 + ty * 4 + i;
        if (mm >= p.m) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int nn = n0 + tx * 4 + j;
            if (nn < p.n) p.y[(i64)mm * p.y_stride + nn] = f2h(acc[i][j]);
        }
    }
}
