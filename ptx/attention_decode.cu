// attention_decode.cu: paged attention for decode (one new token per sequence), GQA, split-K
// ("flash-decoding", Dao et al. 2023): each block scores one partition of the context for the GROUP query heads
// that share one KV head, so each K/V row is read once per group.
//
//   out[s, h, :] = softmax(scale * q[s, h] . K[s, 0:seq_len, h / GROUP]) @ V[...]
// attn_decode:        grid (num_kv_heads, num_seqs, num_splits); block 128 threads;
//                     dynamic smem = 4 * (GROUP*HEAD_DIM + GROUP*PARTITION + NG*GROUP*HEAD_DIM + 2*GROUP) bytes,
//                     NG = 128 / (HEAD_DIM/2). A sequence's context is cut into splits of split_len() keys
//                     (seq_len / num_splits rounded up to 16, clamped to [min_part, PARTITION]): a short context
//                     still spreads over many blocks, splits past the context exit at once. When one split holds
//                     the whole context the block writes out directly; otherwise it writes its un-normalised
//                     partial output, running max and sum to the workspace.
//                     With `counters`, the last split block of each (sequence, KV head) to arrive merges the
//                     partials itself (arrival counter, fixed merge order), so decode is one launch.
// attn_decode_reduce: grid (num_kv_heads, num_seqs); block 128 threads; 4 * GROUP * num_splits bytes of dynamic
//                     smem; merges the used splits (log-sum-exp rescale, the same merge_splits as the in-kernel
//                     path, so both are bitwise equal) when counters is nullptr; returns at once for sequences
//                     written directly.
// Compile-time: HEAD_DIM (multiple of 8, <= 256), GROUP (query heads per KV head), PARTITION (tokens per split).
// SM70 path: the only path: fp16 K/V loads as 16-byte vectors, fp32 dot products and softmax.
// Reference: voltserve.backends.cpu.CpuBackend.attention (query_len == 1 for every sequence).
#include "common.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 1
#endif
#ifndef PARTITION
#define PARTITION 512
#endif
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)
#define VECS (HEAD_DIM / 8)                                  // 16-byte vectors per K row
#define TG (VECS <= 1 ? 1 : VECS <= 2 ? 2 : VECS <= 4 ? 4 : VECS <= 8 ? 8 : VECS <= 16 ? 16 : 32)  // lanes per key
#define PAIRS (HEAD_DIM / 2)
#define NG (NUM_THREADS / PAIRS)                              // token groups in the P @ V phase
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 8, at most 256");

struct DecodeParams {
    const half_t* q;             // [num_tokens, num_heads, HEAD_DIM] fp16, strides below
    const half_t* kv;            // [2, num_blocks, block_size, num_kv_heads, HEAD_DIM] fp16
    const int* block_tables;     // [num_seqs, max_blocks] int32
    const int* seq_lens;         // [num_seqs] int32
    const int* query_start_loc;  // [num_seqs + 1] int32; the query of sequence s is row query_start_loc[s+1]-1
    half_t* out;                 // [num_tokens, num_heads, HEAD_DIM] fp16, contiguous
    float* part_acc;             // [num_seqs, num_heads, num_splits, HEAD_DIM] fp32 workspace (num_splits > 1)
    float* part_ml;              // [num_seqs, num_heads, num_splits, 2] fp32 workspace: running max, sum
    int* counters;               // [num_seqs * num_kv_heads] int32 arrival counters, zero between launches, or
                                 // nullptr: then attn_decode_reduce merges the splits
    i64 q_token_stride;          // elements
    i64 q_head_stride;
    i64 kv_plane;                // elements of one of the K / V planes
    int num_seqs;
    int num_heads;
    int num_kv_heads;
    int block_size;
    int max_blocks;
    int num_splits;
    float scale;
    int min_part;                // fewest keys per split (a multiple of 16, <= PARTITION)
};
VOLT_CHECK_PARAMS(DecodeParams, VOLT_DECODE_PARAMS_BYTES);

VOLT_DEVICE const half_t* kv_row(const DecodeParams& p, int seq, int kvh, int t) {
    const int block = p.block_tables[(i64)seq * p.max_blocks + t / p.block_size];
    const i64 slot = (i64)block * p.block_size + t % p.block_size;
    return p.kv + (slot * p.num_kv_heads + kvh) * HEAD_DIM;
}

// Keys per split of one sequence: its context spread evenly over the grid's splits (rounded up to 16, at least
// min_part), so a short context still fills many blocks when the grid is sized for a long capacity (CUDA graphs).
// The host sizes num_splits >= ceil(max_seq_len / PARTITION), so the result is <= PARTITION and covers seq_len.
VOLT_DEVICE int split_len(const DecodeParams& p, int seq_len) {
    const int per = ((seq_len + p.num_splits - 1) / p.num_splits + 15) & ~15;
    return min(PARTITION, max(p.min_part, per));
}

// out[seq, kvh * GROUP + g] for the group's heads from their `used` split partials (log-sum-exp rescale), by
// the whole block: the split weights exp(m_s - M) / L go to smem `w` ([GROUP][ws] floats, used <= ws) in
// parallel, then each output element sums its splits in fixed order (deterministic). Partials
// written by other blocks are read past L1 (ld.global.cg): L1 is not coherent. Needs all threads (barriers).
VOLT_DEVICE void merge_splits(const DecodeParams& p, int seq, int kvh, int used, float* w, int ws) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 base = ((i64)seq * p.num_heads + kvh * GROUP) * p.num_splits;  // head g adds g * num_splits
    for (int i = tid; i < GROUP * used; i += NUM_THREADS) {
        const int g = i / used, sp = i % used;
        w[g * ws + sp] = __ldcg(p.part_ml + (base + (i64)g * p.num_splits + sp) * 2);
    }
    __syncthreads();
    for (int g = warp; g < GROUP; g += NUM_WARPS) {
        float m = VOLT_NEG_INF;
        for (int sp = lane; sp < used; sp += 32) m = fmaxf(m, w[g * ws + sp]);
        m = warp_max(m);
        float l = 0.f;
        for (int sp = lane; sp < used; sp += 32) {
            const float e = __expf(w[g * ws + sp] - m);
            w[g * ws + sp] = e;
            l += __ldcg(p.part_ml + (base + (i64)g * p.num_splits + sp) * 2 + 1) * e;
        }
        l = warp_sum(l);
        __syncwarp();
        for (int sp = lane; sp < used; sp += 32) w[g * ws + sp] /= l;
    }
    __syncthreads();
    const i64 row = p.query_start_loc[seq + 1] - 1;
    for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        const float* acc = p.part_acc + (base + (i64)g * p.num_splits) * HEAD_DIM + d;
        float o = 0.f;
#pragma unroll 4
        for (int sp = 0; sp < used; ++sp) o += __ldcg(acc + (i64)sp * HEAD_DIM) * w[g * ws + sp];
        p.out[(row * p.num_heads + kvh * GROUP + g) * HEAD_DIM + d] = f2h(o);
    }
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) attn_decode(const DecodeParams p) {
    pdl_enter();
    extern __shared__ float smem[];
    float* q_s = smem;                                  // [GROUP][HEAD_DIM], pre-scaled
    float* logits = q_s + GROUP * HEAD_DIM;             // [GROUP][PARTITION]
    float* red = logits + GROUP * PARTITION;            // [NG][GROUP][HEAD_DIM]
    float* ml = red + NG * GROUP * HEAD_DIM;            // [GROUP][2]
    const int kvh = blockIdx.x, seq = blockIdx.y, split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int seq_len = p.seq_lens[seq];
    const int plen = split_len(p, seq_len);
    const int start = split * plen;
    const int n = min(plen, seq_len - start);
    const i64 ws = ((i64)seq * p.num_heads + kvh * GROUP) * p.num_splits + split;  // head g adds g * num_splits
    if (n <= 0) return;  // past this context (the grid is sized for the longest): the reduce never reads it
    const bool direct = seq_len <= plen;  // one split holds the whole context: write out, the reduce skips it
    const i64 row = p.query_start_loc[seq + 1] - 1;
    for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        q_s[i] = h2f(p.q[row * p.q_token_stride + (kvh * GROUP + g) * p.q_head_stride + d]) * p.scale;
    }
    __syncthreads();

    // 1) scores: TG lanes share one key, each holding one 16-byte slice of it
    const int sub = lane / TG, sl = lane % TG;
    for (int t0 = warp * (32 / TG); t0 < n; t0 += NUM_WARPS * (32 / TG)) {
        const int t = t0 + sub;
        float part[GROUP];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) part[g] = 0.f;
        if (t < n && sl < VECS) {
            float kf[8];
            load8(kv_row(p, seq, kvh, start + t) + sl * 8, kf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float* qg = q_s + g * HEAD_DIM + sl * 8;
#pragma unroll
                for (int j = 0; j < 8; ++j) part[g] += qg[j] * kf[j];
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int o = TG / 2; o > 0; o >>= 1) part[g] += __shfl_xor_sync(0xffffffffu, part[g], o);
            if (sl == 0 && t < n) logits[g * PARTITION + t] = part[g];
        }
    }
    __syncthreads();

    // 2) softmax numerators over the partition, one warp per query head
    for (int g = warp; g < GROUP; g += NUM_WARPS) {
        float m = VOLT_NEG_INF;
        for (int t = lane; t < n; t += 32) m = fmaxf(m, logits[g * PARTITION + t]);
        m = warp_max(m);
        float l = 0.f;
        for (int t = lane; t < n; t += 32) {
            const float e = __expf(logits[g * PARTITION + t] - m);
            logits[g * PARTITION + t] = e;
            l += e;
        }
        l = warp_sum(l);
        if (lane == 0) { ml[2 * g] = m; ml[2 * g + 1] = l; }
    }
    __syncthreads();

    // 3) P @ V: thread owns one pair of dims for every head of the group, NG token groups split the keys
    const int grp = tid / PAIRS, pr = tid % PAIRS;
    if (grp < NG) {
        float acc[GROUP][2];
#pragma unroll
        for (int g = 0; g < GROUP; ++g) acc[g][0] = acc[g][1] = 0.f;
        for (int t = grp; t < n; t += NG) {
            const u32 w = *reinterpret_cast<const u32*>(kv_row(p, seq, kvh, start + t) + p.kv_plane + 2 * pr);
            float v0, v1;
            unpack2(w, v0, v1);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float e = logits[g * PARTITION + t];
                acc[g][0] += e * v0;
                acc[g][1] += e * v1;
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            red[(grp * GROUP + g) * HEAD_DIM + 2 * pr] = acc[g][0];
            red[(grp * GROUP + g) * HEAD_DIM + 2 * pr + 1] = acc[g][1];
        }
    }
    __syncthreads();
    for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float o = 0.f;
#pragma unroll
        for (int r = 0; r < NG; ++r) o += red[r * GROUP * HEAD_DIM + i];
        if (direct) {
            p.out[(row * p.num_heads + kvh * GROUP + g) * HEAD_DIM + d] = f2h(o / ml[2 * g + 1]);
        } else {
            const i64 w = ws + (i64)g * p.num_splits;
            p.part_acc[w * HEAD_DIM + d] = o;
            if (d == 0) { p.part_ml[w * 2] = ml[2 * g]; p.part_ml[w * 2 + 1] = ml[2 * g + 1]; }
        }
    }
    if (direct || p.counters == nullptr) return;
    // the last of this (sequence, KV head)'s splits to finish merges them (no reduce launch)
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    const int used = min(p.num_splits, (seq_len + plen - 1) / plen);
    int* counter = p.counters + seq * p.num_kv_heads + kvh;
    if (tid == 0) s_last = atomicAdd(counter, 1) == used - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    merge_splits(p, seq, kvh, used, logits, PARTITION);  // scores consumed: reuse their smem (host:
                                                         // counters only when num_splits <= PARTITION)
    if (tid == 0) *counter = 0;  // ready for the next launch on this stream
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) attn_decode_reduce(const DecodeParams p) {
    pdl_enter();
    extern __shared__ float w[];  // [GROUP][num_splits]
    const int kvh = blockIdx.x, seq = blockIdx.y;
    const int seq_len = p.seq_lens[seq];
    const int plen = split_len(p, seq_len);
    if (seq_len <= plen) return;  // attn_decode wrote this output directly (one split)
    merge_splits(p, seq, kvh, min(p.num_splits, (seq_len + plen - 1) / plen), w, p.num_splits);
}
