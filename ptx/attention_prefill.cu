// attention_prefill.cu: causal attention of a step's new tokens over each sequence's paged KV context, GQA.
// Covers prefill, chunked prefill, prefix-cache hits and mixed steps: query row j of sequence s sits at position
// seq_len - query_len + j and sees keys 0..that position (read from the paged cache; with the fused rotary the
// step's own new keys from the QKV output).
// Flash-attention-style online softmax (Dao et al. 2022), SIMT.
//
// Grid: (num_tokens / BQ + num_seqs, num_heads, 1), flat over the step's q tiles: sequence s owns the tile slots
// from tile_base(s) = query_start_loc[s] / BQ + s on (ceil(query_len / BQ) <= tile_base(s + 1) - tile_base(s) of
// them; the rest leave at once), so a mixed CUDA graph's grid grows with its token capacity, not with
// capacity x sequences (64 decodes + a 64-token bucket: 72 slots a head, not 4 x 64).
// Block 128 threads = 4 warps x ROWS query rows (BQ = 16).
// Shared memory (dynamic): K tile [BK][HEAD_DIM + 2] fp16 (padded: conflict-free column reads), V tile
// [BK][HEAD_DIM] fp16, Q [BQ][HEAD_DIM] fp32 = 2*BK*(2*HEAD_DIM+2) + 4*BQ*HEAD_DIM bytes.
// Per key tile: lane j scores key j for the warp's ROWS rows, then every lane accumulates its pairs of output dims.
// Fused rotary (cos_sin != nullptr; steps of <= 64 prompt tokens, CudaBackend.rope_attention): q and the step's new
// keys come un-rotated (the QKV output), rotated as they are staged (rope.cuh: the same fp32 expressions and fp16
// rounding as rope_kv_write); the new keys' K / V are read from k_new / v_new rather than the cache, and the
// blocks of each KV group's first head store their own tile's rows to the cache (slot_mapping; < 0: not
// written; such a key is still read from k_new, where the unfused kernels would read the cache: the engine
// gives every prompt token a slot): rope_kv_write's work, without its launch. Every key tile rotates its new
// keys again (a long prompt's cost). Needs 16-byte aligned k / v rows and, for neox, HEAD_DIM % 16 == 0 (the
// host's check).
// SM70 path: the only path (fp16 storage, fp32 math). A tensor-core (mma.m8n8k4 / WMMA) path is a later tuning step.
// Reference: voltserve.backends.cpu.CpuBackend.attention; with the fused rotary, CpuBackend.rope_attention.
#include "rope.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#define NUM_THREADS 128
#define NUM_WARPS 4
#define ROWS 4
#define BQ (NUM_WARPS * ROWS)
#define BK 32
#define KS (HEAD_DIM + 2)                    // padded K row, in halves
#define PAIRS (HEAD_DIM / 2)
#define PPL ((PAIRS + 31) / 32)              // output dim pairs per lane
#define HALF (HEAD_DIM / 2)
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 8, at most 256");

struct PrefillParams {
    const half_t* q;             // [num_tokens, num_heads, HEAD_DIM] fp16, strides below
    half_t* kv;                  // [2, num_blocks, block_size, num_kv_heads, HEAD_DIM] fp16 (written: fused rotary)
    const int* block_tables;     // [num_seqs, max_blocks] int32
    const int* seq_lens;         // [num_seqs] int32, context length after this step
    const int* query_start_loc;  // [num_seqs + 1] int32
    half_t* out;                 // [num_tokens, num_heads, HEAD_DIM] fp16, contiguous
    i64 q_token_stride;          // elements
    i64 q_head_stride;
    i64 kv_plane;                // elements of one of the K / V planes
    int num_seqs;
    int num_heads;
    int num_kv_heads;
    int block_size;
    int max_blocks;
    float scale;
    int min_query_len;           // sequences with fewer query tokens are left alone (a mixed step's decodes,
                                 // which attn_decode computed)
    // fused rotary + KV write (see the top): cos_sin nullptr = off (q rotated, the cache holds every key)
    const half_t* k_new;         // [num_tokens, num_kv_heads, HEAD_DIM] fp16 un-rotated, token stride below
    const half_t* v_new;         // [num_tokens, num_kv_heads, HEAD_DIM] fp16
    const i64* positions;        // [num_tokens] int64 (clamped into the table)
    const i64* slot_mapping;     // [num_tokens] int64; < 0: the key is not written
    const float* cos_sin;        // [max_positions, HEAD_DIM] fp32: cos of each pair, then sin
    i64 k_token_stride;          // elements
    i64 v_token_stride;
    int max_positions;
    int interleaved;             // 0 = neox, 1 = interleaved pairs
};
VOLT_CHECK_PARAMS(PrefillParams, VOLT_PREFILL_PARAMS_BYTES);

// The fused rotary's cos / sin row of query token `row` (its position clamped into the table).
VOLT_DEVICE const float* rope_cs_row(const PrefillParams& p, i64 row) {
    return rope_table_row(p.cos_sin, p.positions[row], p.max_positions, HEAD_DIM);
}

// Dims c..c+7 of query token `row`'s new key (rotated) and value in KV head kvh, from k_new / v_new.
VOLT_DEVICE void load_new_key(const PrefillParams& p, i64 row, int kvh, int c, uint4& kvec, uint4& vvec) {
    const half_t* src = p.k_new + row * p.k_token_stride + (i64)kvh * HEAD_DIM;
    const uint4 x = *reinterpret_cast<const uint4*>(src + c);
    const uint4 y = p.interleaved ? x : *reinterpret_cast<const uint4*>(src + rope_partner(c, HALF, 0));
    kvec = rope_rotate8(x, y, c, rope_cs_row(p, row), HALF, p.interleaved);
    vvec = *reinterpret_cast<const uint4*>(p.v_new + row * p.v_token_stride + (i64)kvh * HEAD_DIM + c);
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) attn_prefill(const PrefillParams p) {
    extern __shared__ float smem[];
    float* q_s = smem;                                                   // [BQ][HEAD_DIM]
    half_t* k_s = reinterpret_cast<half_t*>(q_s + BQ * HEAD_DIM);        // [BK][KS]
    half_t* v_s = k_s + BK * KS;                                         // [BK][HEAD_DIM]
    const int h = blockIdx.y;
    const int kvh = h / (p.num_heads / p.num_kv_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // the metadata is a host upload (the launcher turns PDL off otherwise): blocks without rows leave before
    // the PDL wait (most of a mixed CUDA graph's grid, sized for its capacity), block 0 after it, so the grid
    // still completes only after the previous one
    // this slot's sequence: the last s with tile_base(s) <= slot (tile_base grows by >= 1 a sequence)
    const int slot = blockIdx.x;
    int seq = -1;
    for (int i0 = 0; i0 < p.num_seqs; i0 += NUM_THREADS) {
        const int i = i0 + tid;
        const int below = __syncthreads_count(i < p.num_seqs && p.query_start_loc[i] / BQ + i <= slot);
        seq += below;
        if (below < NUM_THREADS) break;  // the same count in every thread: a uniform exit
    }
    const int q_begin = p.query_start_loc[seq];
    const int q_len = p.query_start_loc[seq + 1] - q_begin;
    const int q0 = (slot - q_begin / BQ - seq) * BQ;
    const bool idle = q0 >= q_len || q_len < p.min_query_len;
    if (idle && (blockIdx.x | blockIdx.y | blockIdx.z) != 0) return;
    pdl_enter();
    if (idle) return;
    const int seq_len = p.seq_lens[seq];
    const int ctx = seq_len - q_len;                                     // cached tokens before this step
    const int num_keys = min(seq_len, ctx + min(q0 + BQ, q_len));        // causal bound for the whole block
    const bool rope = p.cos_sin != nullptr;

    for (int i = tid; i < BQ * HEAD_DIM; i += NUM_THREADS) {
        const int r = i / HEAD_DIM, d = i % HEAD_DIM;
        const i64 row = q_begin + q0 + r;
        float x = 0.f;
        if (q0 + r < q_len) {
            const half_t* qh = p.q + row * p.q_token_stride + h * p.q_head_stride;
            x = h2f(qh[d]);
            if (rope) {  // rope_kv_write's rotation of this element, rounded to fp16 as it rounds q_out
                bool first;
                const int c = rope_cs_index(d, HALF, p.interleaved, first);
                const float* cs = rope_cs_row(p, row);
                x = h2f(f2h(rope_rotate(x, h2f(qh[rope_partner(d, HALF, p.interleaved)]), cs[c], cs[HALF + c],
                                        first)));
            }
        }
        q_s[i] = x * p.scale;
    }
    // the fused rotary's KV write: the first head of each KV group stores its tile's new keys (rotated) and values
    if (rope && h % (p.num_heads / p.num_kv_heads) == 0) {
        for (int i = tid; i < BQ * (HEAD_DIM / 8); i += NUM_THREADS) {
            const int r = i / (HEAD_DIM / 8), c = (i % (HEAD_DIM / 8)) * 8;
            if (q0 + r >= q_len) break;
            const i64 row = q_begin + q0 + r;
            const i64 dst = p.slot_mapping[row];
            if (dst < 0) continue;
            uint4 kvec, vvec;
            load_new_key(p, row, kvh, c, kvec, vvec);
            half_t* out = p.kv + (dst * p.num_kv_heads + kvh) * HEAD_DIM + c;
            *reinterpret_cast<uint4*>(out) = kvec;
            *reinterpret_cast<uint4*>(out + p.kv_plane) = vvec;
        }
    }

    float m[ROWS], l[ROWS], acc[ROWS][PPL][2];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        m[r] = VOLT_NEG_INF;
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < PPL; ++i) acc[r][i][0] = acc[r][i][1] = 0.f;
    }

    for (int k0 = 0; k0 < num_keys; k0 += BK) {
        __syncthreads();  // previous tile fully consumed (and q_s written, on the first pass)
        // load the K and V tile, 8 halves per thread and step; keys past the end are zero (no NaN garbage)
        for (int i = tid; i < BK * (HEAD_DIM / 8); i += NUM_THREADS) {
            const int j = i / (HEAD_DIM / 8), c = (i % (HEAD_DIM / 8)) * 8;
            uint4 kvec = make_uint4(0, 0, 0, 0), vvec = make_uint4(0, 0, 0, 0);
            const int t = k0 + j;
            if (rope && t >= ctx && t < num_keys) {  // a new key of this step: from the QKV output, rotated
                load_new_key(p, q_begin + (t - ctx), kvh, c, kvec, vvec);
            } else if (t < num_keys) {
                const int block = p.block_tables[(i64)seq * p.max_blocks + t / p.block_size];
                const half_t* src = p.kv + (((i64)block * p.block_size + t % p.block_size) * p.num_kv_heads + kvh)
                                               * HEAD_DIM + c;
                kvec = *reinterpret_cast<const uint4*>(src);
                vvec = *reinterpret_cast<const uint4*>(src + p.kv_plane);
            }
            u32* kd = reinterpret_cast<u32*>(k_s + j * KS + c);          // 4-byte aligned only (padding)
            kd[0] = kvec.x; kd[1] = kvec.y; kd[2] = kvec.z; kd[3] = kvec.w;
            *reinterpret_cast<uint4*>(v_s + j * HEAD_DIM + c) = vvec;
        }
        __syncthreads();

        // scores of key k0 + lane for this warp's rows
        float s[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) s[r] = 0.f;
        const u32* krow = reinterpret_cast<const u32*>(k_s + lane * KS);
#pragma unroll 4
        for (int d2 = 0; d2 < PAIRS; ++d2) {
            float k_lo, k_hi;
            unpack2(krow[d2], k_lo, k_hi);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const float* qr = q_s + (warp * ROWS + r) * HEAD_DIM + 2 * d2;
                s[r] += qr[0] * k_lo + qr[1] * k_hi;
            }
        }
        const int key = k0 + lane;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const int qi = q0 + warp * ROWS + r;
            const bool valid = qi < q_len && key < seq_len && key <= ctx + qi;
            const float sv = valid ? s[r] : VOLT_NEG_INF;
            const float m_new = fmaxf(m[r], warp_max(sv));
            // m_new == -inf: nothing seen yet for this row; keep the state at zero and avoid inf - inf
            const float e = valid ? __expf(sv - m_new) : 0.f;
            const float corr = m_new == VOLT_NEG_INF ? 1.f : __expf(m[r] - m_new);
            l[r] = l[r] * corr + warp_sum(e);
            m[r] = m_new;
            s[r] = e;
#pragma unroll
            for (int i = 0; i < PPL; ++i) { acc[r][i][0] *= corr; acc[r][i][1] *= corr; }
        }
        // P @ V: lane owns dim pairs lane, lane + 32, ...; probabilities broadcast from the lane owning the key
        for (int j = 0; j < BK; ++j) {
            float pj[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) pj[r] = __shfl_sync(0xffffffffu, s[r], j);
            const u32* vrow = reinterpret_cast<const u32*>(v_s + j * HEAD_DIM);
#pragma unroll
            for (int i = 0; i < PPL; ++i) {
                const int pr = lane + 32 * i;
                if (pr < PAIRS) {
                    float v0, v1;
                    unpack2(vrow[pr], v0, v1);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) { acc[r][i][0] += pj[r] * v0; acc[r][i][1] += pj[r] * v1; }
                }
            }
        }
    }

#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int qi = q0 + warp * ROWS + r;
        if (qi >= q_len) continue;
        const float inv = 1.f / l[r];
        u32* dst = reinterpret_cast<u32*>(p.out + ((i64)(q_begin + qi) * p.num_heads + h) * HEAD_DIM);
#pragma unroll
        for (int i = 0; i < PPL; ++i) {
            const int pr = lane + 32 * i;
            if (pr < PAIRS) dst[pr] = pack2(acc[r][i][0] * inv, acc[r][i][1] * inv);
        }
    }
}
