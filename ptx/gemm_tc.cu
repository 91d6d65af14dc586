// gemm_tc.cu: y[m, n] = sum_k x[m, k] * W[n, k] on tensor cores for m >= 17 (batched decode and prefill) with
// GGUF Q4_0 / Q4_1 / Q8_0 weights. Each 64-wide k chunk of a BN x 64 weight tile is dequantized in registers to
// fp16 into shared memory (never to global memory); the x tile is staged as fp16; the product runs as WMMA
// m16n16k16 fp16 x fp16 -> fp32 through inline PTX (`wmma.*`, PTX 6.0 / SM70: header-free, no mma.h).
//
// Grid: (ceil(n / BN), ceil(m / 64), splits); block 128 threads = 4 warps, warp w owns output rows
// [16w, 16w + 16) of the 64 x BN tile (BN / 16 accumulator fragments). Static smem: x tile [64][72] fp16 +
// W tile [BN][72] fp16 (row pitch 72 halves = 144 B keeps every fragment 32-byte aligned), reused as the fp32
// output stage [64][BN + 4]. Raw loads of chunk i + 1 are issued before the MMAs of chunk i (register prefetch).
//
// Split-K (small m x n grids): block z sums k in [z * k_split, min(k, (z + 1) * k_split)) and writes its fp32
// partial tile (tile-contiguous, straight from the fragments) to `part[z][tile]`; the last block of a tile to arrive (atomic counter, reset by that block for the next
// launch) sums the partials in fixed order z = 0 .. splits-1, so the result is bitwise deterministic whatever the
// arrival order (graph replay == eager). `counters` needs ceil(n/BN) * ceil(m/64) zeroed ints, owned by one
// stream at a time.
// dequant_f16: the same weights dequantized (load_raw8 / convert_raw8, the values gemm_tc's tiles hold) into fp16
// rows of global memory for cuBLAS at many x rows (dequant_gemm.dequant_gemm_wanted): grid (ceil(k / 8 / (128 *
// DQ_GROUPS)), min(n, 65535)), block 128 threads; a block takes 128 * DQ_GROUPS 8-weight groups of each of its
// rows (blockIdx.y, + gridDim.y, ...), a thread DQ_GROUPS of them 128 apart (coalesced 16-byte stores), its first
// row's loads issued before the PDL wait (weights are constant); y rows y_stride elements apart (y 16-byte
// aligned, y_stride % 8 == 0); x, part, counters unused.
// Compile-time: WTYPE (quant.cuh; quant formats only, fp16 weights take cuBLAS or gemm_tiled), BN (32 or 64),
// WREPACK (1: the rows are repacked, quant.cuh / voltserve.backends.cuda.repack; k % 256 == 0).
// Requirements: k % 32 == 0, x rows 16-byte aligned (x_stride % 8 == 0), w 4-byte aligned.
// SM70 path: the same code (WMMA m16n16k16 exists on SM70); fp32 accumulation, weights rounded once to fp16.
// Reference: voltserve.backends.cpu.CpuBackend.linear.
#include "quant.cuh"

#ifndef BN
#define BN 32
#endif
#define BM 64
#define KC 64
#define NT 128
#define LDA (KC + 8)  // halves per smem row of the x / W tiles
#define LDC (BN + 4)  // floats per smem row of the output stage
static_assert(BN == 32 || BN == 64, "BN must be 32 or 64");
static_assert(WTYPE != WTYPE_F16, "gemm_tc is for quantized weights");

struct GemmTcParams {
    const half_t* x;   // [m, k] fp16, row stride x_stride
    const u8* w;       // [n, w_row_bytes] GGUF blocks (WREPACK: repacked rows)
    half_t* y;         // [m, n] fp16, row stride y_stride
    float* part;       // [splits, tiles, 64, BN] fp32 workspace (splits > 1), tiles = grid x * grid y
    int* counters;     // [ceil(n/BN) * ceil(m/64)] zeroed arrival counters (splits > 1)
    i64 x_stride;      // elements
    i64 y_stride;      // elements
    i64 w_row_bytes;
    int m;
    int n;
    int k;
    int k_split;       // k per split, a multiple of KC
    int splits;
    int pad_;
};
VOLT_CHECK_PARAMS(GemmTcParams, VOLT_GEMM_TC_PARAMS_BYTES);

// ---- WMMA m16n16k16 through inline PTX (generic addresses into shared memory) ----
VOLT_DEVICE void wmma_load_a(u32 (&a)[8], const half_t* ptr, int ldm) {
    asm volatile("wmma.load.a.sync.aligned.row.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]), "=r"(a[4]), "=r"(a[5]), "=r"(a[6]), "=r"(a[7])
                 : "l"(ptr), "r"(ldm) : "memory");
}

VOLT_DEVICE void wmma_load_b_col(u32 (&b)[8], const half_t* ptr, int ldm) {
    asm volatile("wmma.load.b.sync.aligned.col.m16n16k16.f16 {%0,%1,%2,%3,%4,%5,%6,%7}, [%8], %9;"
                 : "=r"(b[0]), "=r"(b[1]), "=r"(b[2]), "=r"(b[3]), "=r"(b[4]), "=r"(b[5]), "=r"(b[6]), "=r"(b[7])
                 : "l"(ptr), "r"(ldm) : "memory");
}

VOLT_DEVICE void wmma_mma(float (&c)[8], const u32 (&a)[8], const u32 (&b)[8]) {
    asm volatile("wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, "
                 "{%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19,%20,%21,%22,%23}, "
                 "{%0,%1,%2,%3,%4,%5,%6,%7};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]), "+f"(c[4]), "+f"(c[5]), "+f"(c[6]), "+f"(c[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(a[4]), "r"(a[5]), "r"(a[6]), "r"(a[7]),
                   "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]), "r"(b[4]), "r"(b[5]), "r"(b[6]), "r"(b[7]));
}

VOLT_DEVICE void wmma_store_f32(float* ptr, const float (&c)[8], int ldm) {
    asm volatile("wmma.store.d.sync.aligned.row.m16n16k16.f32 [%0], {%1,%2,%3,%4,%5,%6,%7,%8}, %9;"
                 :: "l"(ptr), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]), "f"(c[4]), "f"(c[5]), "f"(c[6]),
                    "f"(c[7]), "r"(ldm) : "memory");
}

VOLT_DEVICE float4 ld_cg4(const float4* p) {  // L2 load: partials written by other blocks of this launch
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
    return v;
}

// ---- raw weight loads (issued early) and their conversion to 8 fp16 values ----
struct Raw8 {
    half_t d, mn;
    unsigned short q[4];
};

VOLT_DEVICE void load_raw8(const u8* blk, int j0, bool ok, Raw8& r) {
    r.d = r.mn = 0;
    r.q[0] = r.q[1] = r.q[2] = r.q[3] = 0;
    if (!ok) return;  // d = 0 (and mn = 0): the 8 weights come out as zeros
    r.d = *reinterpret_cast<const half_t*>(blk);
#if WTYPE == WTYPE_Q8_0
    const unsigned short* q2 = reinterpret_cast<const unsigned short*>(blk + 2 + j0);
#elif WTYPE == WTYPE_Q4_1
    // 20-byte blocks in rows of k / 32 * 20 bytes: 4-byte aligned, so d|m and the nibbles load as 32-bit words
    const u32 dm = *reinterpret_cast<const u32*>(blk);
    r.d = (half_t)(dm & 0xffffu);
    r.mn = (half_t)(dm >> 16);
    const u32* q4 = reinterpret_cast<const u32*>(blk + 4 + (j0 & 15));
    const u32 lo = q4[0], hi = q4[1];
    r.q[0] = lo & 0xffffu;
    r.q[1] = lo >> 16;
    r.q[2] = hi & 0xffffu;
    r.q[3] = hi >> 16;
#else
    const unsigned short* q2 = reinterpret_cast<const unsigned short*>(blk + 2 + (j0 & 15));
#endif
#if WTYPE != WTYPE_Q4_1
#pragma unroll
    for (int i = 0; i < 4; ++i) r.q[i] = q2[i];
#endif
}

#if WREPACK
// load_raw8 for repacked rows (quant.cuh): elements [j0, j0 + 8) of block b of `row` (nb blocks per row).
VOLT_DEVICE void load_raw8_rp(const u8* row, int nb, int b, int j0, bool ok, Raw8& r) {
    r.d = r.mn = 0;
    r.q[0] = r.q[1] = r.q[2] = r.q[3] = 0;
    if (!ok) return;
#if WTYPE == WTYPE_Q4_1
    const u32 dm = *reinterpret_cast<const u32*>(row + (i64)b * 4);
    r.d = (half_t)(dm & 0xffffu);
    r.mn = (half_t)(dm >> 16);
#else
    r.d = *reinterpret_cast<const half_t*>(row + (i64)b * 2);
#endif
#if WTYPE == WTYPE_Q8_0
    const u32* q = reinterpret_cast<const u32*>(row + rp_piece_off(nb, b, j0 / 8));  // the 8 int8 of slot j0 / 8
    const u32 lo = q[0], hi = q[1];
#else
    // quant bytes (j0 & 15) .. + 7 are slots (j0 & 15) / 4 and the next one, 16 bytes apart
    const int t = (j0 & 15) / 4;
    const u32 lo = *reinterpret_cast<const u32*>(row + rp_piece_off(nb, b, t));
    const u32 hi = *reinterpret_cast<const u32*>(row + rp_piece_off(nb, b, t + 1));
#endif
    r.q[0] = lo & 0xffffu;
    r.q[1] = lo >> 16;
    r.q[2] = hi & 0xffffu;
    r.q[3] = hi >> 16;
}
#endif

VOLT_DEVICE uint4 convert_raw8(const Raw8& r, int j0) {
    const float d = h2f(r.d);
    float w[8];
#if WTYPE == WTYPE_Q8_0
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        w[2 * i] = d * (float)(signed char)(r.q[i] & 0xff);
        w[2 * i + 1] = d * (float)(signed char)(r.q[i] >> 8);
    }
#else
#if WTYPE == WTYPE_Q4_1
    const float mn = h2f(r.mn);
#else
    const float mn = -8.f * d;
#endif
    const bool high = j0 >= 16;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int b0 = r.q[i] & 0xff, b1 = r.q[i] >> 8;
        w[2 * i] = d * (float)(high ? b0 >> 4 : b0 & 15) + mn;
        w[2 * i + 1] = d * (float)(high ? b1 >> 4 : b1 & 15) + mn;
    }
#endif
    return pack8(w);
}

#define A_VECS (BM * KC / 8 / NT)  // 16-byte x vectors per thread per chunk (4)
#define B_VECS (BN * KC / 8 / NT)  // 8-weight groups per thread per chunk (2 or 4)
#define SMEM_AB ((BM + BN) * LDA * 2)
#define SMEM_C (BM * LDC * 4)
#define SMEM_BYTES (SMEM_AB > SMEM_C ? SMEM_AB : SMEM_C)

extern "C" __global__ void __launch_bounds__(NT) gemm_tc(const GemmTcParams p) {
    pdl_enter();
    __shared__ alignas(128) unsigned char smem[SMEM_BYTES];
    __shared__ int s_last;
    half_t* As = reinterpret_cast<half_t*>(smem);                    // [BM][LDA]
    half_t* Bs = reinterpret_cast<half_t*>(smem + BM * LDA * 2);     // [BN][LDA]
    float* Cs = reinterpret_cast<float*>(smem);                      // [BM][LDC], after the k loop
    const int tid = threadIdx.x, warp = tid >> 5;
    const int n0 = blockIdx.x * BN, m0 = blockIdx.y * BM, z = blockIdx.z;
    const int kbeg = z * p.k_split, kend = min(p.k, kbeg + p.k_split);
    const bool warp_rows = m0 + warp * 16 < p.m;  // warp-uniform: rows past m need no MMAs

    uint4 xa[A_VECS];
    Raw8 wr[B_VECS];
    auto load = [&](int kb) {
#pragma unroll
        for (int i = 0; i < A_VECS; ++i) {
            const int v = tid + i * NT, r = v / (KC / 8), c = (v % (KC / 8)) * 8;
            const int gm = m0 + r, kk = kb + c;
            xa[i].x = xa[i].y = xa[i].z = xa[i].w = 0u;
            if (gm < p.m && kk < kend) xa[i] = *reinterpret_cast<const uint4*>(p.x + (i64)gm * p.x_stride + kk);
        }
#pragma unroll
        for (int i = 0; i < B_VECS; ++i) {
            const int v = tid + i * NT, r = v / (KC / 8), c = (v % (KC / 8)) * 8;
            const int gn = n0 + r, kk = kb + c;
            const bool ok = gn < p.n && kk < kend;
#if WREPACK
            load_raw8_rp(p.w + (i64)(ok ? gn : 0) * p.w_row_bytes, p.k / 32, kk / 32, kk % 32, ok, wr[i]);
#else
            load_raw8(p.w + (i64)(ok ? gn : 0) * p.w_row_bytes + (i64)(kk / 32) * BLOCK_BYTES, kk % 32, ok, wr[i]);
#endif
        }
    };

    float acc[BN / 16][8];
#pragma unroll
    for (int j = 0; j < BN / 16; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[j][e] = 0.f;

    if (kbeg < kend) load(kbeg);
    for (int kb = kbeg; kb < kend; kb += KC) {
        __syncthreads();  // previous chunk consumed
#pragma unroll
        for (int i = 0; i < A_VECS; ++i) {
            const int v = tid + i * NT, r = v / (KC / 8), c = (v % (KC / 8)) * 8;
            *reinterpret_cast<uint4*>(As + r * LDA + c) = xa[i];
        }
#pragma unroll
        for (int i = 0; i < B_VECS; ++i) {
            const int v = tid + i * NT, r = v / (KC / 8), c = (v % (KC / 8)) * 8;
            *reinterpret_cast<uint4*>(Bs + r * LDA + c) = convert_raw8(wr[i], (kb + c) % 32);
        }
        __syncthreads();
        if (kb + KC < kend) load(kb + KC);  // in flight during the MMAs below
        if (warp_rows) {
#pragma unroll
            for (int kk = 0; kk < KC; kk += 16) {
                u32 a[8];
                wmma_load_a(a, As + warp * 16 * LDA + kk, LDA);
#pragma unroll
                for (int j = 0; j < BN / 16; ++j) {
                    u32 b[8];
                    wmma_load_b_col(b, Bs + j * 16 * LDA + kk, LDA);
                    wmma_mma(acc[j], a, b);
                }
            }
        }
    }
    const int tile = blockIdx.y * gridDim.x + blockIdx.x;
    if (p.splits > 1) {
        // fp32 partial tile straight from the fragments, tile-contiguous: part[z][tile][BM][BN] (rows of warps
        // past m stay unwritten; the reduction never stores them)
        float* part = p.part + ((i64)z * gridDim.x * gridDim.y + tile) * (BM * BN);
        if (warp_rows) {
#pragma unroll
            for (int j = 0; j < BN / 16; ++j) wmma_store_f32(part + warp * 16 * BN + j * 16, acc[j], BN);
        }
        __threadfence();
        __syncthreads();
        if (tid == 0) s_last = atomicAdd(p.counters + tile, 1) == p.splits - 1;
        __syncthreads();
        if (!s_last) return;
        __threadfence();
        constexpr int RV = BM * BN / 4 / NT;  // float4 per thread
        float4 sum[RV];
#pragma unroll
        for (int e = 0; e < RV; ++e) sum[e].x = sum[e].y = sum[e].z = sum[e].w = 0.f;
        const i64 zstride = (i64)gridDim.x * gridDim.y * (BM * BN / 4);
        const float4* src = reinterpret_cast<const float4*>(p.part) + (i64)tile * (BM * BN / 4) + tid;
#pragma unroll 2
        for (int zz = 0; zz < p.splits; ++zz) {  // fixed order: bitwise deterministic
            float4 v[RV];
#pragma unroll
            for (int e = 0; e < RV; ++e) v[e] = ld_cg4(src + zz * zstride + e * NT);
#pragma unroll
            for (int e = 0; e < RV; ++e) {
                sum[e].x += v[e].x;
                sum[e].y += v[e].y;
                sum[e].z += v[e].z;
                sum[e].w += v[e].w;
            }
        }
#pragma unroll
        for (int e = 0; e < RV; ++e) {
            const int i = (tid + e * NT) * 4, gm = m0 + i / BN, gn = n0 + i % BN;
            if (gm >= p.m) continue;
            half_t* yr = p.y + (i64)gm * p.y_stride + gn;
            const float sv[4] = {sum[e].x, sum[e].y, sum[e].z, sum[e].w};
#pragma unroll
            for (int c = 0; c < 4; ++c)
                if (gn + c < p.n) yr[c] = f2h(sv[c]);
        }
        if (tid == 0) p.counters[tile] = 0;  // ready for the next launch on this stream
        return;
    }
    __syncthreads();  // the x / W tiles are dead: Cs aliases them
    if (warp_rows) {
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) wmma_store_f32(Cs + warp * 16 * LDC + j * 16, acc[j], LDC);
    }
    __syncthreads();

    for (int i = tid; i < BM * BN; i += NT) {
        const int r = i / BN, c = i % BN, gm = m0 + r, gn = n0 + c;
        if (gm < p.m && gn < p.n) p.y[(i64)gm * p.y_stride + gn] = f2h(Cs[r * LDC + c]);
    }
}

#define DQ_GROUPS 4  // 8-weight groups per thread of dequant_f16 (= kernels.DEQUANT_GROUPS; 2 equal, 8 slower)

extern "C" __global__ void __launch_bounds__(NT) dequant_f16(const GemmTcParams p) {
    const int c0 = blockIdx.x * (NT * DQ_GROUPS) + threadIdx.x;  // this thread's first 8-weight group of a row
    for (int row = blockIdx.y; row < p.n; row += gridDim.y) {
        const u8* w = p.w + (i64)row * p.w_row_bytes;
        Raw8 wr[DQ_GROUPS];
#pragma unroll
        for (int i = 0; i < DQ_GROUPS; ++i) {
            const int kk = (c0 + i * NT) * 8;
            const bool ok = kk < p.k;
#if WREPACK
            load_raw8_rp(w, p.k / 32, kk / 32, kk % 32, ok, wr[i]);
#else
            load_raw8(w + (i64)(kk / 32) * BLOCK_BYTES, kk % 32, ok, wr[i]);
#endif
        }
        if (row == blockIdx.y) pdl_enter();  // y may still be read by the previous kernel (the last chunk's GEMM)
#pragma unroll
        for (int i = 0; i < DQ_GROUPS; ++i) {
            const int kk = (c0 + i * NT) * 8;
            if (kk < p.k) *reinterpret_cast<uint4*>(p.y + (i64)row * p.y_stride + kk) = convert_raw8(wr[i], kk % 32);
        }
    }
}
