// quant.cuh: GGUF block formats dequantized in registers (ggml-common.h layouts, 32 weights per block).
//   Q4_0: fp16 d, 16 bytes of nibbles; w = d * (q - 8)      (18 bytes)
//   Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; w = d * q + m (20 bytes)
//   Q8_0: fp16 d, 32 int8; w = d * q                         (34 bytes)
// Nibble layout: byte i holds element i (low nibble) and element i + 16 (high nibble).
// WTYPE selects the format at compile time: 0 = fp16 rows, 1 = Q4_0, 2 = Q4_1, 3 = Q8_0.
#pragma once
#include "common.cuh"

#ifndef WTYPE
#define WTYPE WTYPE_Q4_0
#endif

#if WTYPE == WTYPE_Q4_0
#define BLOCK_BYTES 18
#elif WTYPE == WTYPE_Q4_1
#define BLOCK_BYTES 20
#elif WTYPE == WTYPE_Q8_0
#define BLOCK_BYTES 34
#else
#define BLOCK_BYTES 64   // fp16: 32 weights
#endif

// WREPACK = 1: the weight rows are "repacked" (voltserve/backends/cuda/repack.py): [nb scales][64-byte quant
// groups], k % 256 == 0. Only gemv_mma, gemv_s8 / gemv_s8w and gemm_tc read that layout (the launcher routes such
// weights to them).
#ifndef WREPACK
#define WREPACK 0
#endif
#if WREPACK && WTYPE == WTYPE_F16
#error "fp16 rows have no repacked layout"
#endif
#if WREPACK
#if WTYPE == WTYPE_Q4_1
#define RP_SCALE_BYTES 4   // d | m << 16
#else
#define RP_SCALE_BYTES 2   // fp16 d
#endif
#if WTYPE == WTYPE_Q8_0
#define RP_PIECE 8         // bytes of one k slot (of 4) of a block's quants
#else
#define RP_PIECE 4
#endif
#define RP_GROUP (16 / RP_PIECE)  // blocks per 64-byte quant group: one 16-byte load per slot
// Byte offset in a repacked row of slot t's piece of block b (nb blocks per row).
VOLT_DEVICE i64 rp_piece_off(int nb, int b, int t) {
    return (i64)nb * RP_SCALE_BYTES + (i64)(b / RP_GROUP) * 64 + 16 * t + RP_PIECE * (b % RP_GROUP);
}
#endif

// Dequantize elements [j0, j0 + 8) of one 32-weight block (j0 in {0, 8, 16, 24}) into w[8].
VOLT_DEVICE void dequant8(const u8* blk, int j0, float* w) {
#if WTYPE == WTYPE_F16
    load8(reinterpret_cast<const half_t*>(blk) + j0, w);
#elif WTYPE == WTYPE_Q8_0
    const float d = h2f(*reinterpret_cast<const half_t*>(blk));
    const unsigned short* q2 = reinterpret_cast<const unsigned short*>(blk + 2 + j0);  // 2-byte aligned
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned short v = q2[i];
        w[2 * i] = d * (float)(signed char)(v & 0xff);
        w[2 * i + 1] = d * (float)(signed char)(v >> 8);
    }
#else
    const float d = h2f(*reinterpret_cast<const half_t*>(blk));
#if WTYPE == WTYPE_Q4_1
    const float mn = h2f(*reinterpret_cast<const half_t*>(blk + 2));
    const u8* qs = blk + 4;
#else
    const float mn = -8.f * d;
    const u8* qs = blk + 2;
#endif
    const bool high = j0 >= 16;
    const unsigned short* q2 = reinterpret_cast<const unsigned short*>(qs + (j0 & 15));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned short v = q2[i];
        const int b0 = v & 0xff, b1 = v >> 8;
        w[2 * i] = d * (float)(high ? b0 >> 4 : b0 & 15) + mn;
        w[2 * i + 1] = d * (float)(high ? b1 >> 4 : b1 & 15) + mn;
    }
#endif
}
