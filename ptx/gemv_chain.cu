// gemv_chain.cu: several one-row fp16 decode GEMVs that feed each other (a decoder layer's o_proj -> gate_up ->
// down -> the next layer's qkv) in ONE persistent launch, their weights streamed through one shared-memory ring of
// bulk asynchronous copies (SM90+ cp.async.bulk, PTX ISA 8.0) that never drains between them.
//
// Why: each decode GEMV launch loses ~1.5-2 us to its boundary (the old grid drains, the new one becomes resident
// and refills its ring; docs/performance.md, session 14: one launch over 28,672 rows 58.1 us, the same bytes as
// two launches 62.2 us). Weights never depend on activations, so one producer warp per SM streams phase after
// phase back to back; only the consumers wait for the previous phase's outputs, at a device-side grid barrier,
// while the ring (16 x 8 KB, ~4 us of an SM's share of the copy bandwidth) keeps DRAM busy. Measured slower than
// the launches it replaces (docs/performance.md, session 15): the barrier alone costs what a launch boundary does.
//
// Layout per phase (gemv_tma.cu's): block b of G owns output rows [b n / G, (b + 1) n / G); its rows are one
// segment of contiguous bytes (silu_out: two, see below) cut into stages of p.stage_spans 2 KB spans. The stages of all phases are numbered in one
// sequence i; ring slot i % ring, consumer warp i % TMA_CONSUMERS (ring % TMA_CONSUMERS == 0: one consumer warp
// per slot, so the parity waits stay exact across phases). Products, span sums and the epilogue are gemv_tma's
// (tma_span_dots, fixed-order sums), so each phase's outputs equal a gemv_tma launch's bit for bit.
// Phase options: `res` (residual), norm_post (the RMSNorm folded into W: outputs scaled by 1 / rms(x)), silu_out
// (W a [gate; up] pair: each block owns both halves of its features, streams its gate rows then its up rows, and
// writes silu(gate) * up as gemv_tma's SILU build does). Staging down's x as silu(gate) * up in every block instead
// (gate_up as one segment) measured slower: 4-5 us of exponentials a block (docs/performance.md, session 15).
//
// Grid barrier: all G blocks must be resident at once (G <= SMs, one block per SM by its shared memory; under PDL
// the previous kernel's blocks always finish, and the next kernel cannot launch before every block of this one
// has passed pdl_enter). One growing counter (chain_barrier_base); a block that waits ~1 s traps instead of
// hanging the GPU.
// Reference: voltserve.backends.cpu.CpuBackend.linear / norm_linear / silu_and_mul, composed.
#include "common.cuh"
#include "tma_dots.cuh"

#define TMA_CONSUMERS 8  // warps that read the stages; one more issues the copies
#define TMA_THREADS ((TMA_CONSUMERS + 1) * 32)
#define CHAIN_MAX_PHASES 4
#define CHAIN_TRACE_EVENTS 8  // %globaltimer ns: phase begun, x staged, stages read, outputs stored, producer's
                              // first and last copy; clock64 at stages read and at outputs stored
#define CHAIN_X_BATCH 4  // x vectors a thread loads before it stores any (k <= 8,192: one round trip)
#define CHAIN_MAX_GRID 1024
#define CHAIN_BARRIER_QUANTUM ((CHAIN_MAX_PHASES - 1) * CHAIN_MAX_GRID)  // arrivals a launch adds
#define CHAIN_SPIN_LIMIT (1ll << 31)  // clock cycles a block waits at the grid barrier before it traps (~1 s)

struct ChainPhase {
    const half_t* x;    // [k] fp16
    const u8* w;        // [n, 2k bytes] fp16 rows (row stride 2k bytes)
    half_t* y;          // [n] fp16
    const half_t* res;  // [n] fp16 added to the product, or nullptr
    int n;
    int k;              // % TMA_SPAN_HALVES == 0
    int norm_post;
    int silu_out;       // W is a [gate; up] pair of n rows: y [n / 2] = silu(gate) * up (gemv_tma's SILU build)
};

struct ChainParams {
    ChainPhase phase[CHAIN_MAX_PHASES];
    u64* barrier;       // the grid barrier's arrival counter (chain_barrier_base), zero before the first launch
    u64* trace;         // nullptr, or [grid][CHAIN_MAX_PHASES][CHAIN_TRACE_EVENTS] (profiling, chain_trace)
    int num_phases;
    int stages;         // ring stages, a multiple of TMA_CONSUMERS, <= TMA_MAX_STAGES
    int stage_spans;    // 2 KB spans per stage, <= TMA_STAGE_SPANS
    int max_k;          // the largest phase k: x's smem, the partials after it
    float eps;
};
VOLT_CHECK_PARAMS(ChainParams, VOLT_CHAIN_PARAMS_BYTES);

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// Profiling (p.trace set by the launcher's caller): event `e` of phase `ph` of this block, globaltimer ns.
VOLT_DEVICE void chain_trace(const ChainParams& p, int ph, int e) {
    if (p.trace == nullptr) return;
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    u64* row = p.trace + ((i64)blockIdx.x * CHAIN_MAX_PHASES + ph) * CHAIN_TRACE_EVENTS;
    row[e] = t;
    if (e == 2 || e == 3) row[e + 4] = (u64)clock64();
}

// This block's share of a phase: its first output feature and feature count, and its weight rows as 1 (silu_out:
// 2, the gate rows then the matching up rows) segments of `bytes` each, `seg_stages` stages each.
struct ChainSeg {
    const u8* w0;       // segment 0 (segment 1: w1)
    const u8* w1;
    i64 bytes;
    int f0;
    int rows;
    int seg_stages;
    int stages;
};

VOLT_DEVICE ChainSeg chain_seg(const ChainPhase& ph, int stage_bytes) {
    ChainSeg s;
    const int n_out = ph.silu_out ? ph.n / 2 : ph.n;
    s.f0 = (int)((i64)blockIdx.x * n_out / gridDim.x);
    s.rows = (int)((i64)(blockIdx.x + 1) * n_out / gridDim.x) - s.f0;
    s.w0 = ph.w + (i64)s.f0 * ph.k * 2;
    s.w1 = ph.w + (i64)(n_out + s.f0) * ph.k * 2;
    s.bytes = (i64)s.rows * ph.k * 2;
    s.seg_stages = (int)((s.bytes + stage_bytes - 1) / stage_bytes);
    s.stages = s.seg_stages * (ph.silu_out ? 2 : 1);
    return s;
}

// The grid barrier: one 64-bit counter that only grows. Every launch adds CHAIN_BARRIER_QUANTUM arrivals, whatever
// its grid (a block arrives once per phase boundary, and at its end for the boundaries its chain lacks; block 0
// adds the rest), so a launch's first value is a multiple of it, which each block reads after pdl_enter (earlier
// launches have completed; fewer than G arrivals of this launch can precede the read: block 0's rest comes after
// every block's first arrival). Boundary b (1..) has passed once the counter reaches base + b G. One release-add
// per block and acquire polls: no reset, no generation word.
VOLT_DEVICE u64 chain_barrier_base(const u64* bar) {
    u64 c;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(bar) : "memory");
    return c - c % CHAIN_BARRIER_QUANTUM;
}

VOLT_DEVICE void chain_arrive(u64* bar, u64 n) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(bar), "l"(n) : "memory");
}

// Boundary `b` of the launch whose counter started at `base`: this block's consumers' outputs released, then
// every block's acquired.
VOLT_DEVICE void chain_grid_sync(u64* bar, u64 base, int b) {
    named_sync(1, TMA_CONSUMERS * 32);  // this block's epilogue stores are done
    if (threadIdx.x == 0) {
        chain_arrive(bar, 1);
        const u64 target = base + (u64)b * gridDim.x;
        const long long t0 = clock64();
        u64 c;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(c) : "l"(bar) : "memory");
            if (clock64() - t0 > CHAIN_SPIN_LIMIT) __trap();  // a block not resident: never hang the GPU
        } while (c < target);
    }
    named_sync(1, TMA_CONSUMERS * 32);
}
#endif

extern "C" __global__ void __launch_bounds__(TMA_THREADS, 1) gemv_chain(const ChainParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) u8 tma_smem[];  // [stages][stage bytes] ring, x (fp16 [max_k]), partials
    __shared__ unsigned long long full[TMA_MAX_STAGES], empty[TMA_MAX_STAGES];
    __shared__ float scratch[TMA_CONSUMERS];
    static_assert(sizeof(full) + sizeof(empty) + 4 * (TMA_CONSUMERS + 1) <= 1024, "static smem");
    __shared__ float inv_rms;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int ring = p.stages, stage_bytes = p.stage_spans * TMA_SPAN_BYTES;
    half_t* xh = reinterpret_cast<half_t*>(tma_smem + (i64)ring * stage_bytes);
    float* partial = reinterpret_cast<float*>(xh + p.max_k);  // the running phase's [rows][k / span] fp32

    if (ring <= 0 || ring % TMA_CONSUMERS || ring > TMA_MAX_STAGES || p.stage_spans <= 0 ||
        p.stage_spans > TMA_STAGE_SPANS || p.num_phases <= 0 || p.num_phases > CHAIN_MAX_PHASES ||
        gridDim.x > CHAIN_MAX_GRID)
        __trap();  // the launcher's contract (kernels_tma.gemv_chain_plan)
    ring_init(full, empty, ring, 1);
    __syncthreads();
    if (warp == TMA_CONSUMERS) {
        // producer (one lane): every phase's stages back to back, each slot again as soon as its warp read it;
        // weights only, so it never waits for the previous kernel or for a phase boundary
        if (lane == 0) {
            int i = 0;
            for (int ph = 0; ph < p.num_phases; ++ph) {
                const ChainSeg s = chain_seg(p.phase[ph], stage_bytes);
                chain_trace(p, ph, 4);
                for (int j = 0; j < s.stages; ++j, ++i) {
                    const int slot = i % ring;
                    if (i >= ring) mbar_wait(&empty[slot], (u32)(i / ring - 1) & 1u);
                    const int seg = j >= s.seg_stages;
                    const i64 off = (i64)(j - seg * s.seg_stages) * stage_bytes;
                    const u32 bytes = (u32)min((i64)stage_bytes, s.bytes - off);
                    mbar_expect_tx(&full[slot], bytes);
                    bulk_copy(tma_smem + slot * stage_bytes, (seg ? s.w1 : s.w0) + off, bytes, &full[slot]);
                }
                chain_trace(p, ph, 5);
            }
        }
        return;  // the consumers' barriers are named ones over their own warps
    }
    int base = 0;          // the phase's first stage in the block's sequence
    u64 bar_base = 0;      // the launch's first counter value: thread 0's only (it alone arrives and polls)
    for (int ph = 0; ph < p.num_phases; ++ph) {
        const ChainPhase& P = p.phase[ph];
        const ChainSeg s = chain_seg(P, stage_bytes);
        if (ph == 0) {
            pdl_enter();  // x (and the residual) only after the previous kernel
            if (threadIdx.x == 0) bar_base = chain_barrier_base(p.barrier);
        } else {
            chain_grid_sync(p.barrier, bar_base, ph);  // the previous phase's outputs, from every block
        }
        if (threadIdx.x == 0) chain_trace(p, ph, 0);
        // x -> smem, with norm_post its sum of squares in gemv_tma's order; CHAIN_X_BATCH loads in flight at once
        float ss = 0.f;
        for (int j0 = threadIdx.x * 8; j0 < P.k; j0 += CHAIN_X_BATCH * TMA_CONSUMERS * 32 * 8) {
            uint4 v[CHAIN_X_BATCH];
#pragma unroll
            for (int q = 0; q < CHAIN_X_BATCH; ++q) {
                const int j = j0 + q * TMA_CONSUMERS * 32 * 8;
                if (j < P.k) v[q] = *reinterpret_cast<const uint4*>(P.x + j);
            }
#pragma unroll
            for (int q = 0; q < CHAIN_X_BATCH; ++q) {
                const int j = j0 + q * TMA_CONSUMERS * 32 * 8;
                if (j >= P.k) break;
                *reinterpret_cast<uint4*>(xh + j) = v[q];
                if (P.norm_post) {
                    float f[8];
                    unpack8(v[q], f);
#pragma unroll
                    for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
                }
            }
        }
        if (P.norm_post) {
            ss = warp_sum(ss);
            if (lane == 0) scratch[warp] = ss;
        }
        named_sync(1, TMA_CONSUMERS * 32);
        if (threadIdx.x == 0) chain_trace(p, ph, 1);
        if (P.norm_post && threadIdx.x == 0) {  // read by the epilogue, after the stage loop's barrier
            float t = 0.f;
            for (int w = 0; w < TMA_CONSUMERS; ++w) t += scratch[w];
            inv_rms = rsqrtf(t / (float)P.k + p.eps);
        }
        const int spans = P.k / TMA_SPAN_HALVES;
        for (int i = base + (warp - base % TMA_CONSUMERS + TMA_CONSUMERS) % TMA_CONSUMERS; i < base + s.stages;
             i += TMA_CONSUMERS) {
            const int slot = i % ring;
            const int seg = i - base >= s.seg_stages;
            const i64 off = (i64)(i - base - seg * s.seg_stages) * stage_bytes;
            const int num_sp = (int)(min((i64)stage_bytes, s.bytes - off) / TMA_SPAN_BYTES);
            mbar_wait(&full[slot], (u32)(i / ring) & 1u);
            tma_read_stage(tma_smem + slot * stage_bytes, &empty[slot], num_sp, off, spans, xh, partial,
                           seg * s.rows);
        }
        named_sync(1, TMA_CONSUMERS * 32);  // every partial of the phase is in smem
        if (threadIdx.x == 0) chain_trace(p, ph, 2);
        for (int f = threadIdx.x; f < s.rows; f += TMA_CONSUMERS * 32) {
            float v = 0.f;
            for (int sp = 0; sp < spans; ++sp) v += partial[f * spans + sp];
            if (P.norm_post) v *= inv_rms;
            if (P.silu_out) {  // gemv_tma's SILU epilogue, the same roundings
                float u = 0.f;
                for (int sp = 0; sp < spans; ++sp) u += partial[(s.rows + f) * spans + sp];
                if (P.norm_post) u *= inv_rms;
                const float g = round_h(v);
                v = g / (1.f + __expf(-g)) * round_h(u);
            }
            const int feat = s.f0 + f;
            if (P.res != nullptr) v = round_h(v) + h2f(P.res[feat]);
            P.y[feat] = f2h(v);
        }
        if (p.trace != nullptr) {
            named_sync(1, TMA_CONSUMERS * 32);
            if (threadIdx.x == 0) chain_trace(p, ph, 3);
        }
        base += s.stages;
    }
    if (threadIdx.x == 0) {  // every launch adds CHAIN_BARRIER_QUANTUM arrivals
        u64 rest = (u64)(CHAIN_MAX_PHASES - p.num_phases);
        if (blockIdx.x == 0) rest += CHAIN_BARRIER_QUANTUM - (u64)(CHAIN_MAX_PHASES - 1) * gridDim.x;
        if (rest) chain_arrive(p.barrier, rest);
    }
#else
    pdl_enter();
    __trap();  // no bulk copies below SM90: the launcher never takes this build there
#endif
}
