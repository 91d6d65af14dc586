// gemv.cu: y[m, n] = sum_k x[m, k] * W[n, k] for small m (decode), W fp16 or GGUF Q4_0/Q4_1/Q8_0 blocks
// dequantized in registers (the weights are streamed from memory once per launch, never expanded).
//
// Grid: (ceil(n / 4)); block 128 threads = 4 warps, one output feature per warp; a lane walks the row 32
// weights at a time (one quant block, or 32 fp16 = 4 vectors), so the warp reads the row contiguously.
// Compile-time: WTYPE (quant.cuh), MROWS (rows of x per launch, <= 8; the launcher loops for more).
// Requirements: quant k % 32 == 0 (GGUF); fp16 any k (scalar tail when k % 32 != 0 or rows are misaligned).
// SM70 path: the only path, fp32 accumulation. Reference: voltserve.backends.cpu.CpuBackend.linear.
#include "quant.cuh"

#ifndef MROWS
#define MROWS 1
#endif

struct GemvParams {
    const half_t* x;   // [m, k] fp16, row stride x_stride
    const u8* w;       // [n, w_row_bytes] weight rows (fp16 or GGUF blocks)
    half_t* y;         // [m, n] fp16, row stride y_stride
    i64 x_stride;      // elements
    i64 y_stride;      // elements
    i64 w_row_bytes;
    int m;             // <= MROWS
    int n;
    int k;
    int vec_ok;        // fp16 only: x and W rows 16-byte aligned and k % 8 == 0
};
VOLT_CHECK_PARAMS(GemvParams, VOLT_GEMV_PARAMS_BYTES);

extern "C" __global__ void __launch_bounds__(128) gemv(const GemvParams p) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= p.n) return;
    const u8* wrow = p.w + (i64)row * p.w_row_bytes;
    float acc[MROWS];
#pragma unroll
    for (int r = 0; r < MROWS; ++r) acc[r] = 0.f;
#if WTYPE == WTYPE_F16
    const half_t* wh = reinterpret_cast<const half_t*>(wrow);
    int k_vec = 0;
    if (p.vec_ok) {
        k_vec = p.k & ~255;  // full warp steps of 8 halves per lane
        for (int k0 = lane * 8; k0 < k_vec; k0 += 256) {
            float w[8];
            load8(wh + k0, w);
#pragma unroll
            for (int r = 0; r < MROWS; ++r) {
                if (r < p.m) {
                    float xv[8];
                    load8(p.x + r * p.x_stride + k0, xv);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[r] += w[j] * xv[j];
                }
            }
        }
    }
    for (int kk = k_vec + lane; kk < p.k; kk += 32) {
        const float w = h2f(wh[kk]);
#pragma unroll
        for (int r = 0; r < MROWS; ++r)
            if (r < p.m) acc[r] += w * h2f(p.x[r * p.x_stride + kk]);
    }
#else
    const int num_blocks = p.k / 32;
    for (int b = lane; b < num_blocks; b += 32) {
        const u8* blk = wrow + (i64)b * BLOCK_BYTES;
#pragma unroll
        for (int j0 = 0; j0 < 32; j0 += 8) {
            float w[8];
            dequant8(blk, j0, w);
#pragma unroll
            for (int r = 0; r < MROWS; ++r) {
                if (r < p.m) {
                    float xv[8];
                    load8(p.x + r * p.x_stride + b * 32 + j0, xv);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[r] += w[j] * xv[j];
                }
            }
        }
    }
#endif
#pragma unroll
    for (int r = 0; r < MROWS; ++r) {
        if (r < p.m) {
            const float v = warp_sum(acc[r]);
            if (lane == 0) p.y[r * p.y_stride + row] = f2h(v);
        }
    }
}
