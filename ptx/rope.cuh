// rope.cuh: rotary position embedding (Su et al. 2021, "RoFormer") of fp16 head rows, shared by rope_kv_write and
// the attention kernels' fused rotary (attn_decode, attn_prefill), so all round the same fp32 expressions to fp16.
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

// The cos / sin row [head_dim] of position `pos` in a table of max_positions rows (pos clamped into it).
VOLT_DEVICE const float* rope_table_row(const float* cos_sin, i64 pos, int max_positions, int head_dim) {
    pos = pos < 0 ? 0 : (pos >= max_positions ? max_positions - 1 : pos);
    return cos_sin + pos * head_dim;
}

// The dim paired with dim d.
VOLT_DEVICE int rope_partner(int d, int half, int interleaved) {
    return interleaved ? d ^ 1 : (d < half ? d + half : d - half);
}

// Dim d's column in the cos / sin row (its pair's index) and whether it is the pair's x1 (`first`).
VOLT_DEVICE int rope_cs_index(int d, int half, int interleaved, bool& first) {
    first = interleaved ? (d & 1) == 0 : d < half;
    return interleaved ? d >> 1 : (first ? d : d - half);
}

// The rotated dims d0..d0+7 (d0 a multiple of 8) of one 16-byte vector x, y holding the partner dims (neox: dims
// d0 +- half, so half must be a multiple of 8; ignored when interleaved, where the partners are in x). The same
// fp32 expression per element as rope_kv_write's rope_pair, rounded to fp16 once.
VOLT_DEVICE uint4 rope_rotate8(const uint4& x, const uint4& y, int d0, const float* cs, int half, int interleaved) {
    const u32 xw[4] = {x.x, x.y, x.z, x.w}, yw[4] = {y.x, y.y, y.z, y.w};
    u32 out[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {  // one fp16 pair (32-bit word) at a time: few live registers
        float a, b, pa, pb;
        unpack2(xw[w], a, b);
        unpack2(yw[w], pa, pb);
        if (interleaved) {
            pa = b;
            pb = a;
        }
        bool first_a, first_b;
        const int ia = rope_cs_index(d0 + 2 * w, half, interleaved, first_a);
        const int ib = rope_cs_index(d0 + 2 * w + 1, half, interleaved, first_b);
        out[w] = pack2(rope_rotate(a, pa, cs[ia], cs[half + ia], first_a),
                       rope_rotate(b, pb, cs[ib], cs[half + ib], first_b));
    }
    return make_uint4(out[0], out[1], out[2], out[3]);
}
