// kv_write.cu: scatter this step's K and V into the paged KV cache of one layer.
//
//   kv[0, slot // block_size, slot % block_size, h, :] = k[t, h, :]   (and plane 1 for v), slot = slot_mapping[t]
// slot < 0 means padding: the token is skipped.
// Grid: (num_tokens); block 128 threads over num_kv_heads * head_dim elements (contiguous, coalesced stores).
// SM70 path: the only path. Reference: voltserve.backends.cpu.CpuBackend.write_kv.
#include "common.cuh"

struct KvWriteParams {
    const half_t* k;        // [num_tokens, num_kv_heads, head_dim] fp16, strides below
    const half_t* v;        // same shape as k
    half_t* kv;             // [2, num_blocks, block_size, num_kv_heads, head_dim] fp16
    const i64* slot_mapping;  // [num_tokens] int64, -1 = skip
    i64 k_token_stride;     // elements
    i64 k_head_stride;
    i64 v_token_stride;
    i64 v_head_stride;
    i64 kv_plane;           // elements in one of the two planes: num_blocks * block_size * num_kv_heads * head_dim
    int num_tokens;
    int num_kv_heads;
    int head_dim;
    int pad_;
};
VOLT_CHECK_PARAMS(KvWriteParams, VOLT_KV_WRITE_PARAMS_BYTES);

extern "C" __global__ void kv_write(const KvWriteParams p) {
    const i64 t = blockIdx.x;
    const i64 slot = p.slot_mapping[t];
    if (slot < 0) return;
    const int row = p.num_kv_heads * p.head_dim;
    half_t* kdst = p.kv + slot * row;
    half_t* vdst = kdst + p.kv_plane;
    for (int idx = threadIdx.x; idx < row; idx += blockDim.x) {
        const int h = idx / p.head_dim, d = idx % p.head_dim;
        kdst[idx] = p.k[t * p.k_token_stride + h * p.k_head_stride + d];
        vdst[idx] = p.v[t * p.v_token_stride + h * p.v_head_stride + d];
    }
}
