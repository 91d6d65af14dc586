// sample_topk_topp.cu: per-row sampling with temperature, top-k, top-p, min-p and a counter-based RNG, plus the
// sampled token's log-probability and the top-`num_logprobs` alternatives (ids, logprobs).
//
// Semantics (the contract is voltserve.sampling.sample without penalties / min_tokens masking):
//   logprobs are log_softmax(logits) of the model distribution (before temperature and filtering);
//   temperature 0 = argmax (first index on ties); otherwise s = logits / T, then
//   top-k keeps s >= (k-th largest s) (ties at the k-th value all kept),
//   min-p keeps exp(s - s_max) >= min_p (same as softmax(s) >= min_p * max softmax(s)),
//   top-p keeps, of what is left, a token when the renormalised mass of the strictly larger tokens is < top_p
//   (nucleus sampling, Holtzman et al. 2019; a tie group at the boundary is kept whole),
//   then one token is drawn from softmax(s) restricted to the kept set.
//
// Algorithm (one block per row, no sort, deterministic: the same inputs and (seed, offset) give the same token):
//   1. one pass: online max / sum(exp) (Milakov & Gimelshein 2018) -> argmax, logZ = max + log(sum).
//   2. thresholds by radix select over order-preserving 32-bit keys of the fp32 values, 8 bits per pass (4
//      passes): a 256-bin histogram in shared memory of u64 weights (each a pair of u32 words every lane adds to
//      with 32-bit atomics), then warp 0 scans the bins from the top to
//      find the bin where the cumulative weight crosses the target. Weight 1 gives the k-th largest value
//      (top-k and the top-`num_logprobs` logprobs); weight = round(exp(s - s_max) * 2^40) (fixed point, so the
//      integer atomics are order-independent and the result deterministic) gives the top-p threshold, with target
//      top_p * (total kept weight).
//   3. sampling by the exponential race / Gumbel-max trick (argmax_i s_i - log E_i, E_i ~ Exp(1) i.i.d., equal
//      to sampling from softmax(s) over the kept set): E_i from Philox4x32-10 (Salmon, Moraes, Dror, Shaw 2011,
//      "Parallel random numbers: as easy as 1, 2, 3", SC'11) with key = the row's 64-bit seed; token
//      i = b0 + u * 1024 + t (thread t's u-th load of the SAMPLE_UNROLL from b0) takes word u % 4 of counter
//      (b0 + t, 2 + u / 4, offset lo, offset hi), r giving w = (r >> 9 + 0.5) * 2^-23 in (0, 1), E = -log1p(-w).
//   4. top-`num_logprobs`: radix select of the n-th largest logit, then an index-ordered block compaction
//      (ballots) of the larger ones and the lowest-index ties, sorted by (logprob desc, index asc).
//
// Speculative sampling's draft checks (out_passed set; Leviathan et al. 2023, "Fast Inference from Transformers via
// Speculative Decoding"), for drafts proposed for certain (q a point mass, as n-gram lookup proposes): a row with
// draft d >= 0 passes with probability p(d) under the kept set above (one more Philox draw u, counter
// (0, 1, offset lo, offset hi), distinct from the race's (.., >= 2, ..); passed = u * sum_kept e < e_d, e = exp(s -
// s_max)), and its token is drawn from the residual, the kept set without d (p without d, renormalised: what a
// rejection samples). A row whose kept set is {d} always passes. Greedy rows pass when d is the argmax. The
// caller emits a span's drafts up to its first failing row, then that row's token (or the last row's).
// Grid: (num_rows); block 1024 threads striding over the vocabulary (coalesced, SAMPLE_UNROLL loads in flight a
// thread); static smem ~2.6 KiB (256 x 2 x u32 histogram + reduction scratch). Up to 1 + 4 + 4 + 4 + 1 + 1
// passes over the row for a row with top-k, top-p and logprobs; passes are skipped when a feature is off.
// Compile-time: LOGITS_F16 (1: fp16 logits, 0: fp32). SM70 path: the only path (fp32 math, u32 shared atomics,
// no sm_80+ intrinsics). Vocab must be < 2^23 (fixed-point headroom of the top-p weights).
// Also here: philox4x32_10_test, a test kernel exposing the generator for known-answer tests.
// Reference: voltserve.sampling.sample / torch.log_softmax / torch.topk on the CPU logits.
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
    float* part;                 // sample_plain_chunks: [num_rows, chunks] SampleChunk partials
    int* counters;               // sample_plain_chunks: [num_rows] arrival counters, zero between launches
};
VOLT_CHECK_PARAMS(SampleParams, VOLT_SAMPLE_PARAMS_BYTES);

VOLT_DEVICE float load_x(const SampleParams& p, i64 i) {
#if LOGITS_F16
    return h2f(reinterpret_cast<const half_t*>(p.logits)[i]);
#else
    return reinterpret_cast<const float*>(p.logits)[i];
#endif
}

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
    int bin;
    double above;
    double target;
};

VOLT_DEVICE u64 hist_get(const SampleSmem& sm, int b) {
    return ((u64)sm.hist_hi[b] << 32) | sm.hist_lo[b];
}

// Calls body(i, x) for every element i < vocab of the row at `base` in a block-strided order, each thread
// loading SAMPLE_UNROLL elements before it processes them; x = 0 for i >= vocab (body must check i).
template <class Body>
VOLT_DEVICE void for_row(const SampleParams& p, i64 base, int vocab, const Body& body);

// Block radix select over the keys of included elements: returns the key v with
// W(key > v) < target <= W(key >= v), W = sum of weights; *above_out = W(key > v) (in weight units).
// If frac > 0 the target is frac * (total weight), computed in the first pass.
// f(x, key, weight, mask, prefix) -> bool included, x the element's logit: sets key, and weight only when
// (key & mask) == prefix (the elements this pass counts). Every thread of the block must call it.
template <class F>
VOLT_DEVICE u32 radix_select(const SampleParams& p, i64 base, const F& f, int vocab, double target, double frac,
                             SampleSmem& sm, double* above_out) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    u32 prefix = 0, mask = 0;
    double above = 0.0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += blockDim.x) { sm.hist_lo[b] = 0u; sm.hist_hi[b] = 0u; }
        __syncthreads();
        for_row(p, base, vocab, [&](int i, float x) {
            u32 key = 0u;
            u64 w = 0ull;
            const bool in = i < vocab && f(x, key, w, mask, prefix);
            if (in) {
                const u32 bin = (key >> shift) & 255u, lo = (u32)w, old = atomicAdd(&sm.hist_lo[bin], lo);
                const u32 hi = (u32)(w >> 32) + (old + lo < old ? 1u : 0u);
                if (hi) atomicAdd(&sm.hist_hi[bin], hi);
            }
        });
        __syncthreads();
        if (warp == 0) {
            // lane l owns bins 255 - 8l .. 248 - 8l (descending); lane 0 holds the largest keys
            u64 local[8];
            u64 tot = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) { local[j] = hist_get(sm, 255 - 8 * lane - j); tot += local[j]; }
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
            const bool hit = above + (double)excl < tgt && above + (double)incl >= tgt;
            const unsigned ball = __ballot_sync(0xffffffffu, hit);
            const int src = ball ? __ffs(ball) - 1 : 31;
            if (lane == src) {
                double acc = above + (double)excl;
                int d = 255 - 8 * lane - 7;
                for (int j = 0; j < 8; ++j) {
                    if (acc + (double)local[j] >= tgt) { d = 255 - 8 * lane - j; break; }
                    acc += (double)local[j];
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

// Block argmax of (v, i) with ties to the lower index; every thread gets the result.
VOLT_DEVICE void block_argmax(float& v, int& idx, SampleSmem& sm) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    if (lane == 0) { sm.f[warp] = v; sm.i[warp] = idx; }
    __syncthreads();
    v = lane < nw ? sm.f[lane] : VOLT_NEG_INF;
    idx = lane < nw ? sm.i[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    __syncthreads();
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
            const float w = ((float)(c[j] >> 9) + 0.5f) * 1.1920928955078125e-7f;  // (0, 1), 2^-23 steps
            const float g = sv[q + j] - logf(-log1pf(-w));                      // s - log(E), E ~ Exp(1)
            if (g > best || (g == best && i < best_i)) { best = g; best_i = i; }
        }
    }
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

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_topk_topp(const SampleParams p) {
    pdl_enter();
    __shared__ SampleSmem sm;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    const int vocab = p.vocab;
    const i64 base = (i64)row * p.row_stride;
    const SampleRow rp = p.rows[row];

    // ---- 1. max, argmax, log-sum-exp of the raw logits (one pass, online) ----
    float m = VOLT_NEG_INF, s = 0.f;
    int am = 0x7fffffff;
    for_row(p, base, vocab, [&](int i, float x) {
        if (i < vocab) online_ms(m, s, am, x, i);
    });
    block_merge_ms(m, s, am, sm);
    const float x_max = m;
    const float log_z = m + logf(s);
    const int argmax = am == 0x7fffffff ? 0 : am;

    // ---- 2. top-num_logprobs of the model distribution ----
    const int n_top = min(max(rp.num_logprobs, 0), min(SAMPLE_MAX_TOP, vocab));
    if (n_top > 0) {
        double n_greater;
        const u32 kth = radix_select(
            p, base,
            [&](float x, u32& key, u64& w, u32 mask, u32 prefix) {
                key = fkey(x);
                w = 1ull;
                return (key & mask) == prefix;
            },
            vocab, (double)n_top, 0.0, sm, &n_greater);
        const int greater = (int)n_greater, ties_needed = n_top - greater;
        int run_g = 0, run_t = 0;
        const unsigned lt_mask = (1u << lane) - 1u;
        for (int b0 = 0; b0 < vocab; b0 += blockDim.x) {
            const int i = b0 + tid;
            const float x = i < vocab ? load_x(p, base + i) : 0.f;
            const u32 key = i < vocab ? fkey(x) : 0u;
            const bool fg = i < vocab && key > kth, ft = i < vocab && key == kth;
            const unsigned bg = __ballot_sync(0xffffffffu, fg), bt = __ballot_sync(0xffffffffu, ft);
            if (lane == 0) { sm.cnt_a[warp] = __popc(bg); sm.cnt_b[warp] = __popc(bt); }
            __syncthreads();
            int off_g = 0, off_t = 0, tot_g = 0, tot_t = 0;
            for (int w = 0; w < nw; ++w) {
                const int a = sm.cnt_a[w], c = sm.cnt_b[w];
                if (w < warp) { off_g += a; off_t += c; }
                tot_g += a;
                tot_t += c;
            }
            if (fg) {
                const int pos = run_g + off_g + __popc(bg & lt_mask);
                if (pos < n_top) { sm.top_v[pos] = x; sm.top_i[pos] = i; }
            }
            if (ft) {
                const int pos = run_t + off_t + __popc(bt & lt_mask);
                if (pos < ties_needed) { sm.top_v[greater + pos] = x; sm.top_i[greater + pos] = i; }
            }
            run_g += tot_g;
            run_t += tot_t;
            __syncthreads();
            if (run_g >= greater && run_t >= ties_needed) break;  // uniform: every thread has the same totals
        }
        if (tid == 0) {
            // insertion sort by (value desc, index asc)
            for (int a = 1; a < n_top; ++a) {
                const float v = sm.top_v[a];
                const int id = sm.top_i[a];
                int b = a - 1;
                while (b >= 0 && (sm.top_v[b] < v || (sm.top_v[b] == v && sm.top_i[b] > id))) {
                    sm.top_v[b + 1] = sm.top_v[b];
                    sm.top_i[b + 1] = sm.top_i[b];
                    --b;
                }
                sm.top_v[b + 1] = v;
                sm.top_i[b + 1] = id;
            }
        }
        __syncthreads();
    }
    if (tid < SAMPLE_MAX_TOP) {
        const i64 o = (i64)row * SAMPLE_MAX_TOP + tid;
        p.out_top_ids[o] = tid < n_top ? (i64)sm.top_i[tid] : -1;
        p.out_top_logprobs[o] = tid < n_top ? sm.top_v[tid] - log_z : VOLT_NEG_INF;
    }

    // ---- 3. the token (and the draft check) ----
    int token = argmax;
    const int draft = p.out_passed != nullptr && rp.draft < vocab ? rp.draft : -1;
    int passed = 0;
    const float temp = rp.temperature;
    if (temp > 0.f) {
        const float s_max = x_max / temp;
        const bool use_k = rp.top_k > 0 && rp.top_k < vocab;
        const bool use_minp = rp.min_p > 0.f;
        const bool use_p = rp.top_p < 1.f;
        const float min_p = rp.min_p;
        u32 k_key = 0u;
        double unused;
        if (use_k)
            k_key = radix_select(
                p, base,
                [&](float x, u32& key, u64& w, u32 mask, u32 prefix) {
                    key = fkey(x / temp);
                    w = 1ull;
                    return (key & mask) == prefix;
                },
                vocab, (double)rp.top_k, 0.0, sm, &unused);
        // kept by top-k and min-p (e = exp(s - s_max) in (0, 1] >= min_p)
        auto kept1 = [&](float sv, u32 key) { return key >= k_key && (!use_minp || expf(sv - s_max) >= min_p); };
        u32 p_key = 0u;
        if (use_p)
            p_key = radix_select(
                p, base,
                [&](float x, u32& key, u64& w, u32 mask, u32 prefix) {
                    const float sv = x / temp;
                    key = fkey(sv);
                    if ((key & mask) != prefix || !kept1(sv, key)) return false;
                    w = __float2ull_rn(expf(sv - s_max) * 1099511627776.0f);  // 2^40 fixed point
                    return true;
                },
                vocab, 0.0, (double)rp.top_p, sm, &unused);
        const u32 k0 = (u32)rp.seed, k1 = (u32)(rp.seed >> 32);
        const u32 c2 = (u32)rp.offset, c3 = (u32)(rp.offset >> 32);
        float best = VOLT_NEG_INF, kept_sum = 0.f;
        int best_i = 0x7fffffff;
        // element i = b0 + u * blockDim + tid takes word u % 4 of Philox counter (b0 + tid, 2 + u / 4, offset):
        // one call for four elements (the race was bound by Philox's arithmetic)
        const int step = blockDim.x * SAMPLE_UNROLL;
        for (int b0 = 0; b0 < vocab; b0 += step) {
            float sv[SAMPLE_UNROLL];
            bool keep[SAMPLE_UNROLL];
#pragma unroll
            for (int u = 0; u < SAMPLE_UNROLL; ++u) {
                const int i = b0 + u * blockDim.x + tid;
                sv[u] = i < vocab ? load_x(p, base + i) / temp : 0.f;
            }
#pragma unroll
            for (int u = 0; u < SAMPLE_UNROLL; ++u) {
                const int i = b0 + u * blockDim.x + tid;
                const u32 key = fkey(sv[u]);
                keep[u] = i < vocab && key >= p_key && kept1(sv[u], key);
                if (keep[u] && draft >= 0) {
                    kept_sum += expf(sv[u] - s_max);
                    keep[u] = i != draft;  // the race runs over the residual
                }
            }
            race_step(sv, keep, b0, k0, k1, c2, c3, best, best_i);
        }
        block_argmax(best, best_i, sm);
        if (best_i != 0x7fffffff) token = best_i;
        if (draft >= 0) {
            kept_sum = block_sum(kept_sum, sm);
            const float sd = load_x(p, base + draft) / temp;
            const u32 kd = fkey(sd);
            const float e_d = kd >= p_key && kept1(sd, kd) ? expf(sd - s_max) : 0.f;
            u32 c[4] = {0u, 1u, c2, c3};
            philox4x32_10(c, k0, k1);
            const float u = ((float)(c[0] >> 9) + 0.5f) * 1.1920928955078125e-7f;
            passed = u * kept_sum < e_d;
        }
    } else {
        passed = draft >= 0 && argmax == draft;
    }
    if (tid == 0) {
        p.out_ids[row] = token;
        p.out_logprobs[row] = load_x(p, base + token) - log_z;
        if (p.out_passed != nullptr) p.out_passed[row] = passed;
    }
}

// ---- sample_plain_chunks: sample_topk_topp's tokens for rows without top-k / top-p / min-p / logprobs, a row over
// many blocks (one SM a row bounded the single-block kernel: ~46 us for a 49,152 row on an H100) ----
// Grid (num_rows, chunks = ceil(vocab / (SAMPLE_THREADS * SAMPLE_UNROLL))), block SAMPLE_THREADS: block (r, c) runs
// one b0 = c * SAMPLE_THREADS * SAMPLE_UNROLL step of sample_topk_topp's passes over row r (the same loads and the
// same Philox words, so the same race: the same token for the same (seed, offset)), then writes its partials: the
// raw logits' (max, sum of exp, argmax), the scaled ones' (max, sum of exp) for a draft check, and the race's
// winner. The row's last block to arrive (an arrival counter) merges them in a fixed order and writes the row's
// outputs as sample_topk_topp does (top entries -1 / -inf); log_z and a draft check's sum are summed in another
// order than there (last-bit differences; the tokens are the same).
struct SampleChunk {
    float m, s;     // raw logits: max, sum of exp(x - m)
    float sm, ss;   // scaled (x / temperature): max, sum of exp(sv - sm) (rows that check a draft)
    float g;        // the race's best key
    int am, gi;     // raw argmax, the race's winner (0x7fffffff: none)
    int pad_;
};

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_plain_chunks(const SampleParams p) {
    pdl_enter();
    __shared__ SampleSmem sm;
    __shared__ int s_last;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
    const int vocab = p.vocab, b0 = blockIdx.y * blockDim.x * SAMPLE_UNROLL;
    const i64 base = (i64)row * p.row_stride;
    const SampleRow rp = p.rows[row];
    const float temp = rp.temperature;
    const int draft = p.out_passed != nullptr && rp.draft < vocab ? rp.draft : -1;
    const u32 k0 = (u32)rp.seed, k1 = (u32)(rp.seed >> 32), c2 = (u32)rp.offset, c3 = (u32)(rp.offset >> 32);
    // the launcher's chunk (kernels.SAMPLE_CHUNK) must be this build's step, or tokens would go unread
    if ((i64)gridDim.y * blockDim.x * SAMPLE_UNROLL < vocab) __trap();

    float x[SAMPLE_UNROLL], sv[SAMPLE_UNROLL];
    bool keep[SAMPLE_UNROLL];
#pragma unroll
    for (int u = 0; u < SAMPLE_UNROLL; ++u) {
        const int i = b0 + u * blockDim.x + tid;
        x[u] = i < vocab ? load_x(p, base + i) : 0.f;
    }
    float m = VOLT_NEG_INF, s = 0.f, smx = VOLT_NEG_INF, ss = 0.f, best = VOLT_NEG_INF;
    int am = 0x7fffffff, unused = 0, best_i = 0x7fffffff;
#pragma unroll
    for (int u = 0; u < SAMPLE_UNROLL; ++u) {
        const int i = b0 + u * blockDim.x + tid;
        sv[u] = x[u] / (temp > 0.f ? temp : 1.f);
        keep[u] = temp > 0.f && i < vocab && i != draft;  // every token is kept; the race skips the draft
        if (i >= vocab) continue;
        online_ms(m, s, am, x[u], i);
        if (temp > 0.f && draft >= 0) online_ms(smx, ss, unused, sv[u], i);
    }
    race_step(sv, keep, b0, k0, k1, c2, c3, best, best_i);
    block_merge_ms(m, s, am, sm);
    block_merge_ms(smx, ss, unused, sm);
    block_argmax(best, best_i, sm);
    SampleChunk* part = reinterpret_cast<SampleChunk*>(p.part) + (i64)row * gridDim.y;
    if (tid == 0) {
        part[blockIdx.y] = SampleChunk{m, s, smx, ss, best, am, best_i, 0};
        __threadfence();
        const bool last = atomicAdd(p.counters + row, 1) == (int)gridDim.y - 1;
        __threadfence();  // acquire: the other blocks' partials before this block reads them
        s_last = last;
    }
    __syncthreads();
    if (!s_last || tid >= 32) return;
    __threadfence();
    // the chunks' partials, lane l taking chunks l, l + 32, ... (a fixed order: deterministic)
    m = VOLT_NEG_INF; s = 0.f; am = 0x7fffffff;
    smx = VOLT_NEG_INF; ss = 0.f; unused = 0;
    best = VOLT_NEG_INF; best_i = 0x7fffffff;
    for (int c = lane; c < (int)gridDim.y; c += 32) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(part + c));
        const int4 b = __ldcg(reinterpret_cast<const int4*>(part + c) + 1);
        merge_ms(m, s, am, a.x, a.y, b.y);
        merge_ms(smx, ss, unused, a.z, a.w, 0);
        const float g = __int_as_float(b.x);
        if (g > best || (g == best && b.z < best_i)) { best = g; best_i = b.z; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        merge_ms(m, s, am, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o),
                 __shfl_xor_sync(0xffffffffu, am, o));
        merge_ms(smx, ss, unused, __shfl_xor_sync(0xffffffffu, smx, o), __shfl_xor_sync(0xffffffffu, ss, o), 0);
        const float og = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (og > best || (og == best && oi < best_i)) { best = og; best_i = oi; }
    }
    const float log_z = m + logf(s);
    const int argmax = am == 0x7fffffff ? 0 : am;
    int token = argmax, passed = 0;
    if (temp > 0.f) {
        if (best_i != 0x7fffffff) token = best_i;
        if (draft >= 0) {
            // the kept set is every token: p(draft) = exp(s_d - s_max) / sum exp(sv - s_max), s_max = smx
            const float e_d = expf(load_x(p, base + draft) / temp - smx);
            u32 c[4] = {0u, 1u, c2, c3};
            philox4x32_10(c, k0, k1);
            const float u = ((float)(c[0] >> 9) + 0.5f) * 1.1920928955078125e-7f;
            passed = u * ss < e_d;
        }
    } else {
        passed = draft >= 0 && argmax == draft;
    }
    if (lane < SAMPLE_MAX_TOP) {
        const i64 o = (i64)row * SAMPLE_MAX_TOP + lane;
        p.out_top_ids[o] = -1;
        p.out_top_logprobs[o] = VOLT_NEG_INF;
    }
    if (lane == 0) {
        p.out_ids[row] = token;
        p.out_logprobs[row] = load_x(p, base + token) - log_z;
        if (p.out_passed != nullptr) p.out_passed[row] = passed;
        p.counters[row] = 0;  // ready for the next launch on this stream
    }
}

// Test kernel: Philox4x32-10 on num_rows (counter, key) sets. logits: u32 [num_rows, 6] (c0, c1, c2, c3, k0, k1);
// writes u32 [num_rows, 4] to out_top_ids. Grid: (ceil(num_rows / 128)); block 128.
extern "C" __global__ void philox4x32_10_test(const SampleParams p) {
    pdl_enter();
    const int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= p.num_rows) return;
    const u32* in = reinterpret_cast<const u32*>(p.logits) + (i64)r * 6;
    u32 c[4] = {in[0], in[1], in[2], in[3]};
    philox4x32_10(c, in[4], in[5]);
    u32* out = reinterpret_cast<u32*>(p.out_top_ids) + (i64)r * 4;
    for (int j = 0; j < 4; ++j) out[j] = c[j];
}
