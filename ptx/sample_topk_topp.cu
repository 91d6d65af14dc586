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
//      with 32-bit atomics), then warp 0 scans the bins from the top to find the bin where the cumulative weight
//      crosses the target (the running sums exact in u64, each compared with the target as a double: the same
//      comparisons sample_chunks.cu makes). Weight 1 gives the k-th largest value
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
// thread); static smem ~2.9 KiB (256 x 2 x u32 histogram + reduction scratch). Up to 1 + 4 + 4 + 4 + 1 + 1
// passes over the row for a row with top-k, top-p and logprobs; passes are skipped when a feature is off.
// Compile-time: LOGITS_F16 (1: fp16 logits, 0: fp32). SM70 path: the only path (fp32 math, u32 shared atomics,
// no sm_80+ intrinsics). Vocab must be < 2^23 (fixed-point headroom of the top-p weights).
// sample_chunks.cu runs rows without top-k and logprobs over many blocks, with the same tokens.
// Also here: philox4x32_10_test, a test kernel exposing the generator for known-answer tests.
// Reference: voltserve.sampling.sample / torch.log_softmax / torch.topk on the CPU logits.
#include "sample_common.cuh"

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
        u64 n_greater;
        const u32 kth = radix_select(
            RowElements{p, base, vocab},
            [&](float x, u32& key, u64& w, u32 mask, u32 prefix) {
                key = fkey(x);
                w = 1ull;
                return (key & mask) == prefix;
            },
            (double)n_top, 0.0, sm, 0ull, &n_greater);
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
        u64 unused;
        if (use_k)
            k_key = radix_select(
                RowElements{p, base, vocab},
                [&](float x, u32& key, u64& w, u32 mask, u32 prefix) {
                    key = fkey(x / temp);
                    w = 1ull;
                    return (key & mask) == prefix;
                },
                (double)rp.top_k, 0.0, sm, 0ull, &unused);
        // kept by top-k and min-p (e = exp(s - s_max) in (0, 1] >= min_p)
        auto kept1 = [&](float sv, u32 key) { return key >= k_key && (!use_minp || expf(sv - s_max) >= min_p); };
        u32 p_key = 0u;
        if (use_p)
            p_key = radix_select(
                RowElements{p, base, vocab},
                [&](float x, u32& key, u64& w, u32 mask, u32 prefix) {
                    const float sv = x / temp;
                    key = fkey(sv);
                    if ((key & mask) != prefix || !kept1(sv, key)) return false;
                    w = __float2ull_rn(expf(sv - s_max) * 1099511627776.0f);  // 2^40 fixed point
                    return true;
                },
                0.0, (double)rp.top_p, sm, 0ull, &unused);
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
            passed = draft_passes(e_d, kept_sum, k0, k1, c2, c3);
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
