// attention_decode.cu: paged attention for decode (one new token per sequence), GQA, split-K
// ("flash-decoding", Dao et al. 2023): each block scores one partition of the context for the GROUP query heads
// that share one KV head, so each K/V row is read once per group.
//
//   out[s, h, :] = softmax(scale * q[s, h] . K[s, 0:seq_len, h / GROUP]) @ V[...]
// attn_decode:        grid (num_kv_heads, num_seqs, num_splits); block 128 threads; one pass over the split's
//                     keys with an online softmax, K and V rows loaded together (KV_UNROLL keys in flight per lane);
//                     dynamic smem = 4 * (GROUP*HEAD_DIM + 4*GROUP*HEAD_DIM + 8*GROUP + PARTITION/block_size + 2)
//                     bytes (4 = warps; the last term: the split's block-table slice).
//                     A sequence's context is cut into splits of split_len() keys
//                     (seq_len / the step's splits rounded up to 16, clamped to [min_part, PARTITION]; the
//                     step's splits: num_splits, or in a grid sized for a capacity the host's plan for the
//                     step's longest context, seq_splits): a short context still spreads over many blocks, splits
//                     past the context exit at once. When one split holds the whole context the block
//                     writes out directly; otherwise it writes its un-normalised partial output, running max
//                     and sum to the workspace.
//                     With `counters`, the last split block of each (sequence, KV head) to arrive merges the
//                     partials itself (arrival counter, fixed merge order), so decode is one launch; the host
//                     passes counters only when num_splits <= 2 * HEAD_DIM (the merge's maxima and sums reuse
//                     the warps' smem).
// Per-row build (-DPER_ROW=1; a verify step's short spans of drafts, CudaBackend's `rows_as_decodes`): grid.y runs
//                     over the step's query rows instead, each a decode of the keys up to its own position (the
//                     step's new keys are all in the cache: rope_kv_write ran first, no fused rotary); workspace
//                     and counters per row. Every key of the causal prefix from the step's first new key on is
//                     new, so the block waits (PDL) before its first key load.
// attn_decode_reduce: grid (num_kv_heads, num_seqs, or query rows: PER_ROW); block 128 threads;
//                     8 * GROUP * num_splits bytes of dynamic smem; merges the used splits (log-sum-exp rescale,
//                     the same merge_splits as the in-kernel path, so both are bitwise equal) when counters is
//                     nullptr; returns at once for sequences written directly.
// Compile-time: HEAD_DIM (multiple of 8, <= 256), GROUP (query heads per KV head), PARTITION (most keys per split),
// KV_UNROLL (keys per lane per load batch).
// Two paths for the scores and P @ V, both fp16 K/V loads as 16-byte vectors with fp32 softmax state:
//   SM80+ (GROUP <= 8, HEAD_DIM % 64 == 0): tensor cores, mma.m16n8k16 fp16 x fp16 -> fp32 (warp_attend_mma).
//   SM70 (V100) and the rest: CUDA cores, fp32 dot products (-DATTN_SIMT=1 takes it on any GPU).
// Before the PDL wait a block loads only what earlier steps wrote: metadata, and its warps' first tile of old
// keys (MMA path: into registers; CUDA-core path: L2 prefetch). In a mixed step a sequence of >= 2 query tokens
// (a prompt chunk, a verify of drafts) is attn_prefill's, every row and key of it: attn_decode's blocks and the
// reduce leave it at once (block (0, 0, 0) after the PDL wait, which keeps the chain of waits).
// After the wait, one round trip stages q and the sequence's newest key (whose row the previous kernel writes) in
// smem (stage_query_and_newest_key).
// Fused rotary (cos_sin != nullptr; decode-only steps, and mixed steps whose attn_prefill then rotates and writes
// the prompts' keys itself): q is the un-rotated q, rotated as it is staged, and the block whose split ends at
// the sequence's new key takes that key's K (rotated) and V from k_new / v_new instead of the cache and stores
// them to the cache slot (slot_mapping; < 0: not written, the key is read from the cache): rope_kv_write's work,
// without its launch.
// Quantized output (xq != nullptr, decode-only steps of <= 8 sequences): whoever writes an output row (the only
// split, or the merging block) also writes it quantized per 32 elements (s8_xq.cuh) in the layout of the gemv_s8
// / gemv_s8w launch on the o_proj weight after it (format xq_fmt, xq_rows x rows), which then skips its own
// quantize_s8 launch; the values quantized are the fp16 outputs, so the bytes equal quantize_s8's.
// Reference: voltserve.backends.cpu.CpuBackend.attention (query_len == 1 for every sequence); with the fused
// rotary, CpuBackend.rope_attention.
#include "mma.cuh"
#include "rope.cuh"
#include "s8_xq.cuh"

#ifndef HEAD_DIM
#define HEAD_DIM 64
#endif
#ifndef GROUP
#define GROUP 1
#endif
#ifndef PARTITION
#define PARTITION 4096
#endif
#ifndef PER_ROW
#define PER_ROW 0  // 1: grid.y over query rows, each a decode (see the top)
#endif
#define NUM_THREADS 128
#define NUM_WARPS (NUM_THREADS / 32)
#define VECS (HEAD_DIM / 8)                                  // 16-byte vectors per K row
#define TG (VECS <= 1 ? 1 : VECS <= 2 ? 2 : VECS <= 4 ? 4 : VECS <= 8 ? 8 : VECS <= 16 ? 16 : 32)  // lanes per key
#define KPW (32 / TG)                                         // keys per warp per 16-byte load
#ifndef KV_UNROLL
#define KV_UNROLL (GROUP <= 4 ? 4 : 2)                        // CUDA-core path: keys per lane per load batch
#endif
#define KEYS_PER_ITER (NUM_WARPS * KPW * KV_UNROLL)
// SM80+ scores and P @ V on tensor cores (mma.m16n8k16, 16-key tiles) where the group fits the MMA's 8 columns;
// else (SM70, GROUP > 8, HEAD_DIM % 64 != 0, or -DATTN_SIMT=1 to test that path on any GPU) on CUDA cores.
#ifndef ATTN_SIMT
#define ATTN_SIMT 0
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && GROUP <= 8 && HEAD_DIM % 64 == 0 && !ATTN_SIMT
#define ATTN_MMA 1
#else
#define ATTN_MMA 0
#endif
#ifndef ATTN_MIN_BLOCKS
// MMA path: <= 128 registers for head_dim <= 128 (no spills, 16 warps per SM); wider heads keep more fragments live
#define ATTN_MIN_BLOCKS (ATTN_MMA ? (HEAD_DIM <= 128 ? 4 : 2) : 1)
#endif
static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 256, "HEAD_DIM must be a multiple of 8, at most 256");

struct DecodeParams {
    const half_t* q;             // [num_tokens, num_heads, HEAD_DIM] fp16, strides below
    half_t* kv;                  // [2, num_blocks, block_size, num_kv_heads, HEAD_DIM] fp16 (written: fused rotary)
    const int* block_tables;     // [num_seqs, max_blocks] int32
    const int* seq_lens;         // [num_seqs] int32
    const int* query_start_loc;  // [num_seqs + 1] int32; the query of sequence s is row query_start_loc[s+1]-1
                                 // (PER_ROW: every row of it, each a decode of the keys up to its position)
    half_t* out;                 // [num_tokens, num_heads, HEAD_DIM] fp16, contiguous
    float* part_acc;             // [units, num_heads, num_splits, HEAD_DIM] fp32 workspace (num_splits > 1);
                                 // units: num_seqs, or grid.y (PER_ROW)
    float* part_ml;              // [units, num_heads, num_splits, 2] fp32 workspace: running max, sum
    int* counters;               // [units * num_kv_heads] int32 arrival counters, zero between launches, or
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
    // fused rotary + KV write (see the top): cos_sin nullptr = off (q rotated, the cache holds every key)
    const half_t* k_new;         // [num_tokens, num_kv_heads, HEAD_DIM] fp16 un-rotated, token stride below
    const half_t* v_new;         // [num_tokens, num_kv_heads, HEAD_DIM] fp16
    const i64* positions;        // [num_tokens] int64 (clamped into the table)
    const i64* slot_mapping;     // [num_tokens] int64; < 0: the new key is not written
    const float* cos_sin;        // [max_positions, HEAD_DIM] fp32: cos of each pair, then sin
    i64 k_token_stride;          // elements
    i64 v_token_stride;
    int max_positions;
    int interleaved;             // 0 = neox, 1 = interleaved pairs
    // quantized output (see the top): nullptr = off; the host sets it only where HEAD_DIM % 32 == 0 and
    // GROUP * HEAD_DIM % 128 == 0 (a warp's outputs are whole 32-element blocks in both writers)
    u8* xq;                      // [xq_rows][s8_pitch] int8, then the scales (kernels.gemv_s8_smem_bytes)
    int xq_fmt;                  // the o_proj weight's format (WTYPE_Q4_0 / Q4_1 / Q8_0)
    int xq_rows;                 // x rows of the o_proj launch (= num_seqs)
    // a grid sized for a capacity (CUDA graphs): nullptr = num_splits is the step's own plan; else [1], the split
    // count the host planned for the step's longest context (uploaded with the step's metadata; <= 0:
    // num_splits), so short contexts in a graph for long ones split as the step needs
    const int* step_splits;
    int mixed;                   // a mixed step: sequences of >= 2 query tokens are attn_prefill's (not PER_ROW)
};
VOLT_CHECK_PARAMS(DecodeParams, VOLT_DECODE_PARAMS_BYTES);

// The step's query row `unit` (PER_ROW) as a decode: its sequence (the last s with query_start_loc[s] <= row,
// by binary search over the step metadata) and its causal context (the keys up to its own position). Returns
// false for rows past the step's tokens (a CUDA graph's token slots beyond its padded sequences).
VOLT_DEVICE bool row_as_decode(const DecodeParams& p, int unit, int& seq, int& seq_len) {
    if (unit >= p.query_start_loc[p.num_seqs]) return false;
    int lo = 0, hi = p.num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (p.query_start_loc[mid] <= unit) lo = mid; else hi = mid - 1;
    }
    seq = lo;
    seq_len = p.seq_lens[seq] - (p.query_start_loc[seq + 1] - 1 - unit);
    return true;
}

// The splits a sequence of seq_len keys uses this step: the grid's, or the host's plan for the step's longest
// context (p.step_splits; its load is issued beside seq_lens', before the PDL wait). At most the grid's, whatever
// the word holds, so the splits used (and merged) exist in the grid and its workspace; at least ceil(seq_len /
// PARTITION), so the splits stay even (split_len's PARTITION cap would otherwise leave the last one longer).
VOLT_DEVICE int seq_splits(const DecodeParams& p, int seq_len) {
    const int planned = p.step_splits != nullptr ? *p.step_splits : 0;
    return planned > 0 ? min(p.num_splits, max(planned, (seq_len + PARTITION - 1) / PARTITION)) : p.num_splits;
}

// Keys per split of one sequence: its context spread evenly over its splits (seq_splits; rounded up to 16, at
// least min_part), so a short context still fills many blocks when the grid is sized for a long capacity (CUDA
// graphs). The result is <= PARTITION (the block-table slice in smem) and, its splits being <= the grid's and
// the grid's >= ceil(max_seq_len / PARTITION) (kernels.decode_plan), its splits cover seq_len.
VOLT_DEVICE int split_len(const DecodeParams& p, int seq_len) {
    const int splits = seq_splits(p, seq_len);
    const int per = ((seq_len + splits - 1) / splits + 15) & ~15;
    return min(PARTITION, max(p.min_part, per));
}

#define MERGE_ITEMS (GROUP * HEAD_DIM / 4)                              // 4 outputs per item
#define MERGE_ITEMS_PER_THREAD ((MERGE_ITEMS + NUM_THREADS - 1) / NUM_THREADS)
// Splits whose partial outputs merge_splits loads in the same round trip as their (max, sum) pairs: 16 where a
// thread holds one item (GROUP * HEAD_DIM <= 512, e.g. Llama-3-8B, whose 513-1,024-key contexts take 9-16 splits of
// 64 keys at batch 1: 8 cost one more round trip, 0.2-0.3% of the 8B step), 8 for two, fewer where a thread holds
// more (GROUP * HEAD_DIM > 1024: at most 64 registers of float4s; 8 each spilled at GROUP 16, HEAD_DIM 256).
#define MERGE_REG_SPLITS                                                                                     \
    (MERGE_ITEMS_PER_THREAD == 1   ? 16                                                                      \
     : MERGE_ITEMS_PER_THREAD <= 2 ? 8                                                                       \
     : MERGE_ITEMS_PER_THREAD <= 16 ? 16 / MERGE_ITEMS_PER_THREAD                                            \
                                    : 1)

// out[row, kvh * GROUP + g] for the group's heads from the `used` split partials of `unit` (the workspace's
// index; log-sum-exp rescale), by the whole block. One dependent global round trip: the (max, sum) pairs
// (8-byte loads, to smem `w`: maxima [GROUP][ws], then sums [GROUP][ws], used <= ws) and each thread's 16-byte
// partial outputs of the first MERGE_REG_SPLITS splits (registers) are loaded together; then the split weights
// exp(m_s - M) / L, then each output sums its splits in fixed order (deterministic; later splits are loaded
// then). Partials written by other blocks are read past L1 (ld.global.cg): L1 is not coherent. Needs all threads
// (barriers); `row`: the query row written.
VOLT_DEVICE void merge_splits(const DecodeParams& p, int unit, int kvh, int used, float* w, int ws, i64 row) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const i64 base = ((i64)unit * p.num_heads + kvh * GROUP) * p.num_splits;  // head g adds g * num_splits
    float* wl = w + GROUP * ws;
    for (int i = tid; i < GROUP * used; i += NUM_THREADS) {
        const int g = i / used, sp = i % used;
        const float2 ml = __ldcg(reinterpret_cast<const float2*>(p.part_ml) + base + (i64)g * p.num_splits + sp);
        w[g * ws + sp] = ml.x;
        wl[g * ws + sp] = ml.y;
    }
    float4 pre[MERGE_ITEMS_PER_THREAD][MERGE_REG_SPLITS];
#pragma unroll
    for (int it = 0; it < MERGE_ITEMS_PER_THREAD; ++it) {
        const int i = tid + it * NUM_THREADS, g = 4 * i / HEAD_DIM, d = 4 * i % HEAD_DIM;
        const float4* acc = reinterpret_cast<const float4*>(p.part_acc + (base + (i64)g * p.num_splits) * HEAD_DIM + d);
#pragma unroll
        for (int sp = 0; sp < MERGE_REG_SPLITS; ++sp)
            if (i < MERGE_ITEMS && sp < used) pre[it][sp] = __ldcg(acc + (i64)sp * (HEAD_DIM / 4));
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
            l += wl[g * ws + sp] * e;
        }
        l = warp_sum(l);
        __syncwarp();
        for (int sp = lane; sp < used; sp += 32) w[g * ws + sp] /= l;
    }
    __syncthreads();
#pragma unroll
    for (int it = 0; it < MERGE_ITEMS_PER_THREAD; ++it) {
        const int i = tid + it * NUM_THREADS, g = 4 * i / HEAD_DIM, d = 4 * i % HEAD_DIM;
        if (i >= MERGE_ITEMS) break;
        float o[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int sp = 0; sp < MERGE_REG_SPLITS; ++sp) {
            if (sp >= used) break;
            const float e = w[g * ws + sp];
            o[0] += pre[it][sp].x * e;
            o[1] += pre[it][sp].y * e;
            o[2] += pre[it][sp].z * e;
            o[3] += pre[it][sp].w * e;
        }
        const float4* acc = reinterpret_cast<const float4*>(p.part_acc + (base + (i64)g * p.num_splits) * HEAD_DIM + d);
#pragma unroll 16
        for (int sp = MERGE_REG_SPLITS; sp < used; ++sp) {
            const float4 a = __ldcg(acc + (i64)sp * (HEAD_DIM / 4));
            const float e = w[g * ws + sp];
            o[0] += a.x * e;
            o[1] += a.y * e;
            o[2] += a.z * e;
            o[3] += a.w * e;
        }
        *reinterpret_cast<uint2*>(p.out + (row * p.num_heads + kvh * GROUP + g) * HEAD_DIM + d) =
            make_uint2(pack2(o[0], o[1]), pack2(o[2], o[3]));
        if (p.xq != nullptr) {  // 8 lanes a block
            const float v[4] = {round_h(o[0]), round_h(o[1]), round_h(o[2]), round_h(o[3])};
            xq_store_block<4>(p.xq, p.xq_fmt, p.xq_rows, p.num_heads * HEAD_DIM / 32, (int)row,
                              ((kvh * GROUP + g) * HEAD_DIM + d) / 32, v);
        }
    }
}

// After the PDL wait, by the whole block, in 16-byte vectors: the group's q heads (rotated with cs, the token's
// cos / sin row, else as they are) as fp16 [GROUP][HEAD_DIM] in q_s's smem (MMA path) or the CUDA-core path's fp32
// q_s (pre-scaled); and where the split holds the sequence's newest key, its K and V rows (nk / nv: the fused
// rotary's k_new / v_new, K rotated with cs and both stored to the cache slot `slot`, or the cache rows) into smem
// kv_new [2][HEAD_DIM]. The key's loads are issued before q's, so both arrive in one round trip; the caller syncs
// before reading q_s / kv_new. q head rows are 16-byte aligned (the host's check).
VOLT_DEVICE void stage_query_and_newest_key(const DecodeParams& p, const float* cs, i64 row, int kvh,
                                            const half_t* nk, const half_t* nv, i64 slot, float* q_s,
                                            half_t* kv_new) {
    constexpr int HALF = HEAD_DIM / 2, VPH = HEAD_DIM / 8;  // 16-byte vectors per head row
    const int tid = threadIdx.x;
    // the newest key: the last HEAD_DIM / 4 threads, one vector each (K, then V)
    const int kv_i = tid - (NUM_THREADS - 2 * VPH), plane = kv_i / VPH, d0 = 8 * (kv_i % VPH);
    const bool kv_thread = nk && kv_i >= 0, rotate = plane == 0 && slot >= 0;
    uint4 x = make_uint4(0u, 0u, 0u, 0u), y = x;
    if (kv_thread) {
        const half_t* src = plane ? nv : nk;
        x = *reinterpret_cast<const uint4*>(src + d0);
        if (rotate && !p.interleaved) y = *reinterpret_cast<const uint4*>(src + rope_partner(d0, HALF, 0));
    }
    const half_t* q_group = p.q + row * p.q_token_stride + (i64)kvh * GROUP * p.q_head_stride;
    for (int i = tid; i < GROUP * VPH; i += NUM_THREADS) {
        const int g = i / VPH, q0 = 8 * (i % VPH);
        const half_t* qh = q_group + g * p.q_head_stride;
        uint4 q = *reinterpret_cast<const uint4*>(qh + q0);
        if (cs) {
            const uint4 partner = p.interleaved ? q : *reinterpret_cast<const uint4*>(qh + rope_partner(q0, HALF, 0));
            q = rope_rotate8(q, partner, q0, cs, HALF, p.interleaved);
        }
        if (ATTN_MMA) {
            *reinterpret_cast<uint4*>(reinterpret_cast<half_t*>(q_s) + g * HEAD_DIM + q0) = q;
        } else {
            float f[8];
            unpack8(q, f);
#pragma unroll
            for (int e = 0; e < 8; ++e) q_s[g * HEAD_DIM + q0 + e] = f[e] * p.scale;
        }
    }
    if (kv_thread) {
        const uint4 v = rotate ? rope_rotate8(x, y, d0, cs, HALF, p.interleaved) : x;
        *reinterpret_cast<uint4*>(kv_new + plane * HEAD_DIM + d0) = v;
        if (slot >= 0)
            *reinterpret_cast<uint4*>(p.kv + plane * p.kv_plane + (slot * p.num_kv_heads + kvh) * HEAD_DIM + d0) = v;
    }
}

// Rescale weight of a partial with running max m against the merged max M (0 for an empty partial: m = -inf).
VOLT_DEVICE float lse_weight(float m, float M) { return m == VOLT_NEG_INF ? 0.f : __expf(m - M); }

#include "attention_decode_mma.cuh"  // warp_attend_mma and its tile loads (SM80+ path)

extern "C" __global__ void __launch_bounds__(NUM_THREADS, ATTN_MIN_BLOCKS) attn_decode(const DecodeParams p) {
    // Before pdl_enter (the previous kernel, rotary + KV write or with the fused rotary the QKV GEMV, may still
    // run): only the step's metadata, which one host-to-device copy uploads before any kernel of the step and no
    // kernel writes (seq_lens, block tables, query_start_loc, positions, slot_mapping, step_splits), the constant
    // cos / sin table, and old keys (every key but the step's newest, written by earlier steps; mixed steps: see
    // the top):
    // the MMA path loads its first tile into registers, the CUDA-core path prefetches into L2. q, k_new / v_new
    // and the newest key are read after it. slot_mapping[row] is the block-table slot of key seq_len - 1.
    extern __shared__ float smem[];
    float* q_s = smem;                                  // [GROUP][HEAD_DIM]: fp32 pre-scaled (CUDA cores), or
                                                        // fp16 in its first half (MMA path)
    float* red = q_s + GROUP * HEAD_DIM;                // [NUM_WARPS][GROUP][HEAD_DIM]; then the merge's split
                                                        // maxima (weights) and sums
    float* ml = red + NUM_WARPS * GROUP * HEAD_DIM;     // [NUM_WARPS][GROUP][2]: each warp's running max, sum
    int* tbl_s = reinterpret_cast<int*>(ml + NUM_WARPS * GROUP * 2);  // the split's KV block ids:
                                                                       // PARTITION / block_size + 2 entries
    const int kvh = blockIdx.x, unit = blockIdx.y, split = blockIdx.z;  // unit: a sequence, or a query row
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const bool first_block = (blockIdx.x | blockIdx.y | blockIdx.z) == 0;  // keeps the chain of PDL waits
#if PER_ROW
    int seq, seq_len;
    if (!row_as_decode(p, unit, seq, seq_len)) {
        if (first_block) pdl_enter();
        return;
    }
    const i64 row = unit;
#else
    const int seq = unit, seq_len = p.seq_lens[seq];
#endif
    const int plen = split_len(p, seq_len);
    const int start = split * plen;
    const int n = min(plen, seq_len - start);
    const i64 ws = ((i64)unit * p.num_heads + kvh * GROUP) * p.num_splits + split;  // head g adds g * num_splits
    if (n <= 0) return;  // past this context (the grid is sized for the longest): the reduce never reads it
    const bool direct = seq_len <= plen;  // one split holds the whole context: write out, the reduce skips it
#if !PER_ROW
    const i64 row = p.query_start_loc[seq + 1] - 1;
    if (p.mixed && row != p.query_start_loc[seq]) {  // >= 2 query tokens: attn_prefill's (see the top)
        if (first_block) pdl_enter();
        return;
    }
#endif
    // fused rotary: the token's cos / sin row (constant table) and its cache slot (step metadata) before pdl_enter
    __shared__ float cs_s[HEAD_DIM];
    __shared__ __align__(16) half_t kv_new[2][HEAD_DIM];  // the new key's K (rotated) and V rows
    const bool rope = p.cos_sin != nullptr;
    const i64 slot = rope ? p.slot_mapping[row] : -1;
    const int t_last = start + n == seq_len ? n - 1 : -1;  // the split's newest key (the step's), if it holds it
    const int t_new = rope && slot >= 0 ? t_last : -1;     // ... taken from k_new / v_new
    if (rope) {
        const float* table_row = rope_table_row(p.cos_sin, p.positions[row], p.max_positions, HEAD_DIM);
        for (int i = tid; i < HEAD_DIM; i += NUM_THREADS) cs_s[i] = table_row[i];
    }
    const float* cs = rope ? cs_s : nullptr;
    const int first_blk = start / p.block_size;
    // block table slice first, so each key's address is one smem read away (no global load chain per key)
    for (int i = tid; i <= (start + n - 1) / p.block_size - first_blk; i += NUM_THREADS)
        tbl_s[i] = p.block_tables[(i64)seq * p.max_blocks + first_blk + i];
    __syncthreads();
#if PER_ROW
    pdl_enter();  // the step's new keys (rope_kv_write's) may lie anywhere in this split
#endif
    const half_t* k_head = p.kv + (i64)kvh * HEAD_DIM;
    const i64 slot_stride = (i64)p.num_kv_heads * HEAD_DIM;
    auto key_off = [&](int t) -> i64 {  // element offset of the split's key t in the K (and V) plane
        const int b = (start + t) / p.block_size;
        return ((i64)tbl_s[b - first_blk] * p.block_size + (start + t - b * p.block_size)) * slot_stride;
    };
#if ATTN_MMA
    // this warp's first tile of old keys into registers (the newest key, being written, is left out)
    uint4 kr[2][MMA_KVEC], vr[4][MMA_VSETS];
    mma_load_tile(p, k_head, key_off, warp * 16, n, t_last, lane, kr, vr);
#else
    {   // L2 prefetch of this warp's first keys' K and V rows (the newest key, being written, is skipped)
        constexpr int LINES = (HEAD_DIM * 2 + 127) / 128;  // 128-byte lines per row
        const int first = warp * KPW * KV_UNROLL;
        const int count = min(KPW * KV_UNROLL, n - first - (t_last >= 0 ? 1 : 0));
        for (int i = lane; i < count * 2 * LINES; i += 32) {
            const int t = first + i / (2 * LINES), plane = (i / LINES) & 1, line = i % LINES;
            prefetch_l2(k_head + plane * p.kv_plane + key_off(t) + line * 64, 128, 0, 1);
        }
    }
#endif
    // the newest key's rows: the fused rotary's k_new / v_new, else the cache (written by the previous kernel)
    const half_t* nk = t_new >= 0 ? p.k_new + row * p.k_token_stride + (i64)kvh * HEAD_DIM
                                  : t_last >= 0 ? k_head + key_off(t_last) : nullptr;
    const half_t* nv = t_new >= 0 ? p.v_new + row * p.v_token_stride + (i64)kvh * HEAD_DIM
                                  : t_last >= 0 ? nk + p.kv_plane : nullptr;
    pdl_enter();
    stage_query_and_newest_key(p, cs, row, kvh, nk, nv, t_new >= 0 ? slot : -1, q_s, &kv_new[0][0]);
    __syncthreads();
#if ATTN_MMA
    warp_attend_mma(p, k_head, key_off, n, warp, lane, red, ml, reinterpret_cast<const half_t*>(q_s), kr, vr, t_last,
                    &kv_new[0][0]);
#else

    // One pass with an online softmax (Milakov & Gimelshein 2018): TG lanes share a key, each lane holding one
    // 16-byte slice (8 dims) of its K and V rows; a warp keeps KV_UNROLL keys' K and V loads in flight per lane
    // before it computes. Each group of TG lanes ("sub") keeps its own running max / sum per head; the subs, then
    // the warps, are merged by log-sum-exp in a fixed order (deterministic).
    const int sub = lane / TG, sl = lane % TG;
    const int dsl = sl < VECS ? sl : 0;  // idle lanes (HEAD_DIM not a power-of-two multiple of 8) mirror slice 0
    float m[GROUP], l[GROUP], acc[GROUP][8];
#pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = VOLT_NEG_INF;
        l[g] = 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[g][j] = 0.f;
    }
    for (int t0 = warp * KPW * KV_UNROLL; t0 < n; t0 += KEYS_PER_ITER) {
        uint4 kr[KV_UNROLL], vr[KV_UNROLL];
#pragma unroll
        for (int u = 0; u < KV_UNROLL; ++u) {
            const int t = t0 + u * KPW + sub;
            kr[u] = vr[u] = make_uint4(0u, 0u, 0u, 0u);
            if (t == t_last) {
                kr[u] = *reinterpret_cast<const uint4*>(&kv_new[0][dsl * 8]);
                vr[u] = *reinterpret_cast<const uint4*>(&kv_new[1][dsl * 8]);
            } else if (t < n) {  // past the context: never read (its slots may hold anything)
                const half_t* kp = k_head + key_off(t) + dsl * 8;
                kr[u] = __ldg(reinterpret_cast<const uint4*>(kp));
                vr[u] = __ldg(reinterpret_cast<const uint4*>(kp + p.kv_plane));
            }
        }
        float s[KV_UNROLL][GROUP];
#pragma unroll
        for (int u = 0; u < KV_UNROLL; ++u) {
            float kf[8];
            unpack8(kr[u], kf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                const float* qg = q_s + g * HEAD_DIM + dsl * 8;
                float d = 0.f;
                if (sl < VECS) {
#pragma unroll
                    for (int j = 0; j < 8; ++j) d += qg[j] * kf[j];
                }
#pragma unroll
                for (int o = TG / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                s[u][g] = t0 + u * KPW + sub < n ? d : VOLT_NEG_INF;
            }
        }
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float mx = m[g];
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) mx = fmaxf(mx, s[u][g]);
            if (mx == VOLT_NEG_INF) continue;  // no key of this sub in the chunk
            const float sc = lse_weight(m[g], mx);
            m[g] = mx;
            l[g] *= sc;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] *= sc;
#pragma unroll
            for (int u = 0; u < KV_UNROLL; ++u) s[u][g] = __expf(s[u][g] - mx);  // -inf -> 0
        }
#pragma unroll
        for (int u = 0; u < KV_UNROLL; ++u) {
            float vf[8];
            unpack8(vr[u], vf);
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                if (m[g] == VOLT_NEG_INF) continue;
                l[g] += s[u][g];
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[g][j] += s[u][g] * vf[j];
            }
        }
    }
    // merge the KPW subs of the warp (lanes sl, sl + TG, ...)
#pragma unroll
    for (int o = TG; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o), lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float M = fmaxf(m[g], mo), a = lse_weight(m[g], M), b = lse_weight(mo, M);
            l[g] = l[g] * a + lo * b;
            m[g] = M;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] = acc[g][j] * a + __shfl_xor_sync(0xffffffffu, acc[g][j], o) * b;
        }
    }
    if (sub == 0 && sl < VECS) {
#pragma unroll
        for (int g = 0; g < GROUP; ++g) {
#pragma unroll
            for (int j = 0; j < 8; ++j) red[(warp * GROUP + g) * HEAD_DIM + sl * 8 + j] = acc[g][j];
            if (sl == 0) { ml[(warp * GROUP + g) * 2] = m[g]; ml[(warp * GROUP + g) * 2 + 1] = l[g]; }
        }
    }
#endif  // !ATTN_MMA
    __syncthreads();
    // merge the warps
    for (int i = tid; i < GROUP * HEAD_DIM; i += NUM_THREADS) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float M = VOLT_NEG_INF;
#pragma unroll
        for (int r = 0; r < NUM_WARPS; ++r) M = fmaxf(M, ml[(r * GROUP + g) * 2]);
        float o = 0.f, L = 0.f;
#pragma unroll
        for (int r = 0; r < NUM_WARPS; ++r) {
            const float a = lse_weight(ml[(r * GROUP + g) * 2], M);
            o += red[r * GROUP * HEAD_DIM + i] * a;
            L += ml[(r * GROUP + g) * 2 + 1] * a;
        }
        if (direct) {
            const half_t h = f2h(o / L);
            p.out[(row * p.num_heads + kvh * GROUP + g) * HEAD_DIM + d] = h;
            if (p.xq != nullptr) {  // a warp's 32 outputs are one block
                const float v[1] = {h2f(h)};
                xq_store_block<1>(p.xq, p.xq_fmt, p.xq_rows, p.num_heads * HEAD_DIM / 32, (int)row,
                                  ((kvh * GROUP + g) * HEAD_DIM + d) / 32, v);
            }
        } else {
            const i64 w = ws + (i64)g * p.num_splits;
            p.part_acc[w * HEAD_DIM + d] = o;
            if (d == 0) { p.part_ml[w * 2] = M; p.part_ml[w * 2 + 1] = L; }
        }
    }
    if (direct || p.counters == nullptr) return;
    // the last of this (sequence, KV head)'s splits to finish merges them (no reduce launch)
    __shared__ int s_last;
    __syncthreads();  // every thread's partial stores before thread 0's release
    const int used = min(p.num_splits, (seq_len + plen - 1) / plen);
    int* counter = p.counters + unit * p.num_kv_heads + kvh;
    if (tid == 0) s_last = arrive_acq_rel(counter) == used - 1;
    __syncthreads();  // after thread 0's acquire: the other splits' partials are visible to the whole block
    if (!s_last) return;
    // warp partials consumed: their smem holds the merge's maxima and sums (host: counters only when num_splits
    // fits, kernels.decode_max_merged_splits)
    merge_splits(p, unit, kvh, used, red, NUM_WARPS * HEAD_DIM / 2, row);
    if (tid == 0) *counter = 0;  // ready for the next launch on this stream
}

extern "C" __global__ void __launch_bounds__(NUM_THREADS) attn_decode_reduce(const DecodeParams p) {
    pdl_enter();
    extern __shared__ float w[];  // [2][GROUP][num_splits]: maxima (then weights), sums
    const int kvh = blockIdx.x, unit = blockIdx.y;
#if PER_ROW
    int seq, seq_len;
    if (!row_as_decode(p, unit, seq, seq_len)) return;
    const i64 row = unit;
#else
    const int seq_len = p.seq_lens[unit];
    const i64 row = p.query_start_loc[unit + 1] - 1;
    if (p.mixed && row != p.query_start_loc[unit]) return;  // left to attn_prefill
#endif
    const int plen = split_len(p, seq_len);
    if (seq_len <= plen) return;  // attn_decode wrote this output directly (one split)
    merge_splits(p, unit, kvh, min(p.num_splits, (seq_len + plen - 1) / plen), w, p.num_splits, row);
}
