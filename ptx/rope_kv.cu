// rope_kv.cu: rotary position embedding of q and k (Su et al. 2021, "RoFormer") fused with the paged KV write:
// one decode launch instead of rotary + kv_write.
//
// For token t with c = cos_sin[pos, i], s = cos_sin[pos, head_dim/2 + i] and each pair (x1, x2) of a head
// (neox: x[i], x[i + head_dim/2]; interleaved: x[2i], x[2i + 1]):
//   q heads:  q_out[t, h] = (x1*c - x2*s, x2*c + x1*s)           (fp16 store)
//   k heads:  kv[0, slot] = the same rotation of k[t, h]           slot = slot_mapping[t]; slot < 0: not written
//   v heads:  kv[1, slot] = v[t, h]
// Grid: (num_tokens, num_heads + 2 * num_kv_heads); block 64 threads loop over the head's pairs; no smem.
// SM70 path: the only path. Reference: CpuBackend.rotary_write_kv (= CpuBackend.rotary, then write_kv).
#include "rope.cuh"

struct RopeKvParams {
    const half_t* q;         // [num_tokens, num_heads, head_dim] fp16, token stride q_token_stride, heads packed
    const half_t* k;         // [num_tokens, num_kv_heads, head_dim] fp16, token stride k_token_stride
    const half_t* v;         // [num_tokens, num_kv_heads, head_dim] fp16, token stride v_token_stride
    half_t* q_out;           // [num_tokens, num_heads, head_dim] fp16, contiguous
    half_t* kv;              // [2, num_blocks, block_size, num_kv_heads, head_dim] fp16 (one layer)
    const i64* positions;    // [num_tokens] int64 (clamped into the table)
    const i64* slot_mapping; // [num_tokens] int64, -1 = skip
    const float* cos_sin;    // [max_positions, head_dim] fp32
    i64 q_token_stride;      // elements
    i64 k_token_stride;
    i64 v_token_stride;
    i64 kv_plane;            // elements of one of the two planes
    int num_tokens;
    int num_heads;
    int num_kv_heads;
    int head_dim;
    int interleaved;         // 0 = neox, 1 = interleaved
    int max_positions;
};
VOLT_CHECK_PARAMS(RopeKvParams, VOLT_ROPE_KV_PARAMS_BYTES);

// Rotate pair i of one head by the angle whose cos / sin are cs[i] / cs[half_dim + i]; fp32 math, fp16 stores.
VOLT_DEVICE void rope_pair(const half_t* src, half_t* dst, const float* cs, int i, int half_dim, int interleaved) {
    const int i1 = interleaved ? 2 * i : i;
    const int i2 = interleaved ? 2 * i + 1 : i + half_dim;
    const float x1 = h2f(src[i1]), x2 = h2f(src[i2]);
    const float c = cs[i], s = cs[half_dim + i];
    dst[i1] = f2h(rope_rotate(x1, x2, c, s, true));
    dst[i2] = f2h(rope_rotate(x2, x1, c, s, false));
}

extern "C" __global__ void rope_kv_write(const RopeKvParams p) {
    pdl_enter();
    const i64 t = blockIdx.x;
    const int h = blockIdx.y, d = p.head_dim, half_dim = d / 2;
    const i64 slot = p.slot_mapping[t];
    const int row = p.num_kv_heads * d;
    if (h >= p.num_heads + p.num_kv_heads) {  // v head: copy into the cache
        if (slot < 0) return;
        const int hv = h - p.num_heads - p.num_kv_heads;
        const half_t* src = p.v + t * p.v_token_stride + hv * d;
        half_t* dst = p.kv + p.kv_plane + slot * row + hv * d;
        for (int j = threadIdx.x; j < d; j += blockDim.x) dst[j] = src[j];
        return;
    }
    const bool is_q = h < p.num_heads;
    if (!is_q && slot < 0) return;
    const float* cs = rope_table_row(p.cos_sin, p.positions[t], p.max_positions, d);
    const half_t* src = is_q ? p.q + t * p.q_token_stride + h * d : p.k + t * p.k_token_stride + (h - p.num_heads) * d;
    half_t* dst = is_q ? p.q_out + (t * p.num_heads + h) * d : p.kv + slot * row + (h - p.num_heads) * d;
    for (int i = threadIdx.x; i < half_dim; i += blockDim.x) rope_pair(src, dst, cs, i, half_dim, p.interleaved);
}
