// sampling.cu: greedy sampling: per row, the argmax token (first index on ties, like torch.argmax) and its
// log-probability log_softmax(logits)[argmax] = -log(sum(exp(logits - max))).
//
// Grid: (num_rows, num_chunks); block threads stride over their chunk of the vocabulary (coalesced), two block
// reductions. With num_chunks > 1 each block writes its chunk's (max, argmax, sum exp(x - max)) to `part` and
// the last block of the row to arrive (arrival counter) merges the chunks in order: deterministic, one launch,
// and a 128K vocabulary is read by many SMs instead of one.
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

VOLT_DEVICE float load_logit(const ArgmaxParams& p, i64 i) {
#if LOGITS_F16
    return h2f(reinterpret_cast<const half_t*>(p.logits)[i]);
#else
    return reinterpret_cast<const float*>(p.logits)[i];
#endif
}

// (value, index) max with ties to the lower index
VOLT_DEVICE void better(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

// (value, index) argmax of the block, ties to the lower index; every thread gets it
VOLT_DEVICE void block_argmax(float& best, int& best_i, float* sv, int* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(best, best_i, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_i, o));
    if (lane == 0) { sv[warp] = best; si[warp] = best_i; }
    __syncthreads();
    best = lane < (int)(blockDim.x >> 5) ? sv[lane] : VOLT_NEG_INF;
    best_i = lane < (int)(blockDim.x >> 5) ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        better(best, best_i, __shfl_xor_sync(0xffffffffu, best, o), __shfl_xor_sync(0xffffffffu, best_i, o));
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(1024) argmax_logprob(const ArgmaxParams p) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int s_last;
    const i64 base = (i64)blockIdx.x * p.row_stride;
    const int lo = blockIdx.y * p.chunk, hi = min(p.vocab, lo + p.chunk);
    float best = VOLT_NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) better(best, best_i, load_logit(p, base + i), i);
    block_argmax(best, best_i, sv, si);
    float sum = 0.f;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) sum += __expf(load_logit(p, base + i) - best);
    sum = block_sum(sum, sv);
    if (gridDim.y == 1) {
        if (threadIdx.x == 0) {
            p.out_ids[blockIdx.x] = best_i == 0x7fffffff ? 0 : best_i;
            p.out_logprobs[blockIdx.x] = -logf(sum);
        }
        return;
    }
    float* part = p.part + (i64)blockIdx.x * gridDim.y * 3;
    if (threadIdx.x == 0) {
        part[blockIdx.y * 3] = best;
        part[blockIdx.y * 3 + 1] = __int_as_float(best_i);
        part[blockIdx.y * 3 + 2] = sum;
        __threadfence();
        s_last = atomicAdd(p.counters + blockIdx.x, 1) == (int)gridDim.y - 1;
    }
    __syncthreads();
    if (!s_last || threadIdx.x != 0) return;
    __threadfence();
    // chunks in order: a tie keeps the earlier chunk, i.e. the lower index
    float m = VOLT_NEG_INF;
    int mi = 0x7fffffff;
    for (int c = 0; c < (int)gridDim.y; ++c) better(m, mi, __ldcg(part + c * 3), __float_as_int(__ldcg(part + c * 3 + 1)));
    float total = 0.f;
    for (int c = 0; c < (int)gridDim.y; ++c) total += __ldcg(part + c * 3 + 2) * __expf(__ldcg(part + c * 3) - m);
    p.out_ids[blockIdx.x] = mi == 0x7fffffff ? 0 : mi;
    p.out_logprobs[blockIdx.x] = -logf(total);
    p.counters[blockIdx.x] = 0;  // ready for the next launch on this stream
}
