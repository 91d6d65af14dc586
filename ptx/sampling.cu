// sampling.cu: greedy sampling: per row, the argmax token (first index on ties, like torch.argmax) and its
// log-probability log_softmax(logits)[argmax] = -log(sum(exp(logits - max))).
//
// Grid: (num_rows); block 1024 threads striding over the vocabulary (coalesced), two block reductions.
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
    i64 row_stride;        // elements
    int num_rows;
    int vocab;
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

extern "C" __global__ void __launch_bounds__(1024) argmax_logprob(const ArgmaxParams p) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const i64 base = (i64)blockIdx.x * p.row_stride;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float best = VOLT_NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) better(best, best_i, load_logit(p, base + i), i);
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
    float sum = 0.f;
    for (int i = threadIdx.x; i < p.vocab; i += blockDim.x) sum += __expf(load_logit(p, base + i) - best);
    sum = block_sum(sum, sv);
    if (threadIdx.x == 0) {
        p.out_ids[blockIdx.x] = best_i == 0x7fffffff ? 0 : best_i;
        p.out_logprobs[blockIdx.x] = -logf(sum);
    }
}
