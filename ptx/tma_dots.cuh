// tma_dots.cuh: the fp16 ring GEMVs' shared pieces (gemv_tma.cu, gemv_chain.cu): the span geometry of their
// stages and the tensor-core dot products of one stage with x, so both kernels sum every output the same way
// (bit for bit equal outputs).
#pragma once
#include "mma.cuh"
#include "tma.cuh"

#define TMA_SPAN_HALVES 1024                       // a warp's unit of work: 4 x 16 bytes a lane, one warp sum
#define TMA_SPAN_BYTES (TMA_SPAN_HALVES * 2)
#define TMA_MAX_STAGES 32
#define TMA_STAGE_SPANS 4                          // most spans per stage (p.stage_spans <= it)

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The dot products of a stage's spans with x, one per span, by one warp: raw[sp][j] is the lane's 16 bytes
// (halves 8 lane + 0..7) of chunk j (256 halves) of span sp, zero past the stage's spans (those MMAs multiply
// zeros and the caller does not store them: with a 2-span ring half the MMAs), xcol[sp] the x offset of that
// span's lane slice. Per chunk, two mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane (g = lane
// / 4, t = lane % 4) gives B column g its weights 0..3 (the second MMA: 4..7) at k = 2t, 2t + 1, 2t + 8, 2t + 9
// and A row g its x values at the same positions (rows 8-15 zero), so D[g][g] = lanes 4g .. 4g + 3's products
// and the diagonal sums the chunk (the off-diagonal products are not used). dot[sp]: this lane's diagonal entry
// of span sp, accumulated in fp32 over its 4 chunks (0 on the other lanes), for one warp sum by the caller: the
// same order wherever the span is read. The spans are independent accumulator chains, interleaved per chunk.
VOLT_DEVICE void tma_span_dots(const uint4 (&raw)[TMA_STAGE_SPANS][4], const half_t* xh,
                               const int (&xcol)[TMA_STAGE_SPANS], float (&dot)[TMA_STAGE_SPANS]) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
    float d[TMA_STAGE_SPANS][4];
#pragma unroll
    for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp)
#pragma unroll
        for (int e = 0; e < 4; ++e) d[sp][e] = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp) {
            const uint4 xa = *reinterpret_cast<const uint4*>(xh + xcol[sp] + j * 256);
            const u32 a0[4] = {xa.x, 0u, xa.y, 0u}, a1[4] = {xa.z, 0u, xa.w, 0u};
            mma_m16n8k16(d[sp], a0, raw[sp][j].x, raw[sp][j].y);
            mma_m16n8k16(d[sp], a1, raw[sp][j].z, raw[sp][j].w);
        }
    const bool diag = (lane & 3) == (g >> 1);  // this lane holds D[g][g]: accumulator 1 for odd g, else 0
#pragma unroll
    for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp) dot[sp] = diag ? ((g & 1) ? d[sp][1] : d[sp][0]) : 0.f;
}
// One consumer warp's whole stage: its num_sp (<= TMA_STAGE_SPANS) spans, `offset` bytes into a segment of rows
// of `spans` spans, read from the ring slot at `slot_base` into registers (16 x 16 bytes a lane), the slot handed
// back on `empty` at once (it is held for one smem round trip, not for the products), then each span's dot product
// with x (fp16 in smem) stored by lane 0 to partial[(row_base + row) * spans + span of the row] (fixed-order sums
// later; row_base: where the segment's rows start in the partials).
VOLT_DEVICE void tma_read_stage(const u8* slot_base, unsigned long long* empty, int num_sp, i64 offset, int spans,
                                const half_t* xh, float* partial, int row_base) {
    const int lane = threadIdx.x & 31;
    const u8* stage = slot_base + lane * 16;
    uint4 raw[TMA_STAGE_SPANS][4];
#pragma unroll
    for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            raw[sp][j] = sp < num_sp ? *reinterpret_cast<const uint4*>(stage + sp * TMA_SPAN_BYTES + j * 512)
                                     : make_uint4(0u, 0u, 0u, 0u);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty);  // release: orders the warp's reads before the refill
    const int first = (int)(offset / TMA_SPAN_BYTES);  // the stage's first span in its segment
    const int row0 = first / spans, sp0 = first - row0 * spans;
    int xcol[TMA_STAGE_SPANS];
#pragma unroll
    for (int sp = 0, c = sp0; sp < TMA_STAGE_SPANS; ++sp, c = c + 1 == spans ? 0 : c + 1)
        xcol[sp] = c * TMA_SPAN_HALVES + lane * 8;
    float dot[TMA_STAGE_SPANS];
    tma_span_dots(raw, xh, xcol, dot);
#pragma unroll
    for (int sp = 0; sp < TMA_STAGE_SPANS; ++sp) {
        const int t = sp0 + sp, row = row0 + t / spans;
        const float v = warp_sum(dot[sp]);
        if (lane == 0 && sp < num_sp) partial[(row_base + row) * spans + t % spans] = v;
    }
}
#endif
