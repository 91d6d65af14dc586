// gemv_mma.cuh: the tile, loads, fragments and epilogue of the tensor-core decode GEMVs (gemv_mma.cu; gemv_s8.cu
// takes the same rows per lane, repacked loads and epilogue with int8 MMAs).
// gemv_mma: decode GEMV y[m, n] = sum_k x[m, k] * W[n, k] for m <= 8 on tensor cores, W fp16 or GGUF Q4_0 /
// Q4_1 / Q8_0 blocks dequantized to fp16 in registers. The m rows of x are the 8 columns of the MMA and the
// weight rows its M side, so m = 2..8 costs no more issue slots than m = 1 and the kernel streams the weights at
// the bandwidth the scalar `gemv` reaches only at m = 1 on fp16. Two MMA shapes (PTX ISA, "Matrix fragments for
// mma.m16n8k16" and "... for mma.m8n8k4"), fp16 x fp16 -> fp32 accumulate in both:
//   SM80+: mma.sync.m16n8k16; lane (g = lane / 4, t = lane % 4) holds rows g and g + 8 of each 16-row tile and
//     k slot t of every 32-wide chunk.
//   SM70 (V100; any arch with -DGM_MMA884=1, which the tests use to run this path on newer GPUs):
//     mma.sync.m8n8k4, where each quad pair q = (lane / 4) % 4 multiplies its own 8 x 4 by 4 x 8: the lane holds
//     row r8 = lane % 4 + 4 * (lane / 16) of each 8-row group and k slot q of every chunk; the four quad pairs'
//     partial sums are added with two fixed xor shuffles.
//
// Layout: block = 8 warps, GM_TILE_ROWS (32, or 16 where the launcher finds that pays: linear.gemv_mma_tile)
// weight rows (SILU: half gate rows + the matching up rows); the warps split k into 8 equal ranges of 32-wide
// chunks (one GGUF block, or 64 bytes of an fp16 row). Each lane loads its GM_ROWS rows' k slot of a chunk
// (fp16: 16 bytes; Q4: the block's scale words and 4 bytes of nibbles; Q8_0: 8 int8) straight into registers;
// the fragment's k slots are a permutation of the chunk's 32 elements (a dot product is order-free up to
// rounding, and the x fragment uses the same permutation), so every load is a contiguous
// piece of a row and no shared memory or ldmatrix is needed. The 8 warps' fp32 partial tiles are summed in
// fixed order in shared memory, so results are deterministic and each output row is bitwise independent of
// the other rows of x.
// Fusions (as gemv): `norm_w` RMSNorm of x (1/rms from a block-wide pass over x; x * inv * w is rounded to fp16
// as rms_norm stores it), `res` residual, compile-time SILU (SwiGLU of [gate; up]).
// Requirements (the launcher checks): k % 32 == 0, m <= 8, x rows 16-byte aligned (vec_ok); fp16 W rows
// 16-byte aligned; Q4_1 rows 4-byte aligned; Q4_0 / Q8_0 2-byte aligned.
// Quant weights are rounded once to fp16 (d * q + m in one fp16 fma), as gemm_tc does.
// WREPACK (quant only): repacked rows (quant.cuh), k % 256 == 0: a load group is one 16-byte quant load and one
// scale load per row (GGUF's 18 / 20 / 34-byte blocks allow only 2-4 byte loads), then the same words as
// load_raw; each warp's k range is rounded to whole groups, so where that changes no range (k / 32 / 8 a
// multiple of the group), results equal the GGUF layout's bit for bit.
// gemv_mma_sb (gemv_mma.cu) is SM80+ only (cp.async); its SM70 build is a trapping stub the launcher never takes.
// Reference: voltserve.backends.cpu.CpuBackend.linear.
#pragma once
#include "gemv_common.cuh"
#include "mma.cuh"

#ifndef SILU
#define SILU 0
#endif
#ifndef GM_MMA884
#define GM_MMA884 0
#endif
// 1: the fused norm's 1 / rms in one pass over all x rows (rows_inv_rms_one_pass), the launcher's build for
// norm launches of >= 2 rows (H200, Llama-3-8B, m = 8: RMSNorm + qkv 28.4 -> 21.8 us, + gate_up + SwiGLU
// 109.7 -> 84.2 us). 0: a pass per row (m = 1 and launches without a norm). Compiled into the build that serves m = 1
// and the unfused launches, the one-pass code measured 10-25% slower there (o_proj 11.5 -> 13.9 us, down 32.5
// -> 40.4 us, qkv m = 1 19.2 -> 21.3 us: the main loop's schedule moved), so it has a build of its own.
#ifndef GM_NORM_ONE_PASS
#define GM_NORM_ONE_PASS 0
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800 && !GM_MMA884
#define GM_M16N8K16 1
#else
#define GM_M16N8K16 0
#endif
// Tuning knobs (the engine compiles the defaults; a -D override is for sweeps on the device): warps per block
// (they split k), load groups, blocks per SM for the launch bounds.
#ifndef GM_WARPS
#define GM_WARPS 8
#endif
#ifndef GM_MIN_BLOCKS
#define GM_MIN_BLOCKS 2
#endif
#ifndef GM_TILE_ROWS
#define GM_TILE_ROWS 32  // weight rows per block: 32 or 16
#endif
#if GM_TILE_ROWS == 32
#define GM_TILE_SHIFT 5
#elif GM_TILE_ROWS == 16
#define GM_TILE_SHIFT 4
#else
#error "GM_TILE_ROWS must be 32 or 16"
#endif
#define GM_OUT_SHIFT (SILU ? GM_TILE_SHIFT - 1 : GM_TILE_SHIFT)  // log2 of the block's output features
#define GM_OUT_ROWS (1 << GM_OUT_SHIFT)
#define GM_ROWS (GM_TILE_ROWS / 8)  // weight rows per lane: rows g, g + 8 of each 16-row tile; one per 8-row group
#if GM_M16N8K16
#define GM_NACC (GM_TILE_ROWS / 16)  // accumulator fragments per lane: one per 16-row tile (4 floats)
#define GM_ACC 4
#else
#define GM_NACC (GM_TILE_ROWS / 8)   // ... one per 8-row group (8 floats)
#define GM_ACC 8
#endif
#if WTYPE == WTYPE_F16
#define GM_RAW 4        // 32-bit words per thread per row per chunk: 8 fp16
#elif WTYPE == WTYPE_Q8_0
#define GM_RAW 3        // d, 8 int8
#else
#define GM_RAW 2        // d (and m), 8 nibbles
#endif
#if WREPACK
#if defined(GM_UNROLL) && GM_UNROLL != RP_GROUP
#error "repacked rows load whole groups: GM_UNROLL must equal RP_GROUP (4 for Q4, 2 for Q8_0)"
#endif
#undef GM_UNROLL
#define GM_UNROLL RP_GROUP  // one load group = one 16-byte quant load (and one scale load) per row
#endif
#ifndef GM_UNROLL
#if GM_M16N8K16
#define GM_UNROLL 2     // chunks per load group; two groups in flight per warp (double-buffered registers)
#else
#define GM_UNROLL (32 / GM_TILE_ROWS)  // m8n8k4: 32 accumulators per lane (32-row tiles); V100 needs less in flight
#endif
#endif

VOLT_DEVICE u32 ldg_u16(const u8* p) { return (u32)__ldg(reinterpret_cast<const unsigned short*>(p)); }
VOLT_DEVICE u32 ldg_u32(const u8* p) { return __ldg(reinterpret_cast<const unsigned int*>(p)); }
VOLT_DEVICE u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
VOLT_DEVICE u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
VOLT_DEVICE u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// acc += A (16 x 16, row) * B (16 x 8, col) where this build takes the SM80+ shape (a no-op in the SM70 build).
VOLT_DEVICE void mma_16816(float (&acc)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if GM_M16N8K16
    mma_m16n8k16(acc, a, b0, b1);
#endif
}

// Each quad pair's acc += A (8 x 4) * B (4 x 8) where this build takes the SM70 shape (else a no-op).
VOLT_DEVICE void mma_884(float (&acc)[8], u32 a0, u32 a1, u32 b0, u32 b1) {
#if !GM_M16N8K16
    mma_m8n8k4(acc, a0, a1, b0, b1);
#endif
}

// This thread's raw words of chunk c of one weight row (see GM_RAW) at k slot t (0..3): 16 bytes of an fp16 row,
// or 4 (8) bytes of a Q4 (Q8_0) block plus its scale words. SMEM: the row is in shared memory (gemv_mma_sb's
// staged superblocks), read with plain loads.
template <bool SMEM = false>
VOLT_DEVICE u32 rd_u16(const u8* p) {
    return SMEM ? (u32)*reinterpret_cast<const unsigned short*>(p) : ldg_u16(p);
}
template <bool SMEM = false>
VOLT_DEVICE u32 rd_u32(const u8* p) {
    return SMEM ? *reinterpret_cast<const unsigned int*>(p) : ldg_u32(p);
}

template <bool SMEM = false>
VOLT_DEVICE void load_raw(u32 (&r)[GM_RAW], const u8* row, int c, int t) {
#if WTYPE == WTYPE_F16
    const uint4 v = ldg16(row + (i64)c * 64 + t * 16);  // elements 8t .. 8t + 7
    r[0] = v.x; r[1] = v.y; r[2] = v.z; r[3] = v.w;
#elif WTYPE == WTYPE_Q4_1
    const u8* blk = row + (i64)c * BLOCK_BYTES;
    r[0] = rd_u32<SMEM>(blk);               // d | m << 16
    r[1] = rd_u32<SMEM>(blk + 4 + 4 * t);   // bytes 4t .. 4t + 3: elements 4t + j (low), 4t + j + 16 (high)
#elif WTYPE == WTYPE_Q4_0
    const u8* blk = row + (i64)c * BLOCK_BYTES;
    r[0] = rd_u16<SMEM>(blk);
    r[1] = rd_u16<SMEM>(blk + 2 + 4 * t) | (rd_u16<SMEM>(blk + 4 + 4 * t) << 16);
#else  // Q8_0
    const u8* blk = row + (i64)c * BLOCK_BYTES;
    r[0] = rd_u16<SMEM>(blk);
    r[1] = rd_u16<SMEM>(blk + 2 + 8 * t) | (rd_u16<SMEM>(blk + 4 + 8 * t) << 16);  // elements 8t .. 8t + 3
    r[2] = rd_u16<SMEM>(blk + 6 + 8 * t) | (rd_u16<SMEM>(blk + 8 + 8 * t) << 16);  // 8t + 4 .. 8t + 7
#endif
}

// fp16 pairs of one row for k step j (0, 1) of a chunk's k slot t. m16n8k16: w[0] -> k slots (2t, 2t + 1),
// w[1] -> (2t + 8, 2t + 9); m8n8k4 (the quad pair of slot t): w[0] -> k (0, 1), w[1] -> (2, 3).
// Element <-> slot map (the x side in x_pairs matches it):
//   F16 / Q8_0: w[0] = elements (8t + 4j, +1), w[1] = (8t + 4j + 2, +3)
//   Q4_0 / Q4_1: w[0] = (4t + 16j, 4t + 16j + 2), w[1] = (4t + 16j + 1, +3)
VOLT_DEVICE void row_pairs(const u32 (&r)[GM_RAW], int j, u32 (&w)[2]) {
#if WTYPE == WTYPE_F16
    w[0] = r[2 * j];
    w[1] = r[2 * j + 1];
#elif WTYPE == WTYPE_Q8_0
    const u32 q = r[1 + j] ^ 0x80808080u;   // int8 -> q + 128 in each byte
    const u32 d2 = prmt(r[0], 0, 0x1010);
    // half 0x64XX = 1024 + XX exactly; minus 1152 leaves q
    w[0] = hmul2(hsub2(prmt(q, 0x64646464u, 0x4140), 0x64806480u), d2);
    w[1] = hmul2(hsub2(prmt(q, 0x64646464u, 0x4342), 0x64806480u), d2);
#else
    const u32 q = r[1] >> (4 * j);          // j = 1: the high nibbles
    const u32 h0 = (q & 0x000F000Fu) | 0x64006400u;         // bytes 0, 2: 1024 + nibble
    const u32 h1 = ((q >> 8) & 0x000F000Fu) | 0x64006400u;  // bytes 1, 3
    const u32 d2 = prmt(r[0], 0, 0x1010);
#if WTYPE == WTYPE_Q4_1
    const u32 m2 = prmt(r[0], 0, 0x3232);
    w[0] = hfma2(hsub2(h0, 0x64006400u), d2, m2);  // d * q + m, one rounding
    w[1] = hfma2(hsub2(h1, 0x64006400u), d2, m2);
#else
    w[0] = hmul2(hsub2(h0, 0x64086408u), d2);      // d * (q - 8)
    w[1] = hmul2(hsub2(h1, 0x64086408u), d2);
#endif
#endif
}

// Elements of chunk c that this thread's x fragment covers, as 4 words of fp16 pairs in natural order:
// F16 / Q8_0: x[8t .. 8t + 7]; Q4: x[4t .. 4t + 3] and x[16 + 4t .. 16 + 4t + 3].
VOLT_DEVICE void load_x(u32 (&xw)[4], const half_t* xrow, int c, int t) {
#if WTYPE == WTYPE_F16 || WTYPE == WTYPE_Q8_0
    const uint4 v = *reinterpret_cast<const uint4*>(xrow + c * 32 + 8 * t);
    xw[0] = v.x; xw[1] = v.y; xw[2] = v.z; xw[3] = v.w;
#else
    const uint2 lo = *reinterpret_cast<const uint2*>(xrow + c * 32 + 4 * t);
    const uint2 hi = *reinterpret_cast<const uint2*>(xrow + c * 32 + 16 + 4 * t);
    xw[0] = lo.x; xw[1] = lo.y; xw[2] = hi.x; xw[3] = hi.y;
#endif
}

// k index of half h (0 low, 1 high) of word i of load_x, relative to the chunk.
VOLT_DEVICE int x_elem(int i, int h, int t) {
#if WTYPE == WTYPE_F16 || WTYPE == WTYPE_Q8_0
    return 8 * t + 2 * i + h;
#else
    return 16 * (i >> 1) + 4 * t + 2 * (i & 1) + h;
#endif
}

// B fragment of k step j from the words of load_x, paired like row_pairs' w[0] (b0) and w[1] (b1).
VOLT_DEVICE void x_pairs(const u32 (&xw)[4], int j, u32& b0, u32& b1) {
#if WTYPE == WTYPE_F16 || WTYPE == WTYPE_Q8_0
    b0 = xw[2 * j];
    b1 = xw[2 * j + 1];
#else
    b0 = prmt(xw[2 * j], xw[2 * j + 1], 0x5410);  // (x0, x2)
    b1 = prmt(xw[2 * j], xw[2 * j + 1], 0x7632);  // (x1, x3)
#endif
}

// This lane's rows, x row and k slot. Block row of row slot rs (0..3), the x row (B column) it loads and the
// k slot (0..3) of each chunk it takes.
VOLT_DEVICE int gm_block_row(int rs, int lane) {
#if GM_M16N8K16
    return 16 * (rs >> 1) + (lane >> 2) + 8 * (rs & 1);
#else
    return 8 * rs + (lane & 3) + 4 * (lane >> 4);
#endif
}
VOLT_DEVICE int gm_x_row(int lane) {
#if GM_M16N8K16
    return lane >> 2;
#else
    return (lane & 3) + 4 * (lane >> 4);
#endif
}
VOLT_DEVICE int gm_slot(int lane) {
#if GM_M16N8K16
    return lane & 3;
#else
    return (lane >> 2) & 3;
#endif
}

// 16-byte global -> shared copies that bypass registers (SM80+ cp.async; gemv_mma_sb's stages, gemv_s8's x).
VOLT_DEVICE void cp_async16(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem)), "l"(gmem) : "memory");
#endif
}
VOLT_DEVICE void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Wait until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
VOLT_DEVICE void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

typedef u32 GmRaw[GM_UNROLL][GM_ROWS][GM_RAW];
typedef u32 GmX[GM_UNROLL][4];
typedef float GmAcc[GM_NACC][GM_ACC];

#if WREPACK
// Repacked rows: the raw words of chunks [c, c + RP_GROUP) (c a multiple of RP_GROUP) of one row, the same words
// load_raw gives for GGUF blocks, from one 16-byte quant load and one 4-16 byte scale load.
VOLT_DEVICE void load_raw_group(u32 (&r)[GM_UNROLL][GM_RAW], const u8* row, int nb, int c, int t) {
    const uint4 q = ldg16(row + rp_piece_off(nb, c, t));
#if WTYPE == WTYPE_Q4_1
    const uint4 sc = ldg16(row + (i64)c * 4);
    r[0][0] = sc.x; r[1][0] = sc.y; r[2][0] = sc.z; r[3][0] = sc.w;
    r[0][1] = q.x; r[1][1] = q.y; r[2][1] = q.z; r[3][1] = q.w;
#elif WTYPE == WTYPE_Q4_0
    const uint2 sc = __ldg(reinterpret_cast<const uint2*>(row + (i64)c * 2));
    r[0][0] = sc.x & 0xffffu; r[1][0] = sc.x >> 16; r[2][0] = sc.y & 0xffffu; r[3][0] = sc.y >> 16;
    r[0][1] = q.x; r[1][1] = q.y; r[2][1] = q.z; r[3][1] = q.w;
#else  // Q8_0: two blocks of 8 int8 each
    const u32 sc = ldg_u32(row + (i64)c * 2);
    r[0][0] = sc & 0xffffu; r[1][0] = sc >> 16;
    r[0][1] = q.x; r[0][2] = q.y; r[1][1] = q.z; r[1][2] = q.w;
#endif
}
#endif

#if WREPACK
// Repacked rows: this lane's raw words of chunks [c, c + GM_UNROLL) of its GM_ROWS rows (one load group; none when
// c >= c_end, which is a multiple of the group in gemv_mma's and gemv_s8's per-warp ranges).
VOLT_DEVICE void load_rows_group(GmRaw& raw, const u8* const (&rows)[GM_ROWS], int nb, int c, int c_end, int t) {
    if (c < c_end) {
        u32 g[GM_UNROLL][GM_RAW];
#pragma unroll
        for (int rs = 0; rs < GM_ROWS; ++rs) {
            load_raw_group(g, rows[rs], nb, c, t);
#pragma unroll
            for (int u = 0; u < GM_UNROLL; ++u)
#pragma unroll
                for (int e = 0; e < GM_RAW; ++e) raw[u][rs][e] = g[u][e];
        }
    }
}
#endif

// Issue the loads of chunks [c, c + GM_UNROLL) (chunks past c_end: none): this lane's raw weight words and,
// for x rows < m, its x words (zeros otherwise: the zero columns of B).
VOLT_DEVICE void load_group(GmRaw& raw, GmX& xw, const u8* const (&rows)[GM_ROWS], const half_t* xrow,
                            bool x_row, int c, int c_end, int t, int nb) {
#if WREPACK
    load_rows_group(raw, rows, nb, c, c_end, t);
#endif
#pragma unroll
    for (int u = 0; u < GM_UNROLL; ++u) {
#if !WREPACK
        if (c + u < c_end) {
#pragma unroll
            for (int rs = 0; rs < GM_ROWS; ++rs) load_raw(raw[u][rs], rows[rs], c + u, t);
        }
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e) xw[u][e] = 0u;
        if (x_row && c + u < c_end) load_x(xw[u], xrow, c + u, t);
    }
}

// acc += the products of chunk c: raw[rs] = this lane's row slot rs, xw = its x words of the chunk (normalized
// in place first when norm_w is set); t = its k slot.
VOLT_DEVICE void mma_chunk(GmAcc& acc, const u32 (&raw)[GM_ROWS][GM_RAW], u32 (&xw)[4], const float* norm_w,
                           float inv, bool x_row, int c, int t) {
    if (norm_w != nullptr && x_row) {  // rms_norm's stored value: fp16((x * inv) * w)
        const float* nw = norm_w + c * 32;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float lo, hi;
            unpack2(xw[e], lo, hi);
            xw[e] = pack2(lo * inv * nw[x_elem(e, 0, t)], hi * inv * nw[x_elem(e, 1, t)]);
        }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        u32 b0, b1;
        x_pairs(xw, j, b0, b1);
#if GM_M16N8K16
#pragma unroll
        for (int i = 0; i < GM_NACC; ++i) {
            u32 w0[2], w1[2];
            row_pairs(raw[2 * i], j, w0);
            row_pairs(raw[2 * i + 1], j, w1);
            const u32 a[4] = {w0[0], w1[0], w0[1], w1[1]};  // (g, lo) (g+8, lo) (g, hi) (g+8, hi)
            mma_16816(acc[i], a, b0, b1);
        }
#else
#pragma unroll
        for (int rs = 0; rs < GM_ROWS; ++rs) {
            u32 w[2];
            row_pairs(raw[rs], j, w);
            mma_884(acc[rs], w[0], w[1], b0, b1);
        }
#endif
    }
}

VOLT_DEVICE void mma_group(GmAcc& acc, const GmRaw& raw, GmX& xw, const float* norm_w, float inv, bool x_row, int c,
                           int c_end, int t) {
#pragma unroll
    for (int u = 0; u < GM_UNROLL; ++u)
        if (c + u < c_end) mma_chunk(acc, raw[u], xw[u], norm_w, inv, x_row, c + u, t);
}

// Weight row of this block's row rr (0..GM_TILE_ROWS - 1): rows past the end are clamped to a valid row (not
// stored). SILU: the first half of the tile are gate rows, the second half the matching up rows.
VOLT_DEVICE int gm_row(const GemvParams& p, int base, int rr) {
    const int n_out = SILU ? p.n / 2 : p.n;
    return SILU ? min(base + (rr & (GM_OUT_ROWS - 1)), n_out - 1) + (rr >> GM_OUT_SHIFT) * n_out
                : min(base + rr, p.n - 1);
}

// 1 / rms of x row xr for this lane (1 without the fused norm); block-wide (all threads call it).
VOLT_DEVICE float gm_inv_rms(const GemvParams& p, float* scratch, float* inv_rms, int xr) {
    if (p.norm_w == nullptr) return 1.f;
#if GM_NORM_ONE_PASS
    rows_inv_rms_one_pass(p, scratch, inv_rms);
#else
    rows_inv_rms(p, scratch, inv_rms);
#endif
    return xr < p.m ? inv_rms[xr] : 1.f;
}

// Sum the 8 warps' partial tiles in fixed order and store the block's outputs (fused epilogues included).
// red[warp][block row][x row]. m16n8k16 C fragment: acc[i] = (row g, x rows 2t, 2t+1), (row g + 8, same) of
// tile i; m8n8k4 (per quad pair): acc[rs][e] = (row (lane & 1) + 4 (lane / 16) + (e & 2) of group rs,
// x row (lane & 2) + (e & 1) + (e & 4)), summed over the quad pairs first (xor 4, then xor 8).
VOLT_DEVICE void gm_epilogue(const GemvParams& p, GmAcc& acc, float (*red)[GM_TILE_ROWS][8], int base) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_out = SILU ? p.n / 2 : p.n;
#if GM_M16N8K16
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < GM_NACC; ++i) {
        red[warp][16 * i + g][2 * t] = acc[i][0];
        red[warp][16 * i + g][2 * t + 1] = acc[i][1];
        red[warp][16 * i + g + 8][2 * t] = acc[i][2];
        red[warp][16 * i + g + 8][2 * t + 1] = acc[i][3];
    }
#else
#pragma unroll
    for (int rs = 0; rs < GM_ROWS; ++rs)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            float v = acc[rs][e];
            v += __shfl_xor_sync(0xffffffffu, v, 4);
            v += __shfl_xor_sync(0xffffffffu, v, 8);
            if ((lane & 12) == 0)
                red[warp][8 * rs + (lane & 1) + 4 * (lane >> 4) + (e & 2)][(lane & 2) + (e & 1) + (e & 4)] = v;
        }
#endif
    __syncthreads();
#if SILU
    for (int idx = threadIdx.x; idx < 8 * GM_OUT_ROWS; idx += blockDim.x) {  // 8 x rows x the block's outputs
        const int r = idx >> GM_OUT_SHIFT, row = idx & (GM_OUT_ROWS - 1), out = base + row;
        float gate = 0.f, up = 0.f;
#pragma unroll
        for (int w = 0; w < GM_WARPS; ++w) {  // fixed order
            gate += red[w][row][r];
            up += red[w][GM_OUT_ROWS + row][r];
        }
        if (r < p.m && out < n_out) {
            const float gh = round_h(gate), uh = round_h(up);
            p.y[r * p.y_stride + out] = f2h(gemv_out(p, r, out, gh / (1.f + __expf(-gh)) * uh));
        }
    }
#else
    for (int idx = threadIdx.x; idx < 8 * GM_OUT_ROWS; idx += blockDim.x) {  // 8 x rows x the block's outputs
        const int r = idx >> GM_OUT_SHIFT, row = idx & (GM_OUT_ROWS - 1), out = base + row;
        if (r < p.m && out < n_out) {
            float v = 0.f;
#pragma unroll
            for (int w = 0; w < GM_WARPS; ++w) v += red[w][row][r];  // fixed order
#if defined(S8_KSPLIT) && S8_KSPLIT
            float* part = p.part + (i64)r * n_out + out;  // the k ranges of the launches before, then this one's
            if (p.part_in) v = *part + v;
            if (p.part_out) *part = v;
            else
#endif
            p.y[r * p.y_stride + out] = f2h(gemv_out(p, r, out, v));
        }
    }
#endif
}
