// gemv.cu: y[m, n] = sum_k x[m, k] * W[n, k] for small m (decode), W fp16 or GGUF Q4_0/Q4_1/Q8_0 blocks
// dequantized in registers (the weights are streamed from memory once per launch, never expanded).
// Compile-time: WTYPE (quant.cuh), MROWS (rows of x per launch, <= 8; the launcher loops for more).
// SM70 path: the only path, fp32 accumulation, 16-byte `__ldg` loads, no cp.async / ldmatrix / mma.
// Reference: voltserve.backends.cpu.CpuBackend.linear. Every output is one fixed-order sum (no atomics).
//
// Two kernels (the launcher, linear.py, picks one):
//   gemv_q (quant, k % 256 == 0 so every row is whole "superblocks" of 8 GGUF blocks = 256 weights, 16-byte
//     aligned: Q4_0 144 B, Q4_1 160 B, Q8_0 272 B): a block owns 32 output features (lane = feature) and its 8
//     warps split k: warp w takes superblocks w, w + 8, ...; the warp loads the 32 rows' superblocks with
//     coalesced 16-byte loads (all in flight together; Q4_0 also prefetches the next one across the barrier),
//     hands each lane its row through a per-warp smem tile, dequantizes in registers and multiplies with x,
//     staged once per 2048-wide k piece as fp32 in shared memory (read as broadcast float4, reused by all 32
//     rows). The 8 warps' partial sums are added in fixed order in smem.
//     Grid (ceil(n / 32)) / 256 threads / kernels.gemv_q_smem_bytes dynamic smem; the launcher uses it for m >= 3.
//   gemv (any WTYPE, quant k % 32 == 0): fp16 weights, and quant shapes gemv_q does not take: one warp per
//     output feature, lanes along k (fp16: 16-byte vectors, scalar tail; quant: one 32-weight block per lane,
//     2-byte loads). Grid (ceil(n / 4)) / 128 threads. (A multi-row fp16 variant with x reuse measured slower.)
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

// ---------------------------------------------------------------------------------------------------------
// gemv: simple fallback (one warp per output feature).
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

VOLT_DEVICE uint4 ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// ---------------------------------------------------------------------------------------------------------
// gemv_q: 32 features per block (lane = feature), 8 warps split k by 256-weight superblocks.
#define GQ_WARPS 8
#define GQ_SB 256                              // weights per superblock (8 GGUF blocks)
#define GQ_PIECE (GQ_WARPS * GQ_SB)            // k staged in smem at a time
#define GQ_SB_BYTES (8 * BLOCK_BYTES)          // 144 / 160 / 272 (fp16: 512, unused)
#define GQ_VECS (GQ_SB_BYTES / 16)
#define GQ_PITCH (GQ_VECS | 1)                 // 9 / 11 / 17 vectors per row in the smem tile
#if GQ_VECS <= 9
#define GQ_PREFETCH 1                          // Q4_0: hold two superblocks in registers (72 registers)
#else
#define GQ_PREFETCH 0                          // Q4_1 / Q8_0: one (40 / 68 registers; two would spill)
#endif

// 32-bit word at constant byte offset `off` (2-byte aligned) of a register array of words.
#define GQ_WORD(wd, off) (((off) & 3) ? __funnelshift_r((wd)[(off) >> 2], (wd)[((off) >> 2) + 1], 16) \
                                      : (wd)[(off) >> 2])
#define GQ_HALF(wd, off) ((half_t)(((off) & 3) ? ((wd)[(off) >> 2] >> 16) : ((wd)[(off) >> 2] & 0xffffu)))

// exact small integers from the mantissa of 2^23 + v (v < 2^23): no int->float conversion instruction
VOLT_DEVICE float magic_f(u32 v) { return __int_as_float(0x4B000000u | v); }

// Coalesced load of one superblock of each of the block's 32 rows: piece i = j * 32 + lane of the warp's
// 32 x GQ_VECS 16-byte pieces is row i / GQ_VECS, vector i % GQ_VECS, so a load instruction reads a few whole
// runs of 144-272 contiguous bytes (instead of 32 rows 16 bytes each). gq_transpose hands each lane its row.
VOLT_DEVICE void gq_load(uint4* v, const u8* w, i64 row_bytes, int row0, int n, int sb, int lane, bool ok) {
    if (!ok) return;
#pragma unroll
    for (int j = 0; j < GQ_VECS; ++j) {
        const int i = j * 32 + lane;
        const int row = min(row0 + i / GQ_VECS, n - 1);  // rows past n: a valid row, result not stored
        v[j] = ldg16(w + (i64)row * row_bytes + (i64)sb * GQ_SB_BYTES + (i % GQ_VECS) * 16);
    }
}

// Through this warp's smem tile (row pitch GQ_PITCH vectors, odd, so the per-lane reads are conflict-free):
// on return v holds this lane's own row's superblock.
VOLT_DEVICE void gq_transpose(uint4* v, uint4* tile, int lane) {
#pragma unroll
    for (int j = 0; j < GQ_VECS; ++j) {
        const int i = j * 32 + lane;
        tile[(i / GQ_VECS) * GQ_PITCH + i % GQ_VECS] = v[j];
    }
    __syncwarp();
#pragma unroll
    for (int j = 0; j < GQ_VECS; ++j) v[j] = tile[lane * GQ_PITCH + j];
    __syncwarp();
}

// acc[r] += x[r, k0:k0+256] . dequant(superblock); xs = this warp's 256 columns of the staged fp32 x
VOLT_DEVICE void gq_compute(const uint4* v, const float* xs, int m, float* acc) {
    const u32* wd = reinterpret_cast<const u32*>(v);
#pragma unroll
    for (int b = 0; b < 8; ++b) {
        const int off = b * BLOCK_BYTES;
        const float d = h2f(GQ_HALF(wd, off));
#if WTYPE == WTYPE_Q8_0
        float part[MROWS];
#pragma unroll
        for (int r = 0; r < MROWS; ++r) part[r] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {  // word j: elements 4j .. 4j+3
            const u32 q = GQ_WORD(wd, off + 2 + 4 * j) ^ 0x80808080u;  // signed -> q + 128
            float w[4];
#pragma unroll
            for (int e = 0; e < 4; ++e)  // bits 0x4B0000bb = 2^23 + (q + 128)
                w[e] = __int_as_float(__byte_perm(q, 0x4B000000u, 0x7440 + e)) - 8388736.f;
#pragma unroll
            for (int r = 0; r < MROWS; ++r) {
                if (r < m) {
                    const float4 xv = *reinterpret_cast<const float4*>(xs + r * GQ_PIECE + b * 32 + 4 * j);
                    part[r] = fmaf(w[0], xv.x, part[r]);
                    part[r] = fmaf(w[1], xv.y, part[r]);
                    part[r] = fmaf(w[2], xv.z, part[r]);
                    part[r] = fmaf(w[3], xv.w, part[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MROWS; ++r) acc[r] = fmaf(d, part[r], acc[r]);
#else
#if WTYPE == WTYPE_Q4_1
        const float mn = h2f(GQ_HALF(wd, off + 2));
        const int qoff = off + 4;
#else
        const int qoff = off + 2;
#endif
        float part[MROWS];
#pragma unroll
        for (int r = 0; r < MROWS; ++r) part[r] = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {  // word j: bytes 4j..4j+3 = elements 4j.. (low) and 4j+16.. (high)
            const u32 q = GQ_WORD(wd, qoff + 4 * j);
            float lo[4], hi[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
#if WTYPE == WTYPE_Q4_1
                lo[e] = fmaf(d, magic_f((q >> (8 * e)) & 15u) - 8388608.f, mn);
                hi[e] = fmaf(d, magic_f((q >> (8 * e + 4)) & 15u) - 8388608.f, mn);
#else
                lo[e] = magic_f((q >> (8 * e)) & 15u) - 8388616.f;  // q - 8
                hi[e] = magic_f((q >> (8 * e + 4)) & 15u) - 8388616.f;
#endif
            }
#pragma unroll
            for (int r = 0; r < MROWS; ++r) {
                if (r < m) {
                    const float4 xl = *reinterpret_cast<const float4*>(xs + r * GQ_PIECE + b * 32 + 4 * j);
                    const float4 xh = *reinterpret_cast<const float4*>(xs + r * GQ_PIECE + b * 32 + 16 + 4 * j);
                    part[r] = fmaf(lo[0], xl.x, part[r]);
                    part[r] = fmaf(lo[1], xl.y, part[r]);
                    part[r] = fmaf(lo[2], xl.z, part[r]);
                    part[r] = fmaf(lo[3], xl.w, part[r]);
                    part[r] = fmaf(hi[0], xh.x, part[r]);
                    part[r] = fmaf(hi[1], xh.y, part[r]);
                    part[r] = fmaf(hi[2], xh.z, part[r]);
                    part[r] = fmaf(hi[3], xh.w, part[r]);
                }
            }
        }
#if WTYPE == WTYPE_Q4_1
#pragma unroll
        for (int r = 0; r < MROWS; ++r) acc[r] += part[r];
#else
#pragma unroll
        for (int r = 0; r < MROWS; ++r) acc[r] = fmaf(d, part[r], acc[r]);
#endif
#endif
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) gemv_q(const GemvParams p) {
#if WTYPE != WTYPE_F16
    extern __shared__ float gq_smem[];
    float* xs = gq_smem;                             // [MROWS][GQ_PIECE] fp32
    float* red = gq_smem + MROWS * GQ_PIECE;         // [GQ_WARPS][MROWS][32]
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    uint4* tile = reinterpret_cast<uint4*>(red + GQ_WARPS * MROWS * 32) + warp * 32 * GQ_PITCH;
    const int row0 = blockIdx.x * 32, row = row0 + lane;
    const bool row_ok = row < p.n;
    const int nsb = p.k / GQ_SB;
    float acc[MROWS];
#pragma unroll
    for (int r = 0; r < MROWS; ++r) acc[r] = 0.f;
    uint4 cur[GQ_VECS];
    gq_load(cur, p.w, p.w_row_bytes, row0, p.n, warp, lane, warp < nsb);
    for (int s0 = 0; s0 < nsb; s0 += GQ_WARPS) {
        const int sb = s0 + warp;
#if GQ_PREFETCH
        uint4 nxt[GQ_VECS];
        gq_load(nxt, p.w, p.w_row_bytes, row0, p.n, sb + GQ_WARPS, lane, sb + GQ_WARPS < nsb);
#endif
        __syncthreads();  // the previous piece of xs is consumed
        const int k0 = s0 * GQ_SB;
        const int kn = min(GQ_PIECE, p.k - k0);  // multiple of 256
        for (int i = threadIdx.x; i < MROWS * (GQ_PIECE / 8); i += blockDim.x) {
            const int r = i / (GQ_PIECE / 8), c = (i % (GQ_PIECE / 8)) * 8;
            if (r < p.m && c < kn) {
                float v[8];
                load8(p.x + r * p.x_stride + k0 + c, v);
                float4* dst = reinterpret_cast<float4*>(xs + r * GQ_PIECE + c);
                dst[0].x = v[0]; dst[0].y = v[1]; dst[0].z = v[2]; dst[0].w = v[3];
                dst[1].x = v[4]; dst[1].y = v[5]; dst[1].z = v[6]; dst[1].w = v[7];
            }
        }
        __syncthreads();
        if (sb < nsb) {
            gq_transpose(cur, tile, lane);
            gq_compute(cur, xs + warp * GQ_SB, p.m, acc);
        }
#if GQ_PREFETCH
#pragma unroll
        for (int i = 0; i < GQ_VECS; ++i) cur[i] = nxt[i];
#else
        gq_load(cur, p.w, p.w_row_bytes, row0, p.n, sb + GQ_WARPS, lane, sb + GQ_WARPS < nsb);
#endif
    }
#pragma unroll
    for (int r = 0; r < MROWS; ++r) red[(warp * MROWS + r) * 32 + lane] = acc[r];
    __syncthreads();
    if (threadIdx.x < MROWS * 32) {
        const int r = threadIdx.x >> 5;
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < GQ_WARPS; ++w) v += red[(w * MROWS + r) * 32 + lane];  // fixed order
        if (r < p.m && row_ok) p.y[r * p.y_stride + row] = f2h(v);
    }
#endif
}
