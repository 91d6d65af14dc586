// gemv_mma.cu: the tensor-core decode GEMV kernels `gemv_mma` and `gemv_mma_sb`; their tile, fragment layouts,
// loads and epilogue (and the design notes) are in gemv_mma.cuh.
// Reference: voltserve.backends.cpu.CpuBackend.linear.
#include "gemv_mma.cuh"

extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, GM_MIN_BLOCKS) gemv_mma(const GemvParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
    __shared__ float red[GM_WARPS][GM_TILE_ROWS][8];  // the warps' partial sums [block row][x row]
    __shared__ float scratch[GM_NORM_ONE_PASS ? GEMV_NORM_SCRATCH : 32];
    __shared__ float inv_rms[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = gm_slot(lane), xr = gm_x_row(lane);
    const int base = blockIdx.x * GM_OUT_ROWS;  // first output feature of the block
    const u8* rows[GM_ROWS];
#pragma unroll
    for (int rs = 0; rs < GM_ROWS; ++rs) rows[rs] = p.w + (i64)gm_row(p, base, gm_block_row(rs, lane)) * p.w_row_bytes;
    const int nc = p.k / 32;
#if WREPACK
    const int per = ((nc + GM_WARPS - 1) / GM_WARPS + GM_UNROLL - 1) / GM_UNROLL * GM_UNROLL;  // whole groups
#else
    const int per = (nc + GM_WARPS - 1) / GM_WARPS;
#endif
    const int c_begin = min(nc, warp * per), c_end = min(nc, c_begin + per);
    const bool x_row = xr < p.m;  // x rows past m are the zero columns of B
    const half_t* xrow = p.x + (x_row ? xr : 0) * p.x_stride;
    GmRaw raw0, raw1;
    GmX xw0, xw1;
    // the first group's weights: in flight across the PDL wait and the norm pass (x only after the wait)
    load_group(raw0, xw0, rows, xrow, false, c_begin, c_end, t, nc);
    pdl_enter();
#pragma unroll
    for (int u = 0; u < GM_UNROLL; ++u)
        if (x_row && c_begin + u < c_end) load_x(xw0[u], xrow, c_begin + u, t);
    const float inv = gm_inv_rms(p, scratch, inv_rms, xr);
    GmAcc acc = {};
    // two register buffers: the next group's loads are issued before this group's MMAs
    for (int c = c_begin; c < c_end; c += 2 * GM_UNROLL) {
        load_group(raw1, xw1, rows, xrow, x_row, c + GM_UNROLL, c_end, t, nc);
        mma_group(acc, raw0, xw0, p.norm_w, inv, x_row, c, c_end, t);
        if (c + GM_UNROLL >= c_end) break;
        load_group(raw0, xw0, rows, xrow, x_row, c + 2 * GM_UNROLL, c_end, t, nc);
        mma_group(acc, raw1, xw1, p.norm_w, inv, x_row, c + GM_UNROLL, c_end, t);
    }
    gm_epilogue(p, acc, red, base);
#else
    pdl_enter();  // below SM70: no tensor cores (not a voltserve target)
#endif
}

// ---------------------------------------------------------------------------------------------------------
// gemv_mma_sb: quant weights with k % 256 == 0 and 16-byte-aligned rows. The narrow (2-4 byte) per-fragment
// loads of gemv_mma touch 8 rows per instruction and bound it at ~0.2-0.33 of the copy bandwidth; here each
// warp copies whole 256-weight superblocks of its 32 rows (144 / 160 / 272 bytes each, 16-byte aligned) with
// 16-byte cp.async (SM80) into its own shared-memory ring of SB_STAGES stages (2-3 superblocks in flight per
// warp) and reads the fragments' words from there. x for the next superblock is loaded into
// registers while the current one is multiplied.
#if WTYPE != WTYPE_F16
#define SB_BYTES (8 * BLOCK_BYTES)             // one row's superblock: 8 GGUF blocks
#define SB_VECS (SB_BYTES / 16)
#define SB_PITCH ((SB_BYTES / 4) % 8 == 4 ? SB_BYTES : SB_BYTES + 16)  // bytes; words = 4 * odd: conflict-free reads
#define SB_STAGE (32 * SB_PITCH)               // one warp's stage: 32 rows
// Stages (superblocks in flight per warp) and blocks per SM, as measured best at the Llama-3-8B shapes (H200):
// Q8_0 3 stages x 8.5 KB x 8 warps = 204 KB, one block per SM; Q4 2 stages (72 / 88 KB), two blocks per SM
// (4 stages at one block per SM lost on the 14336- and 6144-row shapes to the partial last wave).
#ifndef SB_STAGES
#if WTYPE == WTYPE_Q8_0
#define SB_STAGES 3
#define SB_MIN_BLOCKS 1
#else
#define SB_STAGES 2
#define SB_MIN_BLOCKS 2
#endif
#endif
#ifdef GM_SB_SMEM  // the launcher's dynamic shared memory (kernels.gemv_mma_sb_smem_bytes)
static_assert(GM_SB_SMEM == GM_WARPS * SB_STAGES * SB_STAGE, "gemv_mma_sb_smem_bytes drifted from the stage layout");
#endif

// At step i a thread has committed SB_STAGES + i groups (SB_STAGES - 1 in the prologue, one per step); superblock
// s_begin + i is group i, so at most SB_STAGES - 1 newer groups may stay in flight.
VOLT_DEVICE void cp_async_wait_oldest() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(SB_STAGES - 1) : "memory");
#endif
}

// Copy superblock sb of the block's 32 rows into `stage` (piece i = row i / SB_VECS, vector i % SB_VECS: each
// instruction reads whole runs of contiguous row bytes); always commits a group (empty past the end).
VOLT_DEVICE void sb_copy(u8* stage, const GemvParams& p, int base, int sb, bool ok, int lane) {
    if (ok) {
#pragma unroll
        for (int j = 0; j < SB_VECS; ++j) {
            const int i = j * 32 + lane, rr = i / SB_VECS, v = i % SB_VECS;
            cp_async16(stage + rr * SB_PITCH + v * 16,
                       p.w + (i64)gm_row(p, base, rr) * p.w_row_bytes + (i64)sb * SB_BYTES + v * 16);
        }
    }
    cp_async_commit();
}

VOLT_DEVICE void sb_load_x(u32 (&xw)[8][4], const half_t* xrow, bool x_row, int sb, int t) {
#pragma unroll
    for (int b = 0; b < 8; ++b) {
#pragma unroll
        for (int e = 0; e < 4; ++e) xw[b][e] = 0u;
        if (x_row) load_x(xw[b], xrow, sb * 8 + b, t);
    }
}

// acc += superblock sb (staged in `stage`) times x (xw: its 8 chunks' words).
VOLT_DEVICE void sb_mma(GmAcc& acc, const u8* stage, u32 (&xw)[8][4], const float* norm_w, float inv, bool x_row,
                        int sb, int lane, int t) {
#pragma unroll
    for (int b = 0; b < 8; ++b) {
        u32 raw[GM_ROWS][GM_RAW];
#pragma unroll
        for (int rs = 0; rs < GM_ROWS; ++rs) load_raw<true>(raw[rs], stage + gm_block_row(rs, lane) * SB_PITCH, b, t);
        mma_chunk(acc, raw, xw[b], norm_w, inv, x_row, sb * 8 + b, t);
    }
}

// One superblock step of gemv_mma_sb: refill the stage freed last step with superblock s + SB_STAGES - 1, load
// x of s + 1 into xn, wait for superblock s (copied SB_STAGES - 1 steps ago) and multiply it with xc.
VOLT_DEVICE void sb_step(GmAcc& acc, u8* stages, const GemvParams& p, u32 (&xc)[8][4], u32 (&xn)[8][4],
                         const half_t* xrow, bool x_row, float inv, int base, int s, int s_begin, int s_end, int t,
                         int lane) {
    const int ahead = s + SB_STAGES - 1;
    sb_copy(stages + ((ahead - s_begin) % SB_STAGES) * SB_STAGE, p, base, ahead, ahead < s_end, lane);
    if (s + 1 < s_end) sb_load_x(xn, xrow, x_row, s + 1, t);
    cp_async_wait_oldest();
    __syncwarp();  // every lane's copies of superblock s are visible to the warp
    sb_mma(acc, stages + ((s - s_begin) % SB_STAGES) * SB_STAGE, xc, p.norm_w, inv, x_row, s, lane, t);
    __syncwarp();  // the stage is consumed before a later step refills it
}
#endif

#ifndef SB_MIN_BLOCKS
#define SB_MIN_BLOCKS 1  // fp16: the kernel is an empty stub
#endif
extern "C" __global__ void __launch_bounds__(32 * GM_WARPS, SB_MIN_BLOCKS) gemv_mma_sb(const GemvParams p) {
#if GM_M16N8K16 && WTYPE != WTYPE_F16 && GM_TILE_ROWS == 32 && !WREPACK
    extern __shared__ uint4 sb_smem[];  // [GM_WARPS][SB_STAGES][32 rows][SB_PITCH bytes]
    __shared__ float red[GM_WARPS][GM_TILE_ROWS][8];
    __shared__ float scratch[GM_NORM_ONE_PASS ? GEMV_NORM_SCRATCH : 32];
    __shared__ float inv_rms[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, t = gm_slot(lane), xr = gm_x_row(lane);
    const int base = blockIdx.x * GM_OUT_ROWS;
    u8* stages = reinterpret_cast<u8*>(sb_smem) + warp * SB_STAGES * SB_STAGE;
    const int nsb = p.k / 256;
    const int per = (nsb + GM_WARPS - 1) / GM_WARPS;
    const int s_begin = min(nsb, warp * per), s_end = min(nsb, s_begin + per);
#pragma unroll
    for (int i = 0; i < SB_STAGES - 1; ++i)  // weights: in flight across the PDL wait
        sb_copy(stages + i * SB_STAGE, p, base, s_begin + i, s_begin + i < s_end, lane);
    pdl_enter();
    const bool x_row = xr < p.m;
    const half_t* xrow = p.x + (x_row ? xr : 0) * p.x_stride;
    u32 xw0[8][4], xw1[8][4];
    if (s_begin < s_end) sb_load_x(xw0, xrow, x_row, s_begin, t);
    const float inv = gm_inv_rms(p, scratch, inv_rms, xr);
    GmAcc acc = {};
    for (int s = s_begin; s < s_end; s += 2) {  // x double-buffered in registers: xw0 for s, xw1 for s + 1
        sb_step(acc, stages, p, xw0, xw1, xrow, x_row, inv, base, s, s_begin, s_end, t, lane);
        if (s + 1 >= s_end) break;
        sb_step(acc, stages, p, xw1, xw0, xrow, x_row, inv, base, s + 1, s_begin, s_end, t, lane);
    }
    gm_epilogue(p, acc, red, base);
#else
    pdl_enter();  // fp16, SM < 80, GM_MMA884, 16-row tiles or repacked rows: never launched (linear._mma_superblocks)
#if WTYPE != WTYPE_F16
    __trap();     // a launch here would leave y unwritten: fail loudly instead
#endif
#endif
}
