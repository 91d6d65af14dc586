// gemv_s8.cuh: x quantized per 32 elements as llama.cpp's Q8_1 for the int8 decode GEMVs on repacked rows
// (gemv_s8.cu's gemv_s8 / gemv_s8w / quantize_s8, gemv_tma_s8.cu), and the fp32 scaling of one block's int32 sum.
// The layout of the quantized x in shared memory (xq rows of s8_pitch bytes, then the scales xs) and the scaling
// per format are described in gemv_s8.cu's header. Needs WTYPE and WREPACK = 1 (quant.cuh's RP_* layout).
#pragma once
#include "gemv_mma.cuh"
#include "s8_xq.cuh"

#ifndef S8_M1
#define S8_M1 0
#endif
#ifndef S8_NCOL
#define S8_NCOL 1  // groups of 8 x rows (MMA B columns) per launch: 2 / 4 take 9-16 / 17-32 rows in one pass
#endif
#define S8_COLS (S8_M1 ? 1 : 8 * S8_NCOL)  // x scales per block in smem (s8_cols)
#if WREPACK && WTYPE != WTYPE_F16
static_assert((WTYPE == WTYPE_Q8_0 ? 2 : 4) == RP_GROUP, "s8_xq.cuh's xq_offset assumes quant.cuh's RP_GROUP");
#endif

#ifndef S8_QBATCH
#define S8_QBATCH 4  // quarters per thread whose loads are issued together (the prologue is L2-latency-bound)
#endif

// Quantize quarter idx (8 elements: quarter qq of block b of x row r) from its loaded values xv (fp16) and, with
// the fused norm, norm_w's 8 values; the 4 quarters of a block are adjacent lanes (quad shuffles).
VOLT_DEVICE void s8_quantize_quarter(const GemvParams& p, const float* inv_rms, u8* xq, float2* xs, int idx,
                                     uint4 xv, float4 nw0, float4 nw1) {
    const int nb = p.k / 32;
    const int r = idx / (nb * 4), b = (idx >> 2) - r * nb, qq = idx & 3;
    float v[8];
    unpack8(xv, v);
    if (p.norm_w != nullptr) {
        const float inv = inv_rms[r];
        const float nw[8] = {nw0.x, nw0.y, nw0.z, nw0.w, nw1.x, nw1.y, nw1.z, nw1.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = round_h(v[e] * inv * nw[e]);
    }
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = max_nan(amax, fabsf(v[e]));
    amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int q[8], sum = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        q[e] = cvt_rni(v[e] * id);
        sum += q[e];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
#if WREPACK
    const int j4 = 2 * qq;  // elements 8qq..8qq+3, then 8qq+4..8qq+7
#if WTYPE == WTYPE_Q8_0
    *reinterpret_cast<uint2*>(xq + xq_offset(WTYPE, nb, r, b, j4)) = make_uint2(pack_s8x4(q), pack_s8x4(q + 4));
#else
    *reinterpret_cast<u32*>(xq + xq_offset(WTYPE, nb, r, b, j4)) = pack_s8x4(q);
    *reinterpret_cast<u32*>(xq + xq_offset(WTYPE, nb, r, b, j4 + 1)) = pack_s8x4(q + 4);
#endif
#endif
    if (qq == 0) xs[b * S8_COLS + r] = xq_scales(WTYPE, amax, sum);
}

// Quantize the m rows of x (normalized first with norm_w, inv_rms[r] = 1 / rms of row r) into xq / xs, QB
// quarters per thread at a time, their loads issued before any is used. By threads [0, threads) of the block
// (a multiple of 32; the whole block unless told).
template <int QB = S8_QBATCH>
VOLT_DEVICE void s8_quantize_x(const GemvParams& p, const float* inv_rms, u8* xq, float2* xs,
                               int threads = blockDim.x) {
    const int nb = p.k / 32;
    const int total = p.m * nb * 4;  // a multiple of 32 (nb % 8 == 0): each warp's quarters are all in or all out
    const bool norm = p.norm_w != nullptr;
    for (int i0 = threadIdx.x; i0 < total; i0 += QB * threads) {
        uint4 xv[QB];
        float4 nw[QB][2];
#pragma unroll
        for (int j = 0; j < QB; ++j) {
            const int idx = i0 + j * threads;
            if (idx < total) {
                const int r = idx / (nb * 4), e0 = ((idx >> 2) - r * nb) * 32 + 8 * (idx & 3);
                xv[j] = *reinterpret_cast<const uint4*>(p.x + r * p.x_stride + e0);
                if (norm) {
                    nw[j][0] = *reinterpret_cast<const float4*>(p.norm_w + e0);
                    nw[j][1] = *reinterpret_cast<const float4*>(p.norm_w + e0 + 4);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < QB; ++j) {
            const int idx = i0 + j * threads;
            if (idx < total) s8_quantize_quarter(p, inv_rms, xq, xs, idx, xv[j], nw[j][0], nw[j][1]);
        }
    }
}

// acc + one block's int32 sum ci scaled (exact in fp32: |ci| < 2^24): (dw, mw) = the weight block's d and Q4_1's
// m, (dx, sx) = the x block's d and x-sum term (Q4_0: -8 s, Q4_1: s); mw, sx unused where the format has none.
// The conversion is one I2FP on sm_90; the exact integer-add trick (bits of 1.5 * 2^23 + ci, minus 1.5 * 2^23)
// measured 0-8% slower on every gemv_s8 row (session 22): these kernels are not bound by the conversion unit.
VOLT_DEVICE float s8_add_block(float acc, float dw, float mw, float dx, float sx, int ci) {
    const float c = (float)ci;
#if WTYPE == WTYPE_Q8_0
    return fmaf(dw, dx * c, acc);
#elif WTYPE == WTYPE_Q4_0
    return fmaf(dw, fmaf(dx, c, sx), acc);
#else
    return fmaf(dw, dx * c, fmaf(mw, sx, acc));
#endif
}

typedef u32 S8wScale;  // one Q8_0 load group's scales (gemv_s8w): 2 fp16 d

// fp32 of half h (0 low, 1 high) of a 32-bit word.
VOLT_DEVICE float half_of(u32 w, int h) { return h2f((half_t)(h ? w >> 16 : w & 0xffffu)); }
