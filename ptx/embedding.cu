// embedding.cu: token embedding lookup, out[t, :] = table[token_ids[t], :].
//
// embedding_f16:  table fp16 [vocab, hidden].
// embedding_q8_0: table = GGUF Q8_0 rows [vocab, hidden / 32 * 34] bytes (fp16 scale d + 32 int8 q; x = d * q),
//                 dequantized in registers; ids outside [0, vocab) give a zero row.
// Grid: (num_tokens, ceil(hidden / (blockDim.x * 8))); block 128 threads; no shared memory.
// SM70 path: the only path (loads + fp16 stores). Reference: voltserve.backends.cpu.CpuBackend.embedding.
#include "common.cuh"

struct EmbeddingParams {
    const i64* token_ids;  // [num_tokens] int64
    const u8* table;       // fp16 [vocab, hidden] or Q8_0 [vocab, hidden/32*34] bytes
    half_t* out;           // [num_tokens, hidden] fp16, contiguous
    int num_tokens;
    int hidden;
    int vocab;
    int row_bytes;         // bytes of one table row
};
VOLT_CHECK_PARAMS(EmbeddingParams, VOLT_EMBEDDING_PARAMS_BYTES);

extern "C" __global__ void embedding_f16(const EmbeddingParams p) {
    pdl_enter();
    const int t = blockIdx.x;
    const i64 id = p.token_ids[t];
    const bool valid = id >= 0 && id < p.vocab;
    const half_t* row = reinterpret_cast<const half_t*>(p.table + (valid ? id : 0) * (i64)p.row_bytes);
    half_t* out = p.out + (i64)t * p.hidden;
    const int base = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if ((p.hidden & 7) == 0 && base < p.hidden) {  // rows are 16-byte aligned: one vector per thread
        uint4 v = valid ? *reinterpret_cast<const uint4*>(row + base) : make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(out + base) = v;
        return;
    }
    for (int j = base; j < base + 8 && j < p.hidden; ++j) out[j] = valid ? row[j] : (half_t)0;
}

extern "C" __global__ void embedding_q8_0(const EmbeddingParams p) {
    pdl_enter();
    const int t = blockIdx.x;
    const i64 id = p.token_ids[t];
    const bool valid = id >= 0 && id < p.vocab;
    const u8* row = p.table + (valid ? id : 0) * (i64)p.row_bytes;
    half_t* out = p.out + (i64)t * p.hidden;
    const int base = (blockIdx.y * blockDim.x + threadIdx.x) * 8;  // 8 elements never straddle a 32-block
    if (base >= p.hidden) return;
    const u8* blk = row + (base / 32) * 34;
    const float d = h2f(*reinterpret_cast<const half_t*>(blk));
    const signed char* q = reinterpret_cast<const signed char*>(blk + 2) + (base % 32);
#pragma unroll
    for (int j = 0; j < 8; ++j) out[base + j] = valid ? f2h(d * (float)q[j]) : (half_t)0;
}
