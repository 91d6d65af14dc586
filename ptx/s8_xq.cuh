// s8_xq.cuh: x quantized per 32 elements as llama.cpp's Q8_1 (ggml-common.h block_q8_1) in the layout the int8
// decode GEMVs read (gemv_s8.cu's header describes it), for the kernels that write it: quantize_s8 (the weight
// format known at compile time) and attn_decode (which quantizes its output for the o_proj launch after it, the
// format passed at run time). One block of 32 elements: d = max|x| / 127, q = rint(x * (127 / max|x|)), s =
// d * sum(q) (Q4_0 stores -8 s), 0 for an all-zero block; a NaN makes d NaN.
#pragma once
#include "common.cuh"

VOLT_DEVICE int s8_pitch(int nb) { return nb * 32 + 16; }  // bytes of one quantized x row (+16: fewer bank conflicts)
// x scales per block: [nb] for one row, else [nb][8] (up to 8 rows), [nb][16] or [nb][32] (gemv_s8's S8_NCOL = 2 / 4)
VOLT_DEVICE int s8_cols(int rows) { return rows == 1 ? 1 : rows <= 8 ? 8 : rows <= 16 ? 16 : 32; }

VOLT_DEVICE int cvt_rni(float v) {
    int i;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(i) : "f"(v));
    return i;
}
// max that keeps a NaN (fmaxf drops it): a NaN in x makes its block's d NaN, so y is NaN as with gemv_mma
VOLT_DEVICE float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }
VOLT_DEVICE u32 pack_s8x4(const int* q) {
    return (u32)(q[0] & 0xff) | (u32)(q[1] & 0xff) << 8 | (u32)(q[2] & 0xff) << 16 | (u32)(q[3] & 0xff) << 24;
}

// Byte offset in xq of the 4 quantized elements 4 j4 .. 4 j4 + 3 (j4 < 8) of block b of x row r (nb blocks a
// row), for weights of format fmt (WTYPE_Q4_0 / Q4_1 / Q8_0): the repacked rows' load groups hold RP_GROUP blocks (Q8_0: 2, Q4: 4),
// each of 4 k slots; Q8_0 slot t holds elements 8t..8t+7 (two words), Q4's low nibbles of bytes 4t'..4t'+3 pair
// with elements 4t'.. of the first half, the high nibbles with 16 + 4t'.. (quant.cuh, gemv_s8.cu's header).
VOLT_DEVICE int xq_offset(int fmt, int nb, int r, int b, int j4) {
    const int group = fmt == WTYPE_Q8_0 ? 2 : 4, qq = j4 >> 1, half = j4 & 1;
    const int row = r * s8_pitch(nb) + (b / group) * (32 * group) + (b % group) * 8;
    return fmt == WTYPE_Q8_0 ? row + qq * 8 * group + 4 * half : row + (2 * (qq & 1) + half) * 8 * group + 4 * (qq >> 1);
}

// Block b's scale pair (d, s) as the GEMV reads it: Q4_0 stores -8 s (its weights' offset of 8).
VOLT_DEVICE float2 xq_scales(int fmt, float amax, int sum) {
    const float d = amax / 127.f, s = d * (float)sum;
    return make_float2(d, fmt == WTYPE_Q4_0 ? -8.f * s : s);
}

// Quantize one block of x row r held by L = 32 / V lanes of a warp in order (lane j of the group: elements V j ..
// V j + V - 1; groups aligned to L lanes), values v as the fp16 x holds them, into xq (rows x rows, scales after
// them) for weights of format fmt. Every lane of the warp must call it (shuffles).
template <int V>
VOLT_DEVICE void xq_store_block(u8* xq, int fmt, int rows, int nb, int r, int b, const float (&v)[V]) {
    static_assert(V == 1 || V == 4, "1 or 4 elements a lane");
    constexpr int L = 32 / V;
    const int j = threadIdx.x & (L - 1);
    float amax = 0.f;
#pragma unroll
    for (int e = 0; e < V; ++e) amax = max_nan(amax, fabsf(v[e]));
#pragma unroll
    for (int o = 1; o < L; o <<= 1) amax = max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float id = amax > 0.f ? 127.f / amax : 0.f;
    int q[4] = {0, 0, 0, 0}, sum = 0;
#pragma unroll
    for (int e = 0; e < V; ++e) {
        q[e] = cvt_rni(v[e] * id);
        sum += q[e];
    }
#pragma unroll
    for (int o = 1; o < L; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (V == 1) {  // lanes 4 j' .. 4 j' + 3 -> one word, written by the first
#pragma unroll
        for (int e = 1; e < 4; ++e) q[e] = __shfl_down_sync(0xffffffffu, q[0], e);
    }
    if (V == 4 || (j & 3) == 0)
        *reinterpret_cast<u32*>(xq + xq_offset(fmt, nb, r, b, V == 4 ? j : j >> 2)) = pack_s8x4(q);
    if (j == 0) reinterpret_cast<float2*>(xq + rows * s8_pitch(nb))[b * s8_cols(rows) + r] = xq_scales(fmt, amax, sum);
}
