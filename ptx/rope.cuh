// rope.cuh: rotary position embedding (Su et al. 2021, "RoFormer") of fp16 head rows, shared by rope_kv_write and
// attn_decode's fused rotary, so both round the same fp32 expressions to fp16.
//
// A head of 2 * half dims is rotated in pairs (x1, x2) of dims (i1, i2): neox i1 = i, i2 = i + half; interleaved
// i1 = 2i, i2 = 2i + 1; with c = cs[i], s = cs[half + i] (the token's row of the cos / sin table):
//   x1' = x1 c - x2 s,   x2' = x2 c + x1 s.
#pragma once
#include "common.cuh"

// One member of a pair: x this member, y its partner; `first`: this is x1.
VOLT_DEVICE float rope_rotate(float x, float y, float c, float s, bool first) {
    return first ? x * c - y * s : x * c + y * s;
}

// fp16 rotated value at dim d of `head` (fp16, 2 * half dims; any alignment).
VOLT_DEVICE half_t rope_elem(const half_t* head, int d, const float* cs, int half, int interleaved) {
    const bool first = interleaved ? (d & 1) == 0 : d < half;
    const int partner = interleaved ? d ^ 1 : (first ? d + half : d - half);
    const int i = interleaved ? d >> 1 : (first ? d : d - half);
    return f2h(rope_rotate(h2f(head[d]), h2f(head[partner]), cs[i], cs[half + i], first));
}

// The 8 rotated fp16 values at dims d0..d0+7 of `head` (d0 a multiple of 8, head 16-byte aligned) as one vector:
// the same values as rope_elem, from one or two 16-byte loads.
VOLT_DEVICE uint4 rope_vec8(const half_t* head, int d0, const float* cs, int half, int interleaved) {
    float x[8], y[8], r[8];
    load8(head + d0, x);
    if (!interleaved) load8(head + (d0 < half ? d0 + half : d0 - half), y);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        const int d = d0 + e;
        const bool first = interleaved ? (e & 1) == 0 : d < half;
        const int i = interleaved ? d >> 1 : (first ? d : d - half);
        r[e] = rope_rotate(x[e], interleaved ? x[e ^ 1] : y[e], cs[i], cs[half + i], first);
    }
    return pack8(r);
}
