// sample_chunks.cu: sample_topk_topp's tokens (and draft checks) for rows without top-k and logprobs, each row
// over one or more blocks, in fewer passes. One block a row on all six of its passes bounded the single-block
// kernel (H100: ~50 us for a 49,152-token row, ~104 us at top-p 0.95).
//
// Grid (num_rows, C), block SAMPLE_THREADS: block (r, c) takes steps c, c + C, ... of SAMPLE_STEP tokens of row r
// (sample_topk_topp's b0 steps: the same loads a thread and the same Philox words, so the same race and the same
// token for the same (seed, offset)). A plain row is one pass: the online max / sum and the race together. With
// C > 1 each block writes its partials (SampleChunk) and the row's last block to arrive (an arrival counter)
// merges them in a fixed order; it writes the row's outputs as sample_topk_topp does (top entries -1 / -inf).
// log_z and a draft check's sum are summed in another order than there (last-bit differences).
//
// Rows with top-p or min-p (sampled rows only) need the row's max first, and top-p its threshold; with C > 1 their
// blocks meet at barriers on the row's counter (spinning: the launcher keeps every block of such a launch
// resident, at most one block an SM, DeviceSampling._sample_chunks; that assumes no other process's kernels
// hold SMs, as under MPS):
//   1. each block's raw max; barrier; every block takes the row's max (s_max = max / temperature, exact).
//   2. top-p: each block adds its tokens' fixed-point weights (sample_topk_topp's round(exp(s - s_max) * 2^40),
//      min-p's rejects left out) to a histogram over SAMPLE_BINS bins of (s_max - s) * SAMPLE_BIN_SCALE (bin 0 the
//      largest values; a non-increasing function of s, so a lower bin holds only larger values), in shared memory,
//      then (C > 1) into the row's u64 histogram in global memory (exact integer sums); barrier; every block finds
//      the crossing bin B with W(bins < B) < top_p * W(all) <= W(bins <= B) (u64 sums compared as doubles, as
//      radix_select does).
//   3. each block races its tokens of bins < B (kept for certain) and lists those of bin B (candidates: in shared
//      memory when C = 1).
//   4. the last block radix-selects sample_topk_topp's threshold among the candidates, starting from W(bins < B)
//      (the whole row again when more than SAMPLE_CANDIDATES are listed: rare, exact), and races the kept ones on
//      their own Philox words (race_key). The threshold is sample_topk_topp's (the same sums, the same
//      comparisons), so the kept set and the token are the same.
// Then (C > 1) it zeroes the row's counter and histogram for the next launch on this stream.
// Passes over a row: 1 plain, 2 min-p, 3 top-p (sample_topk_topp: 2 / 2 / 6). Static smem ~27 KiB (SampleSmem,
// the SAMPLE_BINS histogram as u32 pairs, the candidate list). Compile-time: LOGITS_F16.
#include "sample_common.cuh"

#define SAMPLE_STEP (SAMPLE_THREADS * SAMPLE_UNROLL)  // tokens a block step (kernels.SAMPLE_CHUNK)
#define SAMPLE_BINS (2 * SAMPLE_THREADS)  // find_crossing: two bins a thread
#define SAMPLE_BIN_SCALE 64.f             // 2,048 bins span s_max - s < 32 > ln(2^41): every nonzero weight
#define SAMPLE_SPIN_LIMIT (1ll << 31)    // clock cycles a block waits at a row barrier before it traps (~1 s)
#ifndef SAMPLE_CANDIDATES
#define SAMPLE_CANDIDATES 2048  // the crossing bin's tokens a row lists (kernels.SAMPLE_CANDIDATES)
#endif

struct SampleChunk {
    float m, s;     // raw logits: max, sum of exp(x - m)
    float sm, ss;   // rows without filters: the scaled logits' max and sum of exp(sv - sm) (rows with a draft);
                    // filtered rows: ss = the sum of exp(sv - s_max) over this block's tokens kept for certain
    float g;        // the race's best key
    int am, gi;     // raw argmax, the race's winner (0x7fffffff: none)
    int pad_;
};

// top-p's fixed-point weight of e = exp(s - s_max) (sample_topk_topp's)
VOLT_DEVICE u64 topp_weight(float e) { return __float2ull_rn(e * 1099511627776.0f); }

// the histogram bin of a token of nonzero weight
VOLT_DEVICE int topp_bin(float sv, float s_max) {
    return min(SAMPLE_BINS - 1, __float2int_rz((s_max - sv) * SAMPLE_BIN_SCALE));
}

// The block arrives at the row's counter and waits for `target` arrivals (the launcher keeps all the row's blocks
// resident; a block that waits ~1 s traps instead of hanging the GPU). The release publishes this block's partial
// stores and histogram atomics (ordered before it by the barrier), the acquire the other blocks'.
VOLT_DEVICE void row_barrier(int* counter, int target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        arrive_acq_rel(counter);
        const long long t0 = clock64();
        int c;
        do {
            asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(c) : "l"(counter) : "memory");
            if (clock64() - t0 > SAMPLE_SPIN_LIMIT) __trap();
        } while (c < target);
    }
    __syncthreads();
}

// The crossing bin of a row's histogram, this thread holding bins 2 tid (h0) and 2 tid + 1 (h1): b with
// W(bins < b) < tgt <= W(bins <= b), tgt = frac * W(all); *above = W(bins < b), *tgt_out = tgt. Every thread of
// the block calls it and gets the result.
VOLT_DEVICE int find_crossing(u64 h0, u64 h1, double frac, SampleSmem& sm, u64* above, double* tgt_out) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
    if (tid == 0) {  // no crossing when the row has no weight (NaN or all -inf logits): a defined bin all the same
        sm.bin = SAMPLE_BINS - 1;
        sm.above = 0ull;
    }
    u64 incl = h0 + h1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    if (lane == 31) sm.w64[warp] = incl;
    __syncthreads();
    u64 before = 0, total = 0;
    for (int w = 0; w < nw; ++w) {
        const u64 v = sm.w64[w];
        if (w < warp) before += v;
        total += v;
    }
    const u64 excl = before + incl - h0 - h1;
    const double tgt = frac * (double)total;
    if ((double)excl < tgt && (double)(excl + h0) >= tgt) {
        sm.bin = 2 * tid;
        sm.above = excl;
    } else if ((double)(excl + h0) < tgt && (double)(excl + h0 + h1) >= tgt) {
        sm.bin = 2 * tid + 1;
        sm.above = excl + h0;
    }
    __syncthreads();
    *above = sm.above;
    *tgt_out = tgt;
    const int b = sm.bin;
    __syncthreads();
    return b;
}

// x[u] = the row's token b0 + u * SAMPLE_THREADS + tid (0 past the vocabulary), SAMPLE_UNROLL loads issued together
VOLT_DEVICE void load_step(const SampleParams& p, i64 base, int vocab, int b0, float* x) {
#pragma unroll
    for (int u = 0; u < SAMPLE_UNROLL; ++u) {
        const int i = b0 + u * SAMPLE_THREADS + threadIdx.x;
        x[u] = i < vocab ? load_x(p, base + i) : 0.f;
    }
}

// radix_select's `each` over a row's listed candidates cands[0..n) (token indices)
struct ListedElements {
    const SampleParams& p;
    i64 base;
    const int* cands;
    int n;
    template <class Body>
    VOLT_DEVICE void operator()(const Body& body) const {
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int i = cands[j];
            body(i, load_x(p, base + i));
        }
    }
};

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_chunks(const SampleParams p) {
    pdl_enter();
    __shared__ SampleSmem sm;
    __shared__ u32 bin_lo[SAMPLE_BINS], bin_hi[SAMPLE_BINS];
    __shared__ int s_cands[SAMPLE_CANDIDATES];
    __shared__ u64 s_listed;
    __shared__ int s_last;
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid & 31, C = gridDim.y;
    const int vocab = p.vocab, first = blockIdx.y * SAMPLE_STEP, stride = C * SAMPLE_STEP;
    const i64 base = (i64)row * p.row_stride;
    const SampleRow rp = p.rows[row];
    const float temp = rp.temperature, min_p = rp.min_p;
    const int draft = p.out_passed != nullptr && rp.draft < vocab ? rp.draft : -1;
    const u32 k0 = (u32)rp.seed, k1 = (u32)(rp.seed >> 32), c2 = (u32)rp.offset, c3 = (u32)(rp.offset >> 32);
    // filters apply to sampled rows only (a greedy row is the argmax)
    const bool use_p = temp > 0.f && rp.top_p < 1.f, use_minp = temp > 0.f && min_p > 0.f;
    const int barriers = use_p ? 2 : use_minp ? 1 : 0;
    // C > 1 only: the row's arrival counter, its histogram (then the candidate count), its partials and list
    int* counter = C > 1 ? p.counters + row : nullptr;
    u64* hist = C > 1 && p.hist != nullptr ? p.hist + (i64)row * (SAMPLE_BINS + 1) : nullptr;
    SampleChunk* part = C > 1 ? reinterpret_cast<SampleChunk*>(p.part) + (i64)row * C : nullptr;
    int* cands = C > 1 ? reinterpret_cast<int*>(reinterpret_cast<SampleChunk*>(p.part) + (i64)p.num_rows * C) +
                             (i64)row * SAMPLE_CANDIDATES
                       : s_cands;
    u64* listed_count = C > 1 ? hist + SAMPLE_BINS : &s_listed;
    if (tid == 0) s_listed = 0ull;

    float x[SAMPLE_UNROLL], sv[SAMPLE_UNROLL];
    bool keep[SAMPLE_UNROLL];
    float m = VOLT_NEG_INF, s = 0.f, smx = VOLT_NEG_INF, ss = 0.f, best = VOLT_NEG_INF, s_max = 0.f;
    int am = 0x7fffffff, unused = 0, best_i = 0x7fffffff, cross = SAMPLE_BINS;
    u64 above = 0ull;
    double tgt = 0.0;
    // the raw logits' max / sum / argmax; a row without filters samples in the same pass
    for (int b0 = first; b0 < vocab; b0 += stride) {
        load_step(p, base, vocab, b0, x);
#pragma unroll
        for (int u = 0; u < SAMPLE_UNROLL; ++u) {
            const int i = b0 + u * SAMPLE_THREADS + tid;
            if (i < vocab) online_ms(m, s, am, x[u], i);
        }
        if (barriers == 0) {
#pragma unroll
            for (int u = 0; u < SAMPLE_UNROLL; ++u) {
                const int i = b0 + u * SAMPLE_THREADS + tid;
                sv[u] = x[u] / (temp > 0.f ? temp : 1.f);
                keep[u] = temp > 0.f && i < vocab && i != draft;  // every token is kept; the race skips the draft
                if (i < vocab && temp > 0.f && draft >= 0) online_ms(smx, ss, unused, sv[u], i);
            }
            race_step(sv, keep, b0, k0, k1, c2, c3, best, best_i);
        }
    }
    block_merge_ms(m, s, am, sm);
    if (barriers == 0) {
        block_merge_ms(smx, ss, unused, sm);
    } else {
        // 1. the row's max
        float x_max = m;
        if (C > 1) {
            if (tid == 0) part[blockIdx.y].m = m;
            row_barrier(counter, C);
            x_max = VOLT_NEG_INF;
            for (int c = 0; c < C; ++c) x_max = fmaxf(x_max, __ldcg(&part[c].m));
        }
        s_max = x_max / temp;
        // 2. top-p's crossing bin
        if (use_p) {
            for (int b = tid; b < SAMPLE_BINS; b += blockDim.x) { bin_lo[b] = 0u; bin_hi[b] = 0u; }
            __syncthreads();
            for (int b0 = first; b0 < vocab; b0 += stride) {
                load_step(p, base, vocab, b0, x);
#pragma unroll
                for (int u = 0; u < SAMPLE_UNROLL; ++u) {
                    const int i = b0 + u * SAMPLE_THREADS + tid;
                    const float svu = x[u] / temp, e = expf(svu - s_max);
                    const u64 w = i < vocab && (!use_minp || e >= min_p) ? topp_weight(e) : 0ull;
                    if (w) pair_add(bin_lo, bin_hi, topp_bin(svu, s_max), w);
                }
            }
            __syncthreads();
            u64 h0 = pair_get(bin_lo, bin_hi, 2 * tid), h1 = pair_get(bin_lo, bin_hi, 2 * tid + 1);
            if (C > 1) {
                if (h0) atomicAdd(hist + 2 * tid, h0);
                if (h1) atomicAdd(hist + 2 * tid + 1, h1);
                row_barrier(counter, 2 * C);
                h0 = __ldcg(hist + 2 * tid);
                h1 = __ldcg(hist + 2 * tid + 1);
            }
            cross = find_crossing(h0, h1, (double)rp.top_p, sm, &above, &tgt);
        }
        // 3. tokens kept for certain race; the crossing bin's are listed; ss: a draft check's kept sum
        for (int b0 = first; b0 < vocab; b0 += stride) {
            load_step(p, base, vocab, b0, x);
#pragma unroll
            for (int u = 0; u < SAMPLE_UNROLL; ++u) {
                const int i = b0 + u * SAMPLE_THREADS + tid;
                sv[u] = x[u] / temp;
                const float e = expf(sv[u] - s_max);
                bool sure = false;
                if (i < vocab && (!use_minp || e >= min_p)) {
                    const int b = !use_p ? -1 : topp_weight(e) ? topp_bin(sv[u], s_max) : SAMPLE_BINS;
                    sure = b < cross;
                    if (b == cross) {
                        const u64 pos = atomicAdd(listed_count, 1ull);
                        if (pos < SAMPLE_CANDIDATES) cands[pos] = i;
                    }
                    if (sure && draft >= 0) ss += e;
                }
                keep[u] = sure && i != draft;
            }
            race_step(sv, keep, b0, k0, k1, c2, c3, best, best_i);
        }
        ss = block_sum(ss, sm);
    }
    block_argmax(best, best_i, sm);

    if (C > 1) {
        if (tid == 0) part[blockIdx.y] = SampleChunk{m, s, smx, ss, best, am, best_i, 0};
        __syncthreads();  // every thread's candidates and the partials, released by the arrival
        if (tid == 0) s_last = arrive_acq_rel(counter) == (barriers + 1) * C - 1;
        __syncthreads();
        if (!s_last) return;
        // the blocks' partials, lane l of warp 0 taking blocks l, l + 32, ... (a fixed order: deterministic)
        if (tid < 32) {
            m = VOLT_NEG_INF; s = 0.f; am = 0x7fffffff;
            smx = VOLT_NEG_INF; ss = 0.f; unused = 0;
            best = VOLT_NEG_INF; best_i = 0x7fffffff;
            for (int c = lane; c < C; c += 32) {
                const float4 a = __ldcg(reinterpret_cast<const float4*>(part + c));
                const int4 b = __ldcg(reinterpret_cast<const int4*>(part + c) + 1);
                merge_ms(m, s, am, a.x, a.y, b.y);
                if (barriers) ss += a.w;
                else merge_ms(smx, ss, unused, a.z, a.w, 0);
                const float g = __int_as_float(b.x);
                keep_max(best, best_i, g, b.z);
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                merge_ms(m, s, am, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o),
                         __shfl_xor_sync(0xffffffffu, am, o));
                if (barriers) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                else merge_ms(smx, ss, unused, __shfl_xor_sync(0xffffffffu, smx, o),
                              __shfl_xor_sync(0xffffffffu, ss, o), 0);
                const float og = __shfl_xor_sync(0xffffffffu, best, o);
                const int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
                keep_max(best, best_i, og, oi);
            }
            if (tid == 0) {
                sm.f[0] = m; sm.f[1] = s; sm.f[2] = smx; sm.f[3] = ss; sm.f[4] = best;
                sm.i[0] = am; sm.i[1] = best_i;
            }
        }
        __syncthreads();
        m = sm.f[0]; s = sm.f[1]; smx = sm.f[2]; ss = sm.f[3]; best = sm.f[4];
        am = sm.i[0]; best_i = sm.i[1];
        __syncthreads();
    }

    // 4. top-p's threshold among the crossing bin's tokens, and their race
    u32 p_key = 0u;
    if (use_p) {
        const u64 listed = C > 1 ? __ldcg(listed_count) : s_listed;
        const int n = (int)min(listed, (u64)SAMPLE_CANDIDATES);
        auto in_cross = [&](float xv, u32& key, u64& w, u32 mask, u32 prefix) {
            const float svx = xv / temp;
            key = fkey(svx);
            if ((key & mask) != prefix) return false;
            const float e = expf(svx - s_max);
            if (use_minp && !(e >= min_p)) return false;
            w = topp_weight(e);
            return w != 0ull && topp_bin(svx, s_max) == cross;
        };
        const ListedElements each_listed{p, base, cands, n};
        float cb = VOLT_NEG_INF, cs = 0.f;
        int ci = 0x7fffffff;
        auto race_kept = [&](int i, float xv) {
            u32 key = 0u;
            u64 w = 0ull;
            if (i < 0 || !in_cross(xv, key, w, 0u, 0u) || key < p_key) return;
            const float svx = xv / temp;
            if (draft >= 0) cs += expf(svx - s_max);
            if (i == draft) return;
            const float g = race_key(i, svx, k0, k1, c2, c3);
            keep_max(cb, ci, g, i);
        };
        u64 unused_above;
        if (listed <= SAMPLE_CANDIDATES) {
            p_key = radix_select(each_listed, in_cross, tgt, 0.0, sm, above, &unused_above);
            each_listed(race_kept);
        } else {  // too many to list: the whole row again, in_cross picking the crossing bin's tokens
            const RowElements all{p, base, vocab};
            p_key = radix_select(all, in_cross, tgt, 0.0, sm, above, &unused_above);
            all(race_kept);
        }
        block_argmax(cb, ci, sm);
        cs = block_sum(cs, sm);
        keep_max(best, best_i, cb, ci);
        ss += cs;
        if (C > 1)
            for (int b = tid; b <= SAMPLE_BINS; b += blockDim.x) hist[b] = 0ull;  // ready for the next launch
    }

    const float log_z = m + logf(s);
    const int argmax = am == 0x7fffffff ? 0 : am;
    int token = argmax, passed = 0;
    if (temp > 0.f) {
        if (best_i != 0x7fffffff) token = best_i;
        if (draft >= 0) {
            // p(draft) under the kept set: e_d / the kept sum (without filters every token is kept, s_max = smx)
            const float sd = load_x(p, base + draft) / temp;
            float e_d = expf(sd - (barriers ? s_max : smx));
            if (barriers && (fkey(sd) < p_key || (use_minp && !(e_d >= min_p)))) e_d = 0.f;
            passed = draft_passes(e_d, ss, k0, k1, c2, c3);
        }
    } else {
        passed = draft >= 0 && argmax == draft;
    }
    if (tid < SAMPLE_MAX_TOP) {
        const i64 o = (i64)row * SAMPLE_MAX_TOP + tid;
        p.out_top_ids[o] = -1;
        p.out_top_logprobs[o] = VOLT_NEG_INF;
    }
    if (tid == 0) {
        p.out_ids[row] = token;
        p.out_logprobs[row] = load_x(p, base + token) - log_z;
        if (p.out_passed != nullptr) p.out_passed[row] = passed;
        if (C > 1) *counter = 0;  // ready for the next launch on this stream
    }
}
