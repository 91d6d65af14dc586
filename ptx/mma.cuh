// mma.cuh: register-level tensor-core helpers shared by the kernels that build MMA fragments from their own loads,
// without ldmatrix (gemv_mma.cu, gemv_s8.cu, gemv_tma.cu, attention_decode.cu). Fragment layouts: PTX ISA,
// "Matrix fragments for mma.m16n8k16", "... for mma.m8n8k4" (fp16 x fp16 -> fp32 accumulate) and "... for
// mma.m16n8k32" (8-bit). Each helper emits its instruction only where it is called: the callers guard the SM80+
// shape by architecture.
#pragma once
#include "common.cuh"

// Bytes of {b, a} picked by the 4 selector nibbles (0-3: a, 4-7: b), e.g. 0x5410 = (a.lo, b.lo).
VOLT_DEVICE u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

// acc += A (16 x 16, row) * B (16 x 8, col), fp32 accumulate (SM80+).
VOLT_DEVICE void mma_m16n8k16(float (&acc)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Each quad pair's acc += A (8 x 4, row) * B (4 x 8, col), fp32 accumulate (SM70+: V100's native HMMA shape).
VOLT_DEVICE void mma_m8n8k4(float (&acc)[8], u32 a0, u32 a1, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
        "{%0,%1,%2,%3,%4,%5,%6,%7};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]),
          "+f"(acc[7])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

// acc += A (16 x 32, row) * B (32 x 8, col), 8-bit integers -> int32 accumulate (SM80+). A_U8: A holds unsigned
// bytes (Q4 nibbles, 0..15), else signed (Q8_0); B is signed. Fragments (PTX ISA, "... for mma.m16n8k32" with
// .s8/.u8): lane (g = lane / 4, t = lane % 4): a[0] = row g, k 4t..4t+3; a[1] = row g + 8, same k; a[2], a[3] =
// the same rows at k 16 + 4t..; b0 = column g, k 4t..4t+3; b1 = k 16 + 4t..; acc = rows g (0, 1) and g + 8 (2, 3),
// columns 2t, 2t + 1. The sums are exact (no saturation: |sum| < 2^31 for any 32-term product of bytes).
template <bool A_U8>
VOLT_DEVICE void mma_m16n8k32_i8(int (&acc)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (A_U8) {
        asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+r"(acc[0]), "+r"(acc[1]), "+r"(acc[2]), "+r"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
