// gemv_tma_s8.cu: the one-row decode GEMV on repacked Q4_0 / Q4_1 / Q8_0 rows (backends/cuda/repack.py) that
// streams its weights through a shared-memory ring filled by bulk asynchronous copies (SM90+, tma.cuh), with the
// products on int8 tensor cores: y[n] = x . W[n]^T (+ residual).
//
// Status: correct and tested, but slower than gemv_s8 / gemv_s8w on every 8B shape measured (H200: 0.30-0.53 of
// the copy bandwidth against their 0.39-0.75; docs/performance.md session 11), so the launcher takes it only
// under VOLTSERVE_GEMV_TMA_S8=on. What was learnt: stages of several small copies (a row piece's scales and
// quants, 2-4 copies of 0.1-2 KB) streamed at ~0.4 us per stage whatever their size, hence one large copy of
// whole rows per stage here; with ~38 instructions per 1,024 weights in the main loop, 24 consumer warps (which
// spill a few bytes at their 72-register bound) run within ~10% of 16, and 8 up to 27% slower: the consumers'
// instructions no longer bound it much; the ring's refill or the copies' rate may (not measured yet).
//
// Why it was tried: gemv_s8 / gemv_s8w load their weights with per-thread loads, so the bytes in flight depend on
// the warps resident, and at k = 4,096 they stall on load latency. As in gemv_tma.cu (fp16), one block per SM owns
// a contiguous run of weight rows and a producer warp keeps p.stages ring slots of copies in flight, the first of
// them issued before pdl_enter.
//
// Ring: a stage is p.stage_spans whole weight rows (an even count: the MMAs take rows in pairs), one bulk copy
// (a block's rows are contiguous bytes) on one `full` mbarrier. All TS8_CONSUMERS warps read every stage, each
// taking work items (a row pair x `per` chunks of 8 load groups), and each arrives on the stage's `empty`
// mbarrier when done; the producer refills a slot after all of them. x is quantized per 32 elements as
// llama.cpp's Q8_1 by the consumer warps of every block (gemv_s8.cuh, its S8_M1 layout) while the first stages
// land.
// Products: per 512-byte chunk of a row (8 load groups of 64 bytes, one 16-byte slot piece a lane) RP_GROUP
// mma.m16n8k32 (Q4 u8 x s8, Q8_0 s8 x s8; PTX ISA "Matrix fragments for mma.m16n8k32"): lane (g = lane / 4,
// t = lane % 4) holds slot t of load group g's blocks of both rows and gives block u's quant words as A rows g
// (first row) and g + 8 (second row) (Q4: low nibbles at k 4t.., high at 16 + 4t..; Q8_0: quant bytes 8t..8t+3,
// 8t+4..8t+7) and x's words of the same elements as B column g, so D[g][g] and D[g + 8][g] are block u's exact
// int32 sums of the two rows, held by the lane with t = g / 2 (accumulators g & 1 and 2 + (g & 1)); the other
// sums pair mismatched blocks and are not used. Shuffles hand block u's two sums to lane t = u of the quad,
// which scales them by the blocks' (d_w, m_w) and x's (d, s) (gemv_s8.cuh s8_add_block): each block once, in
// its own lane. One warp sum per item and row -> partial[row][part]
// in smem; the epilogue adds a row's parts in order: fixed-order sums, so an output depends on the rows per stage
// (which set the parts) but not on the ring's depth or the grid.
// Compile-time: WTYPE (a quant format; WREPACK = 1). Runtime: p.stages (1..TS8_MAX_STAGES), p.stage_spans (rows
// per stage, even), p.m == 1, no fused norm (the launcher routes those elsewhere); the dynamic smem is the ring, x
// and the partials (kernels_tma.gemv_tma_s8_plan).
// Below SM90 the kernel is a trapping stub; the launcher routes SM90+ only.
// Reference: voltserve.backends.cpu.CpuBackend.linear (fp32, unquantized x); tests/kernels/kutils.s8_reference.
#ifndef WREPACK
#define WREPACK 1
#endif
#define S8_M1 1
#include "gemv_s8.cuh"
#include "mma.cuh"
#include "tma.cuh"

#ifndef TS8_CONSUMERS
#define TS8_CONSUMERS 16                 // warps that read the stages; one more warp issues the copies
#endif
#define TS8_ROWS 2                       // weight rows per MMA and work item: A rows g and g + 8
#define TS8_THREADS ((TS8_CONSUMERS + 1) * 32)  // the launcher: 32 (kernels_tma.gemv_tma_s8_spec consumers + 1)
#define TS8_MAX_STAGES 8
#define TS8_CHUNK_GROUPS 8               // load groups per chunk: one 16-byte slot piece per lane
#define TS8_GROUP_SCALE_BYTES (RP_GROUP * RP_SCALE_BYTES)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && WREPACK && WTYPE != WTYPE_F16
// d_w and m_w (Q4_1; else 0) of the block whose scale word(s) start at `w` (repacked rows: one u32 d | m << 16
// for Q4_1, one fp16 d otherwise).
VOLT_DEVICE float2 ts8_block_scales(const u8* w) {
#if WTYPE == WTYPE_Q4_1
    const u32 dm = *reinterpret_cast<const u32*>(w);
    return make_float2(half_of(dm, 0), half_of(dm, 1));
#else
    return make_float2(h2f(*reinterpret_cast<const half_t*>(w)), 0.f);
#endif
}

// This lane's share of the dot products of x with one work item: `chunks` chunks (x 8 load groups, the first load
// group j0 of the row) of TS8_ROWS weight rows, row r's scales / quants at sc[r] / q[r] in smem; xq / xs x's int8
// copy. The MMAs leave block u's two sums in the quad's diagonal lane (t = g / 2); shuffles hand them to lane
// t = u of the quad, which scales them (each block once, by its own lane; Q8_0: lanes t < 2).
VOLT_DEVICE float2 ts8_piece_dot(const u8* const (&sc)[TS8_ROWS], const u8* const (&q)[TS8_ROWS], int chunks,
                                 int j0, const u8* xq, const float2* xs) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool odd = g & 1;
    const int diag = (lane & ~3) | (g >> 1);  // the quad's lane holding D[g][g] and D[g + 8][g]
    float acc0 = 0.f, acc1 = 0.f;
#pragma unroll 2
    for (int c = 0; c < chunks; ++c) {
        const int gl = c * TS8_CHUNK_GROUPS + g, j = j0 + gl;  // load group in the piece / in the row
        const uint4 w0 = *reinterpret_cast<const uint4*>(q[0] + c * 512 + lane * 16);
        const uint4 w1 = *reinterpret_cast<const uint4*>(q[1] + c * 512 + lane * 16);
        // x's words of slot t of the group's blocks: [block u][2 words] (gemv_s8.cuh s8_quantize_quarter)
        const uint4* xv = reinterpret_cast<const uint4*>(xq + j * (32 * RP_GROUP) + t * (8 * RP_GROUP));
        u32 xw[2 * RP_GROUP];
#pragma unroll
        for (int i = 0; i < RP_GROUP / 2; ++i) {
            const uint4 v = xv[i];
            xw[4 * i] = v.x; xw[4 * i + 1] = v.y; xw[4 * i + 2] = v.z; xw[4 * i + 3] = v.w;
        }
        // this lane's block of the group (u = t) and its scales, loaded while the MMAs run
        const int ub = min(t, RP_GROUP - 1);
        const float2 x2 = xs[j * RP_GROUP + ub];
        const float2 dm0 = ts8_block_scales(sc[0] + (gl * RP_GROUP + ub) * RP_SCALE_BYTES);
        const float2 dm1 = ts8_block_scales(sc[1] + (gl * RP_GROUP + ub) * RP_SCALE_BYTES);
        const u32 wa[4] = {w0.x, w0.y, w0.z, w0.w}, wb[4] = {w1.x, w1.y, w1.z, w1.w};
        int mine0 = 0, mine1 = 0;
#pragma unroll
        for (int u = 0; u < RP_GROUP; ++u) {
            // A rows g (the item's first row) and g + 8 (its second) of block u, B column g = x of block u
#if WTYPE == WTYPE_Q8_0
            const u32 a[4] = {wa[2 * u], wb[2 * u], wa[2 * u + 1], wb[2 * u + 1]};
#else
            const u32 a[4] = {wa[u] & 0x0F0F0F0Fu, wb[u] & 0x0F0F0F0Fu, (wa[u] >> 4) & 0x0F0F0F0Fu,
                              (wb[u] >> 4) & 0x0F0F0F0Fu};
#endif
            int ci[4] = {0, 0, 0, 0};
            mma_m16n8k32_i8<WTYPE != WTYPE_Q8_0>(ci, a, xw[2 * u], xw[2 * u + 1]);
            const int s0 = __shfl_sync(0xffffffffu, odd ? ci[1] : ci[0], diag);  // D[g][g]
            const int s1 = __shfl_sync(0xffffffffu, odd ? ci[3] : ci[2], diag);  // D[g + 8][g]
            if (t == u) {
                mine0 = s0;
                mine1 = s1;
            }
        }
        if (t < RP_GROUP) {
            acc0 = s8_add_block(acc0, dm0.x, dm0.y, x2.x, x2.y, mine0);
            acc1 = s8_add_block(acc1, dm1.x, dm1.y, x2.x, x2.y, mine1);
        }
    }
    return make_float2(acc0, acc1);
}
#endif

extern "C" __global__ void __launch_bounds__(TS8_THREADS, 1) gemv_tma_s8(const GemvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && WREPACK && WTYPE != WTYPE_F16
    extern __shared__ __align__(128) u8 ts8_smem[];  // [stages][stage rows] ring, xq, xs, the partials
    __shared__ unsigned long long full[TS8_MAX_STAGES], empty[TS8_MAX_STAGES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int f0 = (int)((i64)blockIdx.x * p.n / gridDim.x), f1 = (int)((i64)(blockIdx.x + 1) * p.n / gridDim.x);
    const int rows = f1 - f0;
    const int nb = p.k / 32, chunks = nb / RP_GROUP / TS8_CHUNK_GROUPS;
    const int stage_rows = p.stage_spans, ring = p.stages;
    const i64 slot_bytes = (i64)stage_rows * p.w_row_bytes;
    const int num_stages = (rows + stage_rows - 1) / stage_rows;
    // chunks per work item: the most that still leaves every consumer warp an item of a full stage (fewer warp
    // sums), a divisor of the row's chunks; a function of the launch's shape only, as the sums' order is
    int per = chunks;
    while (per > 1 && (chunks % per || stage_rows / TS8_ROWS * (chunks / per) < TS8_CONSUMERS)) --per;
    const int parts = chunks / per;
    u8* xq = ts8_smem + ring * slot_bytes;
    float2* xs = reinterpret_cast<float2*>(xq + s8_pitch(nb));
    float* partial = reinterpret_cast<float*>(xs + nb);  // [rows][parts]

    if (ring <= 0 || ring > TS8_MAX_STAGES || stage_rows < TS8_ROWS || stage_rows % TS8_ROWS || chunks == 0 ||
        (nb / RP_GROUP) % TS8_CHUNK_GROUPS || p.w_row_bytes % 16 || p.m != 1 || p.norm_w != nullptr)
        __trap();  // the launcher's contract (kernels_tma.gemv_tma_s8_plan)
    ring_init(full, empty, ring, TS8_CONSUMERS);  // empty: every consumer warp's arrival
    __syncthreads();
    if (warp == TS8_CONSUMERS) {
        // producer (one lane): the first `ring` stages before the previous kernel ends (weights only), then each
        // slot again once every consumer warp is done with it; one bulk copy per stage (whole rows are
        // contiguous bytes): few large copies stream faster than many small ones
        if (lane == 0) {
            for (int i = 0; i < num_stages; ++i) {
                const int slot = i % ring, n = min(stage_rows, rows - i * stage_rows);
                if (i >= ring) mbar_wait(&empty[slot], (u32)(i / ring - 1) & 1u);
                const u32 bytes = (u32)(n * p.w_row_bytes);
                mbar_expect_tx(&full[slot], bytes);
                bulk_copy(ts8_smem + slot * slot_bytes, p.w + (i64)(f0 + i * stage_rows) * p.w_row_bytes, bytes,
                          &full[slot]);
            }
        }
        pdl_enter();  // all threads take part in it
    } else {
        pdl_enter();  // x (and the residual) only after the previous kernel
        s8_quantize_x(p, nullptr, xq, xs, TS8_CONSUMERS * 32);
        named_sync(1, TS8_CONSUMERS * 32);  // x is in smem (the consumer warps only)
        // every warp waits on every stage in order and arrives on its `empty` once done with it, so the producer
        // refills a slot only after all of them: no warp can be a whole ring ahead of the phase it waits for
        for (int i = 0; i < num_stages; ++i) {
            const int slot = i % ring, n = min(stage_rows, rows - i * stage_rows);
            mbar_wait(&full[slot], (u32)(i / ring) & 1u);
            const u8* st = ts8_smem + slot * slot_bytes;
            // items: (row pair, chunks [part * per, +per)); the last pair of an odd stage reads its second row
            // from stale smem, whose products land in D rows 8-15 only and are not stored
            for (int it = warp; it < (n + 1) / TS8_ROWS * parts; it += TS8_CONSUMERS) {
                const int pair = it / parts, part = it - pair * parts, j0 = part * per * TS8_CHUNK_GROUPS;
                const u8* r0 = st + (i64)pair * TS8_ROWS * p.w_row_bytes;
                const u8* r1 = r0 + p.w_row_bytes;
                const u8* const sc[TS8_ROWS] = {r0 + j0 * TS8_GROUP_SCALE_BYTES, r1 + j0 * TS8_GROUP_SCALE_BYTES};
                const u8* const qs[TS8_ROWS] = {r0 + nb * RP_SCALE_BYTES + j0 * 64, r1 + nb * RP_SCALE_BYTES + j0 * 64};
                const float2 d = ts8_piece_dot(sc, qs, per, j0, xq, xs);
                const float v0 = warp_sum(d.x), v1 = warp_sum(d.y);
                const int row = i * stage_rows + pair * TS8_ROWS;
                if (lane == 0) {
                    partial[row * parts + part] = v0;
                    if (pair * TS8_ROWS + 1 < n) partial[(row + 1) * parts + part] = v1;
                }
            }
            __syncwarp();
            if (lane == 0) mbar_arrive(&empty[slot]);  // release: orders the warp's reads before the refill
        }
    }
    __syncthreads();  // every partial is in smem
    for (int f = threadIdx.x; f < rows; f += TS8_THREADS) {
        float v = 0.f;
        for (int q = 0; q < parts; ++q) v += partial[f * parts + q];
        p.y[f0 + f] = f2h(gemv_out(p, 0, f0 + f, v));
    }
#else
    pdl_enter();
    __trap();  // no bulk copies below SM90 (and no fp16 build): the launcher never takes this build there
#endif
}
