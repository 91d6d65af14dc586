// rope.cuh: one rotary pair (Su et al. 2021, "RoFormer"), shared by rotary.cu and rope_kv.cu.
#pragma once
#include "common.cuh"

// Rotate pair i of one head: neox (x[i], x[i + half_dim]), interleaved (x[2i], x[2i + 1]), by the angle whose
// cos / sin are cs[i] / cs[half_dim + i]; fp32 math, fp16 stores (dst may be src's row in the KV cache).
VOLT_DEVICE void rope_pair(const half_t* src, half_t* dst, const float* cs, int i, int half_dim, int interleaved) {
    const int i1 = interleaved ? 2 * i : i;
    const int i2 = interleaved ? 2 * i + 1 : i + half_dim;
    const float x1 = h2f(src[i1]), x2 = h2f(src[i2]);
    const float c = cs[i], s = cs[half_dim + i];
    dst[i1] = f2h(x1 * c - x2 * s);
    dst[i2] = f2h(x2 * c + x1 * s);
}
