// rotary.cu: rotary position embedding of q and k (Su et al. 2021, "RoFormer"), out of place.
//
// For each token t, head h and frequency i < rot/2 (rot = head_dim), with c = cos_sin[pos, i], s = cos_sin[pos, rot/2 + i]:
//   neox:        (x[i], x[i + rot/2])  -> (x1*c - x2*s, x2*c + x1*s)
//   interleaved: (x[2i], x[2i + 1])    -> same rotation
// Grid: (num_tokens); block 128 threads loop over (num_heads + num_kv_heads) * head_dim/2 pairs; no smem.
// SM70 path: the only path. Reference: voltserve.backends.cpu.CpuBackend.rotary.
#include "rope.cuh"

struct RotaryParams {
    const half_t* q;         // [num_tokens, num_heads, head_dim] fp16, strides below
    const half_t* k;         // [num_tokens, num_kv_heads, head_dim] fp16, strides below
    half_t* q_out;           // [num_tokens, num_heads, head_dim] fp16, contiguous
    half_t* k_out;           // [num_tokens, num_kv_heads, head_dim] fp16, contiguous
    const i64* positions;    // [num_tokens] int64
    const float* cos_sin;    // [max_positions, head_dim] fp32
    i64 q_token_stride;      // elements
    i64 q_head_stride;
    i64 k_token_stride;
    i64 k_head_stride;
    int num_tokens;
    int num_heads;
    int num_kv_heads;
    int head_dim;
    int interleaved;         // 0 = neox, 1 = interleaved
    int max_positions;       // positions are clamped into range
};
VOLT_CHECK_PARAMS(RotaryParams, VOLT_ROTARY_PARAMS_BYTES);

extern "C" __global__ void rotary(const RotaryParams p) {
    const i64 t = blockIdx.x;
    const int half_dim = p.head_dim / 2;
    i64 pos = p.positions[t];
    pos = pos < 0 ? 0 : (pos >= p.max_positions ? p.max_positions - 1 : pos);
    const float* cs = p.cos_sin + pos * p.head_dim;
    const int total = (p.num_heads + p.num_kv_heads) * half_dim;
    for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
        const int h = idx / half_dim, i = idx % half_dim;
        const bool is_q = h < p.num_heads;
        const int hh = is_q ? h : h - p.num_heads;
        const half_t* src = is_q ? p.q + t * p.q_token_stride + hh * p.q_head_stride
                                 : p.k + t * p.k_token_stride + hh * p.k_head_stride;
        half_t* dst = is_q ? p.q_out + (t * p.num_heads + hh) * p.head_dim
                           : p.k_out + (t * p.num_kv_heads + hh) * p.head_dim;
        rope_pair(src, dst, cs, i, half_dim, p.interleaved);
    }
}
