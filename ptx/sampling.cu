// sampling.cu: greedy sampling: per row, the argmax token (first index on ties, like torch.argmax) and its
// log-probability log_softmax(logits)[argmax] = -log(sum(exp(logits - max))).
//
// Grid: (num_rows, num_chunks); one pass: each thread loads AM_BATCH of its chunk's logits at once (coalesced,
// one memory round trip per batch), takes their max, first index and sum of exp(x - max), and folds that into its
// running (max, index, sum) by log-sum-exp rescaling; threads, warps and then chunks combine the same way. With
// num_chunks > 1 each block writes its chunk's triple to `part` and the last block of the row to arrive (arrival
// counter) combines the chunks with one warp: deterministic (fixed combine order), one launch, and a 128K
// vocabulary is read by many SMs instead of one. (The version before read the logits twice with a dependent
// loop of scalar loads, then merged the chunks serially: 13.6 us of the 8B step at 128,256 entries, H200.)
// Compile-time: LOGITS_F16 (1: fp16 logits, 0: fp32).
// SM70 path: the only path. Reference: torch.argmax / torch.log_softmax on the CPU logits.
#include "common.cuh"

#ifndef LOGITS_F16
#define LOGITS_F16 0
#endif

struct ArgmaxParams {
    const void* logits;    // [num_rows, vocab] fp32 or fp16, row stride row_stride
    i64* out_ids;          // [num_rows] int64
    float* out_logprobs;   // [num_rows] fp32
    float* part;           // [num_rows, num_chunks, 3] fp32 workspace (num_chunks > 1)
    int* counters;         // [num_rows] int32 arrival counters, zero between launches (num_chunks > 1)
    i64 row_stride;        // elements
    int num_rows;
    int vocab;
    int chunk;             // vocabulary entries per block (>= vocab when num_chunks == 1)
    int pad_;
};
VOLT_CHECK_PARAMS(ArgmaxParams, VOLT_ARGMAX_PARAMS_BYTES);

VOLT_DEVICE float load_logit(const ArgmaxParams& p, i64 i) { return load_f16_or_f32(p.logits, i, LOGITS_F16); }

#define AM_BATCH 16  // logits per thread loaded together

// Fold (om, os, oi) into (m, s, i): the larger max wins (the lower index on a tie), each sum of exp(x - max)
// rescaled to the new max. An empty triple (max -inf) changes nothing. Commutative bit for bit, so xor-shuffle
// butterflies leave every lane with the same result.
VOLT_DEVICE void am_combine(float& m, float& s, int& i, float om, float os, int oi) {
    if (om == VOLT_NEG_INF) return;
    if (m == VOLT_NEG_INF) {
        m = om; s = os; i = oi;
        return;
    }
    const float M = fmaxf(m, om);
    s = s * __expf(m - M) + os * __expf(om - M);
    if (om > m || (om == m && oi < i)) i = oi;
    m = M;
}

VOLT_DEVICE void am_warp_combine(float& m, float& s, int& i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        am_combine(m, s, i, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o),
                   __shfl_xor_sync(0xffffffffu, i, o));
}

extern "C" __global__ void __launch_bounds__(1024) argmax_logprob(const ArgmaxParams p) {
    pdl_enter();
    __shared__ float sm[32], ss[32];
    __shared__ int si[32];
    __shared__ int s_last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 base = (i64)blockIdx.x * p.row_stride;
    const int lo = blockIdx.y * p.chunk, hi = min(p.vocab, lo + p.chunk);
    float m = VOLT_NEG_INF, s = 0.f;
    int mi = 0x7fffffff;
    for (int b = lo + threadIdx.x; b < hi; b += AM_BATCH * blockDim.x) {
        float v[AM_BATCH];
#pragma unroll
        for (int j = 0; j < AM_BATCH; ++j) {
            const int i = b + j * blockDim.x;
            v[j] = i < hi ? load_logit(p, base + i) : VOLT_NEG_INF;
        }
        float bm = v[0];
        int bj = 0;
#pragma unroll
        for (int j = 1; j < AM_BATCH; ++j)
            if (v[j] > bm) { bm = v[j]; bj = j; }  // strict: the first (lowest index) on a tie
        if (bm == VOLT_NEG_INF) continue;
        float bs = 0.f;
#pragma unroll
        for (int j = 0; j < AM_BATCH; ++j) bs += __expf(v[j] - bm);
        am_combine(m, s, mi, bm, bs, b + bj * blockDim.x);
    }
    am_warp_combine(m, s, mi);
    if (lane == 0) { sm[warp] = m; ss[warp] = s; si[warp] = mi; }
    __syncthreads();
    if (warp != 0) return;
    const int nwarps = blockDim.x >> 5;
    m = lane < nwarps ? sm[lane] : VOLT_NEG_INF;
    s = lane < nwarps ? ss[lane] : 0.f;
    mi = lane < nwarps ? si[lane] : 0x7fffffff;
    am_warp_combine(m, s, mi);
    if (gridDim.y == 1) {
        if (lane == 0) {
            p.out_ids[blockIdx.x] = mi == 0x7fffffff ? 0 : mi;
            p.out_logprobs[blockIdx.x] = -logf(s);
        }
        return;
    }
    float* part = p.part + (i64)blockIdx.x * gridDim.y * 3;
    if (lane == 0) {
        part[blockIdx.y * 3] = m;
        part[blockIdx.y * 3 + 1] = __int_as_float(mi);
        part[blockIdx.y * 3 + 2] = s;
        __threadfence();
        s_last = atomicAdd(p.counters + blockIdx.x, 1) == (int)gridDim.y - 1;
    }
    __syncwarp();
    if (!s_last) return;
    __threadfence();
    // the chunks' triples, lane c taking chunks c, c + 32, ... (fixed order: deterministic)
    m = VOLT_NEG_INF;
    s = 0.f;
    mi = 0x7fffffff;
    for (int c = lane; c < (int)gridDim.y; c += 32)
        am_combine(m, s, mi, __ldcg(part + c * 3), __ldcg(part + c * 3 + 2), __float_as_int(__ldcg(part + c * 3 + 1)));
    am_warp_combine(m, s, mi);
    if (lane == 0) {
        p.out_ids[blockIdx.x] = mi == 0x7fffffff ? 0 : mi;
        p.out_logprobs[blockIdx.x] = -logf(s);
        p.counters[blockIdx.x] = 0;  // ready for the next launch on this stream
    }
}
