// gemv_s8.cu: decode GEMV y[m, n] = sum_k x[m, k] * W[n, k] for m <= 32 on int8 tensor cores (SM80+), W in
// repacked Q4_0 / Q4_1 / Q8_0 rows (backends/cuda/repack.py, WREPACK=1).
//
// Why: gemv_mma dequantizes every weight to fp16 before its MMA and is issue-bound on quant rows at 0.3-0.6 of
// the copy bandwidth (H200, Nsight Compute: ~6 weights per warp instruction, docs/performance.md). Here a word of
// 8 nibbles becomes two MMA operands with three logic ops, and one mma.m16n8k32 takes 16 rows x one 32-weight
// block: the integer products need no conversion, only one fp32 scaling of each block's exact int32 sums.
//
// x is quantized per 32 elements as llama.cpp's Q8_1 (ggml-common.h block_q8_1; MMVQ kernels): per x row r and
// block b, d = max|x| / 127, q = rint(x * (127 / max|x|)) in [-127, 127] (0 for an all-zero block), and
// s = d * sum(q). With the weights' (d_w, m_w, q_w), each block adds
//     Q4_0: d_w * (d * sum(q_w q) - 8 s)     Q4_1: d_w * d * sum(q_w q) + m_w * s     Q8_0: d_w * d * sum(q_w q)
// to an fp32 accumulator (xs stores -8 s for Q4_0). The weights are exact (gemv_mma rounds d * q + m to fp16);
// x carries the 8-bit rounding, ~0.4% of a block's max per element, which is what bounds this kernel's error
// (tests/kernels/test_gemv_s8.py states the bound and also checks the int8 sums exactly against a CPU emulation).
//
// x reaches shared memory in one of two ways: every block quantizes all m rows itself after pdl_enter (with the
// fused RMSNorm first: x * inv * w rounded to fp16 as rms_norm stores it), or (S8_XG) a quantize_s8 launch
// quantizes them once into p.xq and every block copies that with cp.async: the per-block quantization costs
// issue slots in proportion to m * k (at m = 8 it made the kernel 2x slower than gemv_mma), the extra launch a
// fixed ~1-2 us (gemv_int8.gemv_s8_x_per_launch picks). Then each block streams its 32 (or 16) weight rows as
// gemv_mma does on repacked rows (gemv_mma.cuh: lane rows g, g + 8 of each 16-row tile, load_rows_group's
// 16-byte loads, 8 warps splitting k in whole load groups, two groups in flight, the first issued before
// pdl_enter) and ends in gm_epilogue (fixed-order reduction of the warps' tiles; the residual and SwiGLU
// fusions). The MMA's k slots:
// A words 0 / 1 (rows g / g + 8) pair with B word 0 (the same 4 elements of the block), A words 2 / 3 with B
// word 1 (the other 4 of the lane's slot t): Q4 low nibbles of quant bytes 4t..4t+3 (elements 4t..4t+3) and
// high nibbles (16 + 4t..), Q8_0 quant bytes 8t..8t+3 and 8t+4..8t+7. x's bytes are stored in that order, per
// row grouped as the weights' load groups ([group][slot t][block of the group][2 words]), so a lane reads a
// group's B words with one or two 16-byte loads.
// S8_M1: the build for m = 1 (x scales [nb] read by every lane; only C column 0 is scaled); else [nb][8] and
// each lane reads the scales of its columns 2t, 2t + 1. S8_NCOL = 2 / 4 (S8_XG only): 9-16 / 17-32 x rows in
// one launch, scales [nb][8 S8_NCOL]; each A fragment (16 weight rows x one block) meets S8_NCOL B fragments (x
// rows 0-7, 8-15, ...), so the weights are read once for all rows instead of once per 8-row launch; the
// epilogue runs per 8-row group. S8_KSPLIT (with S8_NCOL = 2 / 4): the launch takes blocks [kb_begin, kb_end) of
// each row and hands its fp32 sums on through p.part, where x of all rows does not fit the shared memory.
// Columns past m: their int32 sums are 0 (zero B columns)
// and their scales unwritten smem, so their accumulators hold garbage that gm_epilogue never stores (r < m).
// Dynamic shared memory: kernels.gemv_s8_smem_bytes (xq [m][nbl * 32 + 16] bytes, nbl = the launch's blocks of a
// row, then xs float2); p.xq of an S8_XG launch holds the same bytes for whole rows.
// Requirements (the launcher checks): repacked rows (k % 256 == 0, 16-byte aligned), x rows 16-byte aligned.
// Reference: voltserve.backends.cpu.CpuBackend.linear (fp32, unquantized x).
#ifndef WREPACK
#define WREPACK 1
#endif
#include "gemv_mma.cuh"

#ifndef S8_XG
#define S8_XG 0  // 1: x quantized once per launch by quantize_s8 into p.xq; gemv_s8 copies it into smem
#endif
#include "gemv_s8.cuh"
#if S8_NCOL != 1 && ((S8_NCOL != 2 && S8_NCOL != 4) || !S8_XG || S8_M1)
#error "S8_NCOL = 2 or 4 (9-16, 17-32 x rows) needs S8_XG (x quantized per launch) and is not an S8_M1 build"
#endif
// Load groups a warp issues early from its two register buffers: S8_NEXT_GROUPS of a persistent block's next tile
// during a tile's epilogue and, where a block has several tiles (gridDim.x < tiles) or S8_WAIT_GROUPS is 2, that
// many of its first tile before the PDL wait (else one). Both, on the launches with several tiles a block, made them
// 1-3% faster on an H100 (session 45: Q4_1 / Q8_0 14336x4096 at 2 / 8 rows); both before the wait on the launches
// of one tile a block made those up to 9% slower (Q8_0 4096x14336, Q4_1 4096x4096 at 2 rows), and so did the
// two-group loop order alone (session 46: 34.4 against 32.0 us), so the launcher passes 1 on those grids
// (gemv_int8.gemv_s8_launch_spec). The builds quantizing x in every block keep one (both buffers live across the
// quantization spill 36-68 bytes).
#ifndef S8_NEXT_GROUPS
#define S8_NEXT_GROUPS (S8_XG && !S8_M1 ? 2 : 1)  // the one-row build spills 28-48 bytes with 2
#endif
#ifndef S8_WAIT_GROUPS
#define S8_WAIT_GROUPS 1  // 2: both before the wait whatever the grid (A/B runs)
#endif
#if S8_WAIT_GROUPS < 1 || S8_WAIT_GROUPS > S8_NEXT_GROUPS || S8_NEXT_GROUPS > 2
#error "1 <= S8_WAIT_GROUPS <= S8_NEXT_GROUPS <= 2"
#endif
#ifndef S8_XWARP
#define S8_XWARP 0  // 1 (S8_XG): each warp copies only its own k range of x, in two parts (s8_copy_x_warp)
#endif
#if S8_XWARP && !S8_XG
#error "S8_XWARP copies x quantized per launch: it needs S8_XG"
#endif
#ifndef S8_KSPLIT
#define S8_KSPLIT 0  // 1: the launch covers blocks [p.kb_begin, p.kb_end) of each row, partial sums through p.part
#endif
#if S8_KSPLIT && (S8_NCOL == 1 || SILU)
#error "S8_KSPLIT is a build of S8_NCOL = 2 or 4 without SILU (the partial sums are plain products)"
#endif

// acc (rows g, g + 8 x columns 2t, 2t + 1 of one 16-row tile) += the scaled int32 sums ci of one block.
// w0 / w1: the scale words of rows g / g + 8; (dx, sx): x scales of column 2t (.x, .y) and 2t + 1 (.z, .w).
VOLT_DEVICE void s8_scale(float (&acc)[4], const int (&ci)[4], u32 w0, u32 w1, float4 xsc) {
    const float dw0 = h2f((half_t)(w0 & 0xffffu)), dw1 = h2f((half_t)(w1 & 0xffffu));
#if WTYPE == WTYPE_Q4_1
    const float mw0 = h2f((half_t)(w0 >> 16)), mw1 = h2f((half_t)(w1 >> 16));
#else
    const float mw0 = 0.f, mw1 = 0.f;  // unused
#endif
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        if (S8_M1 && (e & 1)) continue;  // column 2t + 1 >= 1 = m
        acc[e] = s8_add_block(acc[e], e < 2 ? dw0 : dw1, e < 2 ? mw0 : mw1, e & 1 ? xsc.z : xsc.x,
                              e & 1 ? xsc.w : xsc.y, ci[e]);
    }
}

// acc[j] += the products of blocks [c, c + RP_GROUP) with x column group j (x rows 8 j .. 8 j + 7); raw: this
// lane's words of them; xrow: its quantized x row of group 0 (group j's is 8 j rows further); x_rows: bit j set
// where that row exists. One A fragment serves every column group: S8_NCOL = 2 reads the weights once for 16 rows.
// Measured slower or equal (session 22, H200): skipping the column groups without rows (17-24 rows; a warp-uniform
// break: 2-15% slower on every row, 17-24 included), and reading the next load group's x words (and scales) from
// smem while this one computes (Q4: equal, with the scales spilling and 2x slower; Q8_0: -7% to +4% by row).
VOLT_DEVICE void s8_group(GmAcc (&acc)[S8_NCOL], const GmRaw& raw, const u8* xrow, int pitch, const float2* xs,
                          int x_rows, int c, int t) {
#if WREPACK && GM_M16N8K16
    u32 xb[S8_NCOL][RP_GROUP][2];
#pragma unroll
    for (int j = 0; j < S8_NCOL; ++j) {
        if (x_rows >> j & 1) {
            const uint4* src = reinterpret_cast<const uint4*>(xrow + j * 8 * pitch + (c / RP_GROUP) * (32 * RP_GROUP) +
                                                              t * (8 * RP_GROUP));
#pragma unroll
            for (int i = 0; i < RP_GROUP / 2; ++i) {
                const uint4 v = src[i];
                xb[j][2 * i][0] = v.x; xb[j][2 * i][1] = v.y; xb[j][2 * i + 1][0] = v.z; xb[j][2 * i + 1][1] = v.w;
            }
        } else {
#pragma unroll
            for (int u = 0; u < RP_GROUP; ++u) xb[j][u][0] = xb[j][u][1] = 0u;
        }
    }
#pragma unroll
    for (int u = 0; u < RP_GROUP; ++u) {
        float4 xsc[S8_NCOL];
#pragma unroll
        for (int j = 0; j < S8_NCOL; ++j) {
#if S8_M1
            const float2 s1 = xs[c + u];
            xsc[j] = make_float4(s1.x, s1.y, 0.f, 0.f);
#else
            xsc[j] = *reinterpret_cast<const float4*>(xs + (c + u) * S8_COLS + 8 * j + 2 * t);
#endif
        }
#pragma unroll
        for (int i = 0; i < GM_NACC; ++i) {
            const u32 q0 = raw[u][2 * i][1], q1 = raw[u][2 * i + 1][1];  // rows g, g + 8
#if WTYPE == WTYPE_Q8_0
            const u32 a[4] = {q0, q1, raw[u][2 * i][2], raw[u][2 * i + 1][2]};
#else
            const u32 a[4] = {q0 & 0x0F0F0F0Fu, q1 & 0x0F0F0F0Fu, (q0 >> 4) & 0x0F0F0F0Fu, (q1 >> 4) & 0x0F0F0F0Fu};
#endif
#pragma unroll
            for (int j = 0; j < S8_NCOL; ++j) {
                int ci[4] = {0, 0, 0, 0};
                mma_m16n8k32_i8<WTYPE != WTYPE_Q8_0>(ci, a, xb[j][u][0], xb[j][u][1]);
                s8_scale(acc[j][i], ci, raw[u][2 * i][0], raw[u][2 * i + 1][0], xsc[j]);
            }
        }
    }
#endif
}

// S8_XG: copy the launch's quantized x (quantize_s8's output, the smem layout) into smem with cp.async: blocks
// [kb0, kb0 + nbl) of each row (the whole row unless S8_KSPLIT; kb0 a multiple of RP_GROUP, so a contiguous byte
// range of each row) and their scales, as a row of nbl blocks (kernels.gemv_s8_smem_bytes of nbl * 32).
VOLT_DEVICE void s8_copy_x(const GemvParams& p, u8* xq, int kb0, int nbl) {
    const int nb = p.k / 32;
    if (nbl == nb) {  // one contiguous copy
        const int bytes = p.m * s8_pitch(nb) + nb * 8 * S8_COLS;
        for (int off = threadIdx.x * 16; off < bytes; off += blockDim.x * 16) cp_async16(xq + off, p.xq + off);
    } else {
        const int chunks = nbl * 2;  // 16-byte chunks of a row's range
        for (int i = threadIdx.x; i < p.m * chunks; i += blockDim.x) {
            const int r = i / chunks, c = i - r * chunks;
            cp_async16(xq + r * s8_pitch(nbl) + c * 16, p.xq + r * s8_pitch(nb) + kb0 * 32 + c * 16);
        }
        const u8* xs_src = p.xq + p.m * s8_pitch(nb) + kb0 * 8 * S8_COLS;
        u8* xs_dst = xq + p.m * s8_pitch(nbl);
        for (int off = threadIdx.x * 16; off < nbl * 8 * S8_COLS; off += blockDim.x * 16)
            cp_async16(xs_dst + off, xs_src + off);
    }
    cp_async_commit();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// S8_XWARP: one warp's copy of x's blocks [c_lo, c_hi) (its k range, or part of it) of every row and their scales,
// as one cp.async group. A warp reads x only in its own k range, so the copy needs no block barrier: with the
// range in two groups the warp starts on its first half while the second is in flight (s8_copy_x copies the
// whole x, 143 KB at Llama-3-8B's down and 8 rows, before any warp may read it).
VOLT_DEVICE void s8_copy_x_warp(const GemvParams& p, u8* xq, int kb0, int nbl, int c_lo, int c_hi, int lane) {
    const int nb = p.k / 32, chunks = (c_hi - c_lo) * 2;  // 16-byte chunks of a row's part
    for (int i = lane; i < p.m * chunks; i += 32) {
        const int r = i / chunks, c = i - r * chunks;
        cp_async16(xq + r * s8_pitch(nbl) + (c_lo - kb0) * 32 + c * 16, p.xq + r * s8_pitch(nb) + c_lo * 32 + c * 16);
    }
    const u8* xs_src = p.xq + p.m * s8_pitch(nb) + c_lo * 8 * S8_COLS;  // blocks of RP_GROUP: 16-byte multiples
    u8* xs_dst = xq + p.m * s8_pitch(nbl) + (c_lo - kb0) * 8 * S8_COLS;
    for (int off = lane * 16; off < (c_hi - c_lo) * 8 * S8_COLS; off += 32 * 16) cp_async16(xs_dst + off, xs_src + off);
    cp_async_commit();
}

// quantize_s8 (S8_XG builds): x quantized once per launch into p.xq in gemv_s8's smem layout (xq rows, then xs),
// instead of by every gemv_s8 block. Grid (ceil(nb * 4 / 256), m): each block takes 256 quarters (8 elements) of
// x row blockIdx.y, normalized first with the row's 1 / rms (a block pass over the row) when norm_w is set.
// The quarter's x and norm weights are issued with the 1 / rms pass's own loads (4 a thread in flight), so the
// launch costs one L2 round trip after the PDL wait (session 19: three before). The norm weights are read after
// the wait too: a cast kernel just before may have written them (CudaBackend._on_device).
extern "C" __global__ void __launch_bounds__(256) quantize_s8(const GemvParams p) {
#if GM_M16N8K16 && WREPACK && WTYPE != WTYPE_F16
    __shared__ float scratch[32];
    __shared__ float inv_rms[8 * S8_NCOL];
    const int r = blockIdx.y, nb = p.k / 32;
    const int q = blockIdx.x * blockDim.x + threadIdx.x;  // quarter of row r
    const bool mine = q < nb * 4;                         // warp-uniform: nb * 4 % 32 == 0
    const int e0 = (q >> 2) * 32 + 8 * (q & 3);
    pdl_enter();
    uint4 xv = make_uint4(0u, 0u, 0u, 0u);
    float4 nw0 = make_float4(0.f, 0.f, 0.f, 0.f), nw1 = nw0;
    if (mine) {
        xv = *reinterpret_cast<const uint4*>(p.x + r * p.x_stride + e0);
        if (p.norm_w != nullptr) {
            nw0 = *reinterpret_cast<const float4*>(p.norm_w + e0);
            nw1 = *reinterpret_cast<const float4*>(p.norm_w + e0 + 4);
        }
    }
    if (p.norm_w != nullptr) {
        const float inv = row_inv_rms<4>(p, r, scratch);
        if (threadIdx.x == 0) inv_rms[r] = inv;
        __syncthreads();
    }
    if (mine)
        s8_quantize_quarter(p, inv_rms, p.xq, reinterpret_cast<float2*>(p.xq + p.m * s8_pitch(nb)), r * nb * 4 + q,
                            xv, nw0, nw1);
#else
    pdl_enter();  // never launched below SM80 (gemv_int8.gemv_s8_ok)
    __trap();
#endif
}

// This lane's weight rows of the tile whose first output feature is `base` (gemv_mma's rows per lane).
VOLT_DEVICE void s8_tile_rows(const u8* (&rows)[GM_ROWS], const GemvParams& p, int base, int lane) {
#pragma unroll
    for (int rs = 0; rs < GM_ROWS; ++rs) rows[rs] = p.w + (i64)gm_row(p, base, gm_block_row(rs, lane)) * p.w_row_bytes;
}

// Grid: one block per tile of GM_TILE_ROWS rows (SILU: half gate, half up rows), or fewer blocks that loop over
// the tiles (backend.gemv_s8_grid "persistent": x is then quantized, or copied, once per block instead of once
// per tile). 32-row tiles hold 4 rows a lane (127 registers, 2 blocks an SM); 16-row tiles 2 (78-80 registers,
// 3 blocks), which gemv_int8.gemv_s8_tile_rows takes from 2 rows with x quantized per launch where 3 blocks'
// x fits in smem. Each row's k split over the warps and the warps' reduction order are the same in both, so
// they give the same y bit for bit.
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, GM_MIN_BLOCKS) gemv_s8(const GemvParams p) {
#if GM_M16N8K16 && WREPACK && WTYPE != WTYPE_F16
    extern __shared__ uint4 s8_smem[];  // xq [m][s8_pitch], then xs [nb][S8_COLS] float2
    __shared__ float red[GM_WARPS][GM_TILE_ROWS][8];
#if !S8_XG
    __shared__ float scratch[GM_NORM_ONE_PASS ? GEMV_NORM_SCRATCH : 32];
    __shared__ float inv_rms[8];
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = gm_slot(lane), xr = gm_x_row(lane);
    const u8* rows[GM_ROWS];
    const int n_out = SILU ? p.n / 2 : p.n, tiles = (n_out + GM_OUT_ROWS - 1) / GM_OUT_ROWS;
    int tile = blockIdx.x;
    s8_tile_rows(rows, p, tile * GM_OUT_ROWS, lane);
    const int nb = p.k / 32;
#if S8_KSPLIT
    const int kb0 = p.kb_begin, nbl = p.kb_end - p.kb_begin;  // this launch's blocks of each row
#else
    const int kb0 = 0, nbl = nb;
#endif
    const int per = ((nbl + GM_WARPS - 1) / GM_WARPS + RP_GROUP - 1) / RP_GROUP * RP_GROUP;  // whole groups
    const int c_begin = kb0 + min(nbl, warp * per), c_end = kb0 + min(nbl, warp * per + per);
    u8* xq = reinterpret_cast<u8*>(s8_smem);  // x's blocks [kb0, kb0 + nbl): block c at c - kb0
    float2* xs = reinterpret_cast<float2*>(xq + p.m * s8_pitch(nbl));
    GmRaw raw0, raw1;
    load_rows_group(raw0, rows, nb, c_begin, c_end, t);  // in flight across the PDL wait and x's quantization / copy
    const bool wait2 = S8_NEXT_GROUPS == 2 && (S8_WAIT_GROUPS == 2 || (int)gridDim.x < tiles);  // block-uniform
    if (wait2) load_rows_group(raw1, rows, nb, c_begin + RP_GROUP, c_end, t);
    pdl_enter();
#if S8_XWARP
    // the first half of the warp's 2-group iterations, then the rest: c reaches c_mid exactly in the loop below
    const int c_mid = min(c_end, c_begin + (c_end - c_begin + 4 * RP_GROUP - 1) / (4 * RP_GROUP) * (2 * RP_GROUP));
    s8_copy_x_warp(p, xq, kb0, nbl, c_begin, c_mid, lane);
    s8_copy_x_warp(p, xq, kb0, nbl, c_mid, c_end, lane);
    cp_async_wait<1>();
    __syncwarp();  // the lanes' copies of the first half, seen by the whole warp
#elif S8_XG
    s8_copy_x(p, xq, kb0, nbl);
    __syncthreads();
#else
    gm_inv_rms(p, scratch, inv_rms, xr);
    s8_quantize_x(p, inv_rms, xq, xs);
    __syncthreads();
#endif
    int x_rows = 0;  // bit j: x row xr + 8 j exists
#pragma unroll
    for (int j = 0; j < S8_NCOL; ++j) x_rows |= (xr + 8 * j < p.m) << j;
    const u8* xrow = xq + (xr < p.m ? xr : 0) * s8_pitch(nbl);
    if (S8_NEXT_GROUPS == 2 && !wait2)
        load_rows_group(raw1, rows, nb, c_begin + RP_GROUP, c_end, t);  // where the first tile's loop would issue it
    for (; tile < tiles; tile += gridDim.x) {  // a grid short of the tiles: x is in smem once per block
        GmAcc acc[S8_NCOL] = {};
        // two register buffers, as gemv_mma: group g + 2 is issued once group g's buffer is read
        for (int c = c_begin; c < c_end; c += 2 * RP_GROUP) {
#if S8_XWARP
            if (c == c_mid) {  // the second half of x (already in smem after the first tile: returns at once)
                cp_async_wait<0>();
                __syncwarp();
            }
#endif
#if S8_NEXT_GROUPS == 1
            load_rows_group(raw1, rows, nb, c + RP_GROUP, c_end, t);
#endif
            s8_group(acc, raw0, xrow, s8_pitch(nbl), xs, x_rows, c - kb0, t);
            if (c + RP_GROUP >= c_end) break;
            load_rows_group(raw0, rows, nb, c + 2 * RP_GROUP, c_end, t);
            s8_group(acc, raw1, xrow, s8_pitch(nbl), xs, x_rows, c + RP_GROUP - kb0, t);
#if S8_NEXT_GROUPS == 2
            load_rows_group(raw1, rows, nb, c + 3 * RP_GROUP, c_end, t);
#endif
        }
        if (tile + gridDim.x < tiles) {  // the next tile's first groups in flight during this one's epilogue
            s8_tile_rows(rows, p, (tile + gridDim.x) * GM_OUT_ROWS, lane);
            load_rows_group(raw0, rows, nb, c_begin, c_end, t);
#if S8_NEXT_GROUPS == 2
            load_rows_group(raw1, rows, nb, c_begin + RP_GROUP, c_end, t);
#endif
        }
#pragma unroll
        for (int j = 0; j < S8_NCOL; ++j) {  // column group j: x rows 8 j.. are the rows 0.. of a shifted y
            GemvParams pj = p;
            pj.y += 8 * j * p.y_stride;
            if (p.res != nullptr) pj.res += 8 * j * p.y_stride;
#if S8_KSPLIT
            pj.part += 8 * j * p.n;  // [m, n] fp32 (no SILU)
#endif
            pj.m = p.m - 8 * j;
            gm_epilogue(pj, acc[j], red, tile * GM_OUT_ROWS);
            __syncthreads();  // red is written again by the next group or tile
        }
    }
#else
    pdl_enter();  // SM < 80 or fp16: never launched (gemv_int8.gemv_s8_ok)
    __trap();     // a launch here would leave y unwritten: fail loudly instead
#endif
}

// ---------------------------------------------------------------------------------------------------------
// gemv_s8w (S8_M1 builds): the one-row decode GEMV on repacked rows with dp4a instead of MMAs. gemv_s8's 32-row
// tiles split k over 8 warps, so at one x row each warp holds a few load groups per tile and waits on them with
// little else in flight. Here a warp streams whole weight rows as the fp16 `gemv` does: lane L takes the row's
// 16-byte quant pieces L, L + 32, ..., S8W_UNROLL 512-byte steps of one row per work item (all their loads
// issued together), and 64 registers let an SM hold 32 warps. An output's rows (SILU: a gate and an up row, else
// one) are consecutive items of one warp; a warp's outputs are (grid warps) apart (persistent grid).
// Piece c of a row is slot t = c % 4 of load group c / 4 (quant.cuh rp_piece_off), whose x bytes are the 8 *
// RP_GROUP bytes at c * 8 * RP_GROUP of gemv_s8's xq row, so a warp's x reads are contiguous too. Per block u of
// the piece: ci = dp4a over the lane's 8 weights and x bytes. Q8_0 scales each block's ci by d_w d_x (each lane
// loads the scales of one load group of the item, lane j: group 8 s0 + j, which shuffles hand to the 4 lanes of
// each piece); Q4 sums a block's 4 slots over the quad first and scales the block once (s8w_piece_quad). The
// lanes' sums meet in one warp_sum per row: the same integer products as gemv_s8, scaled and added in another
// fp32 order (tests compare both with kutils.s8_reference). A warp's items advance by counters, and its lanes
// never branch apart: a lane past its row's last piece (k / 32 not a multiple of 32 for Q4, of 16 for Q8_0)
// computes on stale registers and the smem tail (GEMV_S8W_SMEM_PAD) and its product is dropped by a select
// (session 17: -25% instructions per item, kernel rows 4-7% faster). Blocks of S8W_WARPS (16 for Q4): with a
// fused norm, x's squares are summed in the block's order, so 1 / rms can differ in its last bit from
// quantize_s8's (256 threads) where the block is larger.
// dp4a is SM61+, so the x-per-block body also compiles for compute_70 (the launcher takes it on SM80+ only, as
// gemv_s8; the S8_XG build needs cp.async and traps below SM80).
// Quantized output (SILU, p.xq_out != nullptr: gate_up before a one-row gemv_s8w launch on down that would
// quantize x per launch, linear.swiglu_xq_target): y is also written quantized per 32 outputs in the layout of that
// launch (s8_xq.cuh, the down weight's format p.xq_out_fmt), so down skips its quantize_s8 launch. A block then
// takes 32 consecutive outputs at a time (a "chunk": its warps 2 (Q4) or 4 (Q8_0) outputs each) instead of
// S8W_WARPS, keeps the fp16 outputs of each of its chunks in smem, and after its last output (one barrier)
// quantizes its chunks, a warp each (xq_store_block). No fence or atomic on the way: an exchange per output (smem
// counts with a block fence, or across blocks through global counters) measured 2-6 us slower on the 8B gate_up
// (H100, session 44). The values quantized are the fp16 outputs, so the bytes equal quantize_s8's on y. A block
// owns S8W_OUT_SLOTS chunks at most (the launcher checks).
#ifndef S8W_OUT_SLOTS
#define S8W_OUT_SLOTS 8   // kernels.GEMV_S8W_OUT_SLOTS (SILU builds; the launcher passes it)
#endif
#ifndef S8W_WARPS
#define S8W_WARPS 8       // kernels.GEMV_S8W_WARPS (per format; the launcher passes it)
#endif
#ifndef S8W_MIN_BLOCKS
#define S8W_MIN_BLOCKS (32 / S8W_WARPS)  // 64 registers, 32 warps per SM (H200: as fast as 2 blocks of 99-116
                                         // registers on Q4 rows, 5-20% faster on Q8_0; performance.md session 7)
#endif
#ifndef S8W_UNROLL
#define S8W_UNROLL 4      // 512-byte steps of one row per work item (<= 4: Q8_0's one scale load per lane covers
                          // them; Q4 loads one scale word per piece)
#endif
#if S8W_UNROLL > 4
#error "S8W_UNROLL <= 4: an item's 8 * S8W_UNROLL Q8_0 load groups have their scales in one load per lane"
#endif
#ifndef S8W_QBATCH
#define S8W_QBATCH 1      // the prologue's x quarters per thread in flight (gemv_s8's 4 would cost registers)
#endif
#define S8W_ROWS (SILU ? 2 : 1)
#define S8W_QUAD (WTYPE != WTYPE_Q8_0)  // Q4: s8w_piece_quad (one scaling per lane and block)
struct S8wItem {
    uint4 q[S8W_UNROLL];  // this lane's quant pieces of the item's steps
#if S8W_QUAD
    u32 scw[S8W_UNROLL];  // the scale word of block c = piece c's index (lane's own block after the quad reduce)
#else
    S8wScale sc;          // the scales of the item's load group 8 * s0 + lane (lanes < 8 * S8W_UNROLL)
#endif
};

VOLT_DEVICE int dp4a_s8(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Issue this lane's loads of steps s0 .. s0 + S8W_UNROLL - 1 of a repacked row: pieces c0 + 32 j, c0 = 32 s0 +
// lane, at constant offsets from one address. A lane past the row's last piece loads nothing and keeps stale
// registers: gemv_s8w drops its products (a select), so no lane branches and every shuffle has the full mask.
VOLT_DEVICE void s8w_load(S8wItem& it, const u8* row, int nb, int pieces, int s0, int lane) {
    const int c0 = s0 * 32 + lane;
    const u8* qp = row + (i64)nb * RP_SCALE_BYTES + (i64)c0 * 16;
#if S8W_QUAD
    const u8* sp = row + (i64)c0 * RP_SCALE_BYTES;  // Q4: piece c's block c has its scale word at c * RP_SCALE_BYTES
#endif
#pragma unroll
    for (int j = 0; j < S8W_UNROLL; ++j) {
        if (c0 + 32 * j < pieces) {
            it.q[j] = ldg16(qp + 512 * j);
#if S8W_QUAD && WTYPE == WTYPE_Q4_1
            it.scw[j] = __ldg(reinterpret_cast<const u32*>(sp + 128 * j));
#elif S8W_QUAD
            it.scw[j] = __ldg(reinterpret_cast<const unsigned short*>(sp + 64 * j));
#endif
        }
    }
#if !S8W_QUAD
    const int g = 8 * s0 + lane;
    if (lane < 8 * S8W_UNROLL && g < pieces / 4)
        it.sc = __ldg(reinterpret_cast<const S8wScale*>(row + (i64)g * (RP_GROUP * RP_SCALE_BYTES)));
#endif
}

// Q8_0: the scales of step j's load group for this lane (group 8 j + lane / 4 of the item, held by that lane).
VOLT_DEVICE S8wScale s8w_scale(const S8wScale& sc, int j, int lane) {
    return __shfl_sync(0xffffffffu, sc, 8 * j + (lane >> 2));
}

// Q8_0: acc += piece c's products (slot c % 4 of 2 blocks): q = its quant words, sc = its group's scales, x from
// the block's xq / xs.
VOLT_DEVICE float s8w_piece(float acc, const uint4& q, const S8wScale& sc, const u8* xq, const float2* xs, int c) {
    const u32 qw[4] = {q.x, q.y, q.z, q.w};
    const int b0 = (c >> 2) * RP_GROUP;  // first block of the group
    const uint4 xv = *reinterpret_cast<const uint4*>(xq + c * 16);
    const u32 xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int u = 0; u < 2; ++u) {
        const int ci = dp4a_s8((int)qw[2 * u + 1], (int)xw[2 * u + 1], dp4a_s8((int)qw[2 * u], (int)xw[2 * u], 0));
        acc = s8_add_block(acc, half_of(sc, u), 0.f, xs[b0 + u].x, 0.f, ci);
    }
    return acc;
}

#if S8W_QUAD
// Q4: piece c holds slot t = c % 4 (lane % 4) of blocks 4 (c / 4) .. + 3; the quad's 4 lanes hold the
// 4 slots of the same blocks. Each lane's 4 int32 sums are reduce-scattered over the quad (3 shuffles), so lane
// t ends with the exact sum of block 4 (c / 4) + t = c and scales it once, x-sum term included, instead of
// scaling 4 partial sums (fewer instructions: the kernel issues on ~60% of cycles at Q4, Nsight Compute). Every
// lane of the warp takes part (the shuffles' full mask); odd = lane & 1, high = lane & 2.
VOLT_DEVICE float s8w_piece_quad(float acc, const uint4& q, u32 scw, const u8* xq, const float2* xs, int c,
                                 bool odd, bool high) {
    const u32 qw[4] = {q.x, q.y, q.z, q.w};
    const uint4 xa = *reinterpret_cast<const uint4*>(xq + c * 32);
    const uint4 xb = *reinterpret_cast<const uint4*>(xq + c * 32 + 16);
    const u32 xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int ci[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const int lo = (int)(qw[u] & 0x0F0F0F0Fu), hi = (int)((qw[u] >> 4) & 0x0F0F0F0Fu);
        ci[u] = dp4a_s8(hi, (int)xw[2 * u + 1], dp4a_s8(lo, (int)xw[2 * u], 0));
    }
    int k0 = odd ? ci[1] : ci[0], k1 = odd ? ci[3] : ci[2];  // blocks of this lane's parity: kept
    k0 += __shfl_xor_sync(0xffffffffu, odd ? ci[0] : ci[1], 1);  // the partner's: sent
    k1 += __shfl_xor_sync(0xffffffffu, odd ? ci[2] : ci[3], 1);
    int sum = high ? k1 : k0;
    sum += __shfl_xor_sync(0xffffffffu, high ? k0 : k1, 2);       // block (lane & 1) + (lane & 2) = c % 4
    const float2 x2 = xs[c];
#if WTYPE == WTYPE_Q4_1
    return s8_add_block(acc, half_of(scw, 0), half_of(scw, 1), x2.x, x2.y, sum);
#else
    return s8_add_block(acc, half_of(scw, 0), 0.f, x2.x, x2.y, sum);
#endif
}
#endif

// S8_XG copies x with cp.async (SM80+): below SM80 that build is a trapping stub, as gemv_s8 is there.
#if WREPACK && WTYPE != WTYPE_F16 && S8_M1 && (!S8_XG || GM_M16N8K16)
#define S8W_BUILT 1
#else
#define S8W_BUILT 0
#endif
extern "C" __global__ void __launch_bounds__(32 * S8W_WARPS, S8W_MIN_BLOCKS) gemv_s8w(const GemvParams p) {
#if S8W_BUILT
    extern __shared__ uint4 s8_smem[];  // xq [s8_pitch], then xs [nb] float2 (gemv_s8's S8_M1 layout)
#if !S8_XG
    __shared__ float scratch[32];
    __shared__ float inv_rms[8];
#endif
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nb = p.k / 32, pieces = nb * RP_PIECE / 4, steps = (pieces + 31) >> 5;
    const int n_out = SILU ? p.n / 2 : p.n;
    // work items: per output S8W_ROWS rows x ceil(steps / S8W_UNROLL). A block takes `chunk` consecutive outputs
    // at a time (S8W_WARPS, or 32 with xq_out), its chunks blockIdx.x, + gridDim.x, ...; warp w takes outputs w,
    // w + S8W_WARPS, ... of each.
#if SILU
    const int chunk = p.xq_out != nullptr ? 32 : S8W_WARPS;
    __shared__ float chunk_vals[S8W_OUT_SLOTS][32];  // xq_out: the fp16 outputs of the block's chunks, in order
#else
    const int chunk = S8W_WARPS;
#endif
    const int first = blockIdx.x * chunk + warp;  // blockDim = 32 * S8W_WARPS
    const int chunk_next = gridDim.x * chunk - (chunk - S8W_WARPS);  // from this warp's last output of a chunk
    u8* xq = reinterpret_cast<u8*>(s8_smem);
    const float2* xs = reinterpret_cast<const float2*>(xq + s8_pitch(nb));
    S8wItem it = {};  // zeroed: a lane past its row keeps these registers (s8w_load), never uninitialised ones
    // The current item: output `out`, its row r (SILU: 0 the gate row, 1 the up row) and first step s0, advanced
    // in place (index divisions per item cost ~60 instructions).
    int out = first, r = 0, s0 = 0, sub = 0, slot = 0;  // sub: this warp's output # in the chunk; slot: chunk #
    auto load = [&]() {
        const int row = SILU ? out + r * n_out : out;
        s8w_load(it, p.w + (i64)row * p.w_row_bytes, nb, pieces, s0, lane);
    };
    if (out < n_out) load();  // in flight across the PDL wait and x's quantization
    pdl_enter();
#if S8_XG
    s8_copy_x(p, xq, 0, nb);
#else
    gm_inv_rms(p, scratch, inv_rms, 0);
    s8_quantize_x<S8W_QBATCH>(p, inv_rms, xq, reinterpret_cast<float2*>(xq + s8_pitch(nb)));
#endif
    __syncthreads();
#if S8W_QUAD
    const bool odd = lane & 1, high = lane & 2;
#endif
    float acc[S8W_ROWS];
#pragma unroll
    for (int rr = 0; rr < S8W_ROWS; ++rr) acc[rr] = 0.f;
    while (out < n_out) {
        // Step j's piece c = c0 + 32 j; its x at constant offsets too (a lane past the row reads the smem tail,
        // kernels.GEMV_S8W_SMEM_PAD, and its product is dropped).
        const int c0 = s0 * 32 + lane;
        float part = 0.f;
        auto step = [&](int j) {
            const int c = c0 + 32 * j;
#if S8W_QUAD
            const float v = s8w_piece_quad(part, it.q[j], it.scw[j], xq, xs, c, odd, high);
#else
            const float v = s8w_piece(part, it.q[j], s8w_scale(it.sc, j, lane), xq, xs, c);
#endif
            part = c < pieces ? v : part;
        };
        if (s0 + S8W_UNROLL <= steps) {  // warp-uniform: every step in the row
#pragma unroll
            for (int j = 0; j < S8W_UNROLL; ++j) step(j);
        } else {
#pragma unroll
            for (int j = 0; j < S8W_UNROLL; ++j)
                if (s0 + j < steps) step(j);
        }
#pragma unroll
        for (int rr = 0; rr < S8W_ROWS; ++rr)
            if (rr == r) acc[rr] += part;
        const int done = out, done_slot = slot;  // this item's output: complete if the item was its last
        bool complete = false;
        if ((s0 += S8W_UNROLL) >= steps) {
            s0 = 0;
            if (++r == S8W_ROWS) {
                r = 0;
                if (++sub * S8W_WARPS < chunk) {
                    out += S8W_WARPS;
                } else {
                    sub = 0;
                    ++slot;
                    out += chunk_next;
                }
                complete = true;
            }
        }
        if (out < n_out) load();  // the next item's loads before this output's reduction
        if (complete) {
#pragma unroll
            for (int rr = 0; rr < S8W_ROWS; ++rr) acc[rr] = warp_sum(acc[rr]);
            if (lane == 0) {
#if SILU
                const float g = round_h(acc[0]), u = round_h(acc[1]);
                const half_t h = f2h(gemv_out(p, 0, done, g / (1.f + __expf(-g)) * u));
                p.y[done] = h;
                if (p.xq_out != nullptr) chunk_vals[done_slot][done & 31] = h2f(h);
#else
                p.y[done] = f2h(gemv_out(p, 0, done, acc[0]));
#endif
            }
#pragma unroll
            for (int rr = 0; rr < S8W_ROWS; ++rr) acc[rr] = 0.f;
        }
    }
#if SILU
    if (p.xq_out != nullptr) {  // block-uniform: every chunk of the block is in smem after the barrier
        __syncthreads();
        for (int c = warp; c < S8W_OUT_SLOTS; c += S8W_WARPS) {
            const int group = blockIdx.x + c * gridDim.x;  // the block's chunk c: block `group` of down's x
            if (group * 32 >= n_out) break;
            float v[1] = {chunk_vals[c][lane]};
            xq_store_block<1>(p.xq_out, p.xq_out_fmt, 1, n_out / 32, 0, group, v);
        }
    }
#endif
#else
    pdl_enter();  // fp16, GGUF rows, more than one x row or S8_XG below SM80: never launched (gemv_int8.gemv_s8w_ok)
    __trap();
#endif
}
