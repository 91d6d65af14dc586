// sample_common.cuh: what the sampling kernels share (sample_topk_topp.cu, sample_chunks.cu): the parameter
// structs, the order-preserving keys, Philox4x32-10, the race, radix select and block reductions. The semantics
// and the algorithm are stated in sample_topk_topp.cu.
#pragma once
#include "common.cuh"

#ifndef LOGITS_F16
#define LOGITS_F16 0
#endif
#ifndef SAMPLE_MAX_TOP
#define SAMPLE_MAX_TOP 20
#endif
#define SAMPLE_THREADS 1024

typedef unsigned long long u64;

struct SampleRow {           // per-row parameters, [num_rows] on the device
    u64 seed;                // Philox key
    u64 offset;              // Philox counter words 2-3 (the caller gives each sampled row its own)
    float temperature;       // <= 0: greedy
    float top_p;             // (0, 1]; 1 = off
    float min_p;             // [0, 1]; 0 = off
    int top_k;               // <= 0 or >= vocab: off
    int num_logprobs;        // 0..SAMPLE_MAX_TOP alternatives written to out_top_*
    int draft;               // with out_passed: the draft this row checks (< 0: none, a plain sample)
};
VOLT_CHECK_PARAMS(SampleRow, VOLT_SAMPLE_ROW_BYTES);

struct SampleParams {
    const void* logits;          // [num_rows, vocab] fp32 or fp16, row stride row_stride
    const SampleRow* rows;       // [num_rows]
    i64* out_ids;                // [num_rows] int64 sampled token
    float* out_logprobs;         // [num_rows] fp32 its log_softmax value
    i64* out_top_ids;            // [num_rows, SAMPLE_MAX_TOP] int64; entries past num_logprobs = -1
    float* out_top_logprobs;     // [num_rows, SAMPLE_MAX_TOP] fp32; entries past num_logprobs = -inf
    i64 row_stride;              // elements
    int num_rows;
    int vocab;
    i64* out_passed;             // [num_rows] int64 draft checks (1: passed), or null: no row checks a draft
    float* part;                 // sample_chunks: [num_rows, chunks] SampleChunk partials, then candidates
    int* counters;               // sample_chunks: [num_rows] arrival counters, zero between launches
    u64* hist;                   // sample_chunks: [num_rows, SAMPLE_BINS + 1] top-p weights and candidate count, zero
                                 // between launches
};
VOLT_CHECK_PARAMS(SampleParams, VOLT_SAMPLE_PARAMS_BYTES);

VOLT_DEVICE float load_x(const SampleParams& p, i64 i) { return load_f16_or_f32(p.logits, i, LOGITS_F16); }

// Order-preserving map fp32 -> u32 (-0 folded into +0 so equal values get equal keys).
VOLT_DEVICE u32 fkey(float f) {
    u32 u = __float_as_uint(f + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Philox4x32-10 (Random123's philox4x32, 10 rounds). c: 4 counter words in/out, k0/k1: key.
VOLT_DEVICE void philox4x32_10(u32* c, u32 k0, u32 k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r) { k0 += 0x9E3779B9u; k1 += 0xBB67AE85u; }
        const u32 hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const u32 hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const u32 n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
    }
}

// elements a thread loads before it processes them (loads in flight: one block walks a whole row); a multiple of 4
// (the race draws 4 words a Philox call)
#ifndef SAMPLE_UNROLL
#define SAMPLE_UNROLL 8
#endif
static_assert(SAMPLE_UNROLL % 4 == 0, "the race takes a Philox call's 4 words for 4 of a thread's loads");

struct SampleSmem {
    // radix_select's bins of u64 weights as two u32 words (low, high): every lane adds to them with native 32-bit
    // shared atomics, the low word's carry going to the high word (exact, so order-independent). Measured 2.7x
    // faster on a top-p row than u64 bins each warp summed per distinct bin first (session 34, H100).
    u32 hist_lo[256];
    u32 hist_hi[256];
    float f[32];
    int i[32];
    int cnt_a[32];
    int cnt_b[32];
    float top_v[SAMPLE_MAX_TOP];
    int top_i[SAMPLE_MAX_TOP];
    u64 w64[32];
    int bin;
    u64 above;
    double target;
};

// A u64 histogram kept as u32 word pairs in shared memory (lo[b], hi[b]): bin b's value, and adding w to it with
// native 32-bit atomics, the low word's carry going to the high word (exact, so order-independent).
VOLT_DEVICE u64 pair_get(const u32* lo, const u32* hi, int b) { return ((u64)hi[b] << 32) | lo[b]; }

VOLT_DEVICE void pair_add(u32* lo, u32* hi, int b, u64 w) {
    const u32 l = (u32)w, old = atomicAdd(&lo[b], l);
    const u32 h = (u32)(w >> 32) + (old + l < old ? 1u : 0u);
    if (h) atomicAdd(&hi[b], h);
}

// Calls body(i, x) for every element i < vocab of the row at `base` in a block-strided order, each thread
// loading SAMPLE_UNROLL elements before it processes them; x = 0 for i >= vocab (body must check i).
template <class Body>
VOLT_DEVICE void for_row(const SampleParams& p, i64 base, int vocab, const Body& body);

// Block radix select over the keys of included elements: returns the key v with
// W(key > v) < target <= W(key >= v) (each side as a double of the exact u64 sum), W = above0 + the sum of the
// included elements' weights; *above_out = W(key > v) (in weight units, exact).
// If frac > 0 the target is frac * (the included elements' total weight), computed in the first pass.
// each(body) calls body(i, x) for every candidate element (i < 0: none; the block's threads may make different
// numbers of calls); f(x, key, weight, mask, prefix) -> bool included, x the element's logit: sets key, and weight
// only when (key & mask) == prefix (the elements this pass counts). Every thread of the block must call it.
template <class Each, class F>
VOLT_DEVICE u32 radix_select(const Each& each, const F& f, double target, double frac, SampleSmem& sm, u64 above0,
                             u64* above_out) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    u32 prefix = 0, mask = 0;
    u64 above = above0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += blockDim.x) { sm.hist_lo[b] = 0u; sm.hist_hi[b] = 0u; }
        __syncthreads();
        each([&](int i, float x) {
            u32 key = 0u;
            u64 w = 0ull;
            const bool in = i >= 0 && f(x, key, w, mask, prefix);
            if (in) pair_add(sm.hist_lo, sm.hist_hi, (key >> shift) & 255u, w);
        });
        __syncthreads();
        if (warp == 0) {
            // lane l owns bins 255 - 8l .. 248 - 8l (descending); lane 0 holds the largest keys
            u64 local[8];
            u64 tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                local[j] = pair_get(sm.hist_lo, sm.hist_hi, 255 - 8 * lane - j);
                tot += local[j];
            }
            u64 incl = tot;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 t = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += t;
            }
            double tgt = target;
            if (shift == 24 && frac > 0.0) tgt = frac * (double)__shfl_sync(0xffffffffu, incl, 31);
            else if (shift != 24) tgt = sm.target;
            const u64 excl = incl - tot;
            const bool hit = (double)(above + excl) < tgt && (double)(above + incl) >= tgt;
            const unsigned ball = __ballot_sync(0xffffffffu, hit);
            const int src = ball ? __ffs(ball) - 1 : 31;
            if (lane == src) {
                u64 acc = above + excl;
                int d = 255 - 8 * lane - 7;
                for (int j = 0; j < 8; ++j) {
                    if ((double)(acc + local[j]) >= tgt) { d = 255 - 8 * lane - j; break; }
                    acc += local[j];
                }
                sm.bin = d;
                sm.above = acc;
                sm.target = tgt;
            }
        }
        __syncthreads();
        prefix |= (u32)sm.bin << shift;
        mask |= 255u << shift;
        above = sm.above;
        __syncthreads();  // sm.bin / sm.above are rewritten in the next pass
    }
    *above_out = above;
    return prefix;
}

// radix_select's `each` over a whole row: every element i < vocab of the row at `base` (for_row's order)
struct RowElements {
    const SampleParams& p;
    i64 base;
    int vocab;
    template <class Body>
    VOLT_DEVICE void operator()(const Body& body) const {
        for_row(p, base, vocab, [&](int i, float x) { body(i < vocab ? i : -1, x); });
    }
};

template <class Body>
VOLT_DEVICE void for_row(const SampleParams& p, i64 base, int vocab, const Body& body) {
    const int step = blockDim.x * SAMPLE_UNROLL;
    for (int b0 = 0; b0 < vocab; b0 += step) {
        float xs[SAMPLE_UNROLL];
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; ++u) {
            const int i = b0 + u * blockDim.x + threadIdx.x;
            xs[u] = i < vocab ? load_x(p, base + i) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; ++u) body(b0 + u * blockDim.x + threadIdx.x, xs[u]);
    }
}

// (v, idx) = (ov, oi) where that is larger: the greater value, ties to the lower index (every argmax here, the
// race's included, breaks ties so; the chunked kernel's tokens equal the single-block kernel's by it).
VOLT_DEVICE void keep_max(float& v, int& idx, float ov, int oi) {
    if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
}

// Block argmax of (v, i) with ties to the lower index; every thread gets the result.
VOLT_DEVICE void block_argmax(float& v, int& idx, SampleSmem& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        keep_max(v, idx, ov, oi);
    }
    if (lane == 0) { sm.f[warp] = v; sm.i[warp] = idx; }
    __syncthreads();
    v = lane < nw ? sm.f[lane] : VOLT_NEG_INF;
    idx = lane < nw ? sm.i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        keep_max(v, idx, ov, oi);
    }
    __syncthreads();
}

// A u32 Philox word as a uniform float in (0, 1), 2^-23 steps.
VOLT_DEVICE float unit_float(u32 r) { return ((float)(r >> 9) + 0.5f) * 1.1920928955078125e-7f; }

// A point-mass draft's check: passes with probability e_d / kept_sum (its p under the kept set), on the row's
// own draw (Philox counter (0, 1, offset), distinct from the race's).
VOLT_DEVICE int draft_passes(float e_d, float kept_sum, u32 k0, u32 k1, u32 c2, u32 c3) {
    u32 c[4] = {0u, 1u, c2, c3};
    philox4x32_10(c, k0, k1);
    return unit_float(c[0]) * kept_sum < e_d;
}

// The race over one b0 step of a row: this thread's SAMPLE_UNROLL tokens i = b0 + u * blockDim + tid, sv[u] their
// scaled logits, keep[u] whether they run (kept, not the draft); token i takes word u % 4 of Philox counter
// (b0 + tid, 2 + u / 4, c2, c3) under key (k0, k1). Updates the thread's (best, best_i): the largest
// sv - log(E), E ~ Exp(1), ties to the lower index.
VOLT_DEVICE void race_step(const float* sv, const bool* keep, int b0, u32 k0, u32 k1, u32 c2, u32 c3, float& best,
                           int& best_i) {
#pragma unroll
    for (int q = 0; q < SAMPLE_UNROLL; q += 4) {
        if (!(keep[q] || keep[q + 1] || keep[q + 2] || keep[q + 3])) continue;
        u32 c[4] = {(u32)(b0 + threadIdx.x), 2u + (u32)(q / 4), c2, c3};
        philox4x32_10(c, k0, k1);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (!keep[q + j]) continue;
            const int i = b0 + (q + j) * blockDim.x + threadIdx.x;
            const float w = unit_float(c[j]);
            const float g = sv[q + j] - logf(-log1pf(-w));                      // s - log(E), E ~ Exp(1)
            keep_max(best, best_i, g, i);
        }
    }
}

// race_step's key for one token i (scaled logit sv) on its own: the same Philox word (a block of SAMPLE_THREADS
// threads walking the row in SAMPLE_UNROLL loads a thread), so the same value.
VOLT_DEVICE float race_key(int i, float sv, u32 k0, u32 k1, u32 c2, u32 c3) {
    const int step = SAMPLE_THREADS * SAMPLE_UNROLL, b0 = i / step * step, u = (i - b0) / SAMPLE_THREADS;
    u32 c[4] = {(u32)(b0 + (i - b0) % SAMPLE_THREADS), 2u + (u32)(u / 4), c2, c3};
    philox4x32_10(c, k0, k1);
    const float w = unit_float(c[u % 4]);
    return sv - logf(-log1pf(-w));
}

// Block sum of v; every thread gets the result.
VOLT_DEVICE float block_sum(float v, SampleSmem& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) sm.f[warp] = v;
    __syncthreads();
    v = lane < nw ? sm.f[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

// one element x (index i, above every earlier one of this thread) into an online-softmax state (m, s, i)
VOLT_DEVICE void online_ms(float& m, float& s, int& am, float x, int i) {
    if (x > m) {
        s = (m == VOLT_NEG_INF ? 0.f : s * expf(m - x)) + 1.f;
        m = x;
        am = i;
    } else if (x != VOLT_NEG_INF) {  // a thread's indices increase: a tie keeps the lower index
        s += expf(x - m);
    }
}

// merge two online-softmax states (max m, sum s of exp(x - m), argmax index i)
VOLT_DEVICE void merge_ms(float& m, float& s, int& i, float om, float os, int oi) {
    if (om > m || (om == m && oi < i)) {
        s = (m == VOLT_NEG_INF ? 0.f : s * expf(m - om)) + os;
        m = om;
        i = oi;
    } else if (om != VOLT_NEG_INF) {
        s += os * expf(om - m);
    }
}

// Block merge of every thread's online-softmax state; every thread gets the result.
VOLT_DEVICE void block_merge_ms(float& m, float& s, int& am, SampleSmem& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        merge_ms(m, s, am, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o),
                 __shfl_xor_sync(0xffffffffu, am, o));
    if (lane == 0) { sm.f[warp] = m; sm.i[warp] = am; sm.cnt_a[warp] = __float_as_int(s); }
    __syncthreads();
    m = lane < nw ? sm.f[lane] : VOLT_NEG_INF;
    s = lane < nw ? __int_as_float(sm.cnt_a[lane]) : 0.f;
    am = lane < nw ? sm.i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        merge_ms(m, s, am, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o),
                 __shfl_xor_sync(0xffffffffu, am, o));
    __syncthreads();
}
