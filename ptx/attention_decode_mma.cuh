// attention_decode_mma.cuh: attn_decode's per-warp work on tensor cores (SM80+, GROUP <= 8, HEAD_DIM % 64 == 0):
// a split's 16-key tiles through mma.m16n8k16 (fp16 x fp16 -> fp32) with an online softmax. Part of
// attention_decode.cu, which includes it after DecodeParams, its macros (NUM_WARPS, HEAD_DIM, GROUP, ATTN_MMA) and
// lse_weight; not a standalone header.
#pragma once
#if ATTN_MMA
// One warp's share of a split on tensor cores: 16-key tiles w, w + NUM_WARPS, ... of the split's n keys. Lane
// (gid = lane / 4, tig = lane % 4). Online softmax (Milakov & Gimelshein 2018) per head, fp32 state.
//  S = K q^T: M = 16 keys (rows gid, gid + 8 are keys gid, gid + 8), N = 8 heads (GROUP <= 8, padded with q = 0),
//    k = HEAD_DIM in 16-wide steps; k slots are a permutation of the dims (a dot product is order-free): at step s
//    slots (2tig, 2tig+1, 2tig+8, 2tig+9) hold dims 32 (s / 2) + 8 tig + 4 (s % 2) + (0..3), so the 4 lanes of a
//    key load 64 contiguous bytes of its row per 16-byte vector, and each lane its q words (from smem) per step.
//  O^T += V^T P^T: M = 16 dims per tile, N = 8 heads, k = the tile's 16 keys, slots (2tig, 2tig+1, 2tig+8,
//    2tig+9) = keys 4tig + (0..3); tile (c, j) rows gid / gid + 8 = dims 64c + 8gid + 2j / + 1, so each lane
//    loads 8-dim vectors of its 4 keys and pairs them across keys with prmt. P goes through 256 bytes of smem
//    per warp (fp16, as the MMA takes it) from the S layout (keys by gid) to the B layout (keys by tig).
// Writes the warp's un-normalised output, running max and sum for the group's heads to red / ml.
#define MMA_KVEC (HEAD_DIM / 32)  // 16-byte K vectors per lane and key row
#define MMA_VSETS (HEAD_DIM / 64) // 16-byte V vectors per lane and key

// The cache rows of a 16-key tile at t0 in warp_attend_mma's fragment layout: K of keys t0 + gid (+ 8), V of keys
// t0 + 4 tig + (0..3); keys >= n and key `skip` (the split's newest: mma_newest_key loads it) are zero.
template <typename KeyOff>
VOLT_DEVICE void mma_load_tile(const DecodeParams& p, const half_t* k_head, const KeyOff& key_off, int t0, int n,
                               int skip, int lane, uint4 (&kr)[2][MMA_KVEC], uint4 (&vr)[4][MMA_VSETS]) {
    const int gid = lane >> 2, tig = lane & 3;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = t0 + gid + 8 * r;
        const half_t* kp = t < n && t != skip ? k_head + key_off(t) + 8 * tig : nullptr;
#pragma unroll
        for (int v = 0; v < MMA_KVEC; ++v) kr[r][v] = kp ? __ldg(reinterpret_cast<const uint4*>(kp + 32 * v)) : zero;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int t = t0 + 4 * tig + i;
        const half_t* vp = t < n && t != skip ? k_head + p.kv_plane + key_off(t) + 8 * gid : nullptr;
#pragma unroll
        for (int c = 0; c < MMA_VSETS; ++c) vr[i][c] = vp ? __ldg(reinterpret_cast<const uint4*>(vp + 64 * c)) : zero;
    }
}

// The split's newest key t (staged in smem kv_new [2][HEAD_DIM]) into the lanes of the tile at t0 that hold it.
VOLT_DEVICE void mma_newest_key(int t0, int t, const half_t* kv_new, int lane, uint4 (&kr)[2][MMA_KVEC],
                                uint4 (&vr)[4][MMA_VSETS]) {
    const int gid = lane >> 2, tig = lane & 3;
#pragma unroll
    for (int r = 0; r < 2; ++r)
        if (t0 + gid + 8 * r == t) {
#pragma unroll
            for (int j = 0; j < MMA_KVEC; ++j) kr[r][j] = *reinterpret_cast<const uint4*>(kv_new + 32 * j + 8 * tig);
        }
#pragma unroll
    for (int i = 0; i < 4; ++i)
        if (t0 + 4 * tig + i == t) {
#pragma unroll
            for (int c = 0; c < MMA_VSETS; ++c)
                vr[i][c] = *reinterpret_cast<const uint4*>(kv_new + HEAD_DIM + 64 * c + 8 * gid);
        }
}

// q_staged: the group's q heads in smem (fp16 [GROUP][HEAD_DIM]); kr / vr: the warp's first tile (t0 = 16 warp),
// loaded by mma_load_tile before the PDL wait; t_last: the split's newest key (its rows in smem kv_new) or -1.
template <typename KeyOff>
VOLT_DEVICE void warp_attend_mma(const DecodeParams& p, const half_t* k_head, const KeyOff& key_off, int n, int warp,
                                 int lane, float* red, float* ml, const half_t* q_staged,
                                 uint4 (&kr)[2][MMA_KVEC], uint4 (&vr)[4][MMA_VSETS], int t_last,
                                 const half_t* kv_new) {
    constexpr int KSTEPS = HEAD_DIM / 16, KVEC = MMA_KVEC, VSETS = MMA_VSETS;
    __shared__ __align__(16) u32 p_s[NUM_WARPS][8][8];  // [warp][head][16 keys as fp16 pairs]
    const int gid = lane >> 2, tig = lane & 3;
    // q^T as B fragments, read from smem at each tile (registers stay free for the tile's K / V): head gid, word
    // 2 st + j = dims 32 (st / 2) + 8 tig + 4 (st % 2) + 2 j + (0, 1), one 8-byte read per k step (0 for padded heads)
    const bool real_head = gid < GROUP;
    const half_t* qh = q_staged + (real_head ? gid : 0) * HEAD_DIM + 8 * tig;
    float acc[VSETS * 4][4];
#pragma unroll
    for (int i = 0; i < VSETS * 4; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m[2] = {VOLT_NEG_INF, VOLT_NEG_INF}, l[2] = {0.f, 0.f};  // heads 2tig, 2tig + 1
    half_t* pw = reinterpret_cast<half_t*>(&p_s[warp][0][0]);
    for (int t0 = warp * 16; t0 < n; t0 += NUM_WARPS * 16) {
        if (t0 != warp * 16) mma_load_tile(p, k_head, key_off, t0, n, t_last, lane, kr, vr);
        if (t_last >= t0 && t_last < t0 + 16) mma_newest_key(t0, t_last, kv_new, lane, kr, vr);
        // S = K q^T
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int st = 0; st < KSTEPS; ++st) {
            const uint4& k0 = kr[0][st / 2];
            const uint4& k1 = kr[1][st / 2];
            const u32 a[4] = {st % 2 ? k0.z : k0.x, st % 2 ? k1.z : k1.x, st % 2 ? k0.w : k0.y, st % 2 ? k1.w : k1.y};
            const uint2 qv = real_head ? *reinterpret_cast<const uint2*>(qh + 32 * (st / 2) + 4 * (st % 2))
                                       : make_uint2(0u, 0u);
            mma_m16n8k16(sc, a, qv.x, qv.y);
        }
        // online softmax per head (2tig + e): tile max over the 16 keys (lanes with this tig), rescale, exp
        const bool ok0 = t0 + gid < n, ok1 = t0 + gid + 8 < n;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float s0 = ok0 ? sc[e] * p.scale : VOLT_NEG_INF, s1 = ok1 ? sc[2 + e] * p.scale : VOLT_NEG_INF;
            float mx = fmaxf(s0, s1);
#pragma unroll
            for (int o = 4; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float mn = fmaxf(m[e], mx);  // finite: key t0 is in the context
            const float r = lse_weight(m[e], mn);
            m[e] = mn;
            l[e] *= r;
#pragma unroll
            for (int i = 0; i < VSETS * 4; ++i) { acc[i][e] *= r; acc[i][2 + e] *= r; }
            const float p0 = __expf(s0 - mn), p1 = __expf(s1 - mn);
            l[e] += p0 + p1;
            pw[(2 * tig + e) * 16 + gid] = f2h(p0);
            pw[(2 * tig + e) * 16 + gid + 8] = f2h(p1);
        }
        __syncwarp();
        const uint2 pb = *reinterpret_cast<const uint2*>(&p_s[warp][gid][2 * tig]);  // keys 4tig..4tig+3, head gid
        __syncwarp();  // the next tile rewrites p_s
        // O^T += V^T P^T
#pragma unroll
        for (int c = 0; c < VSETS; ++c) {
            const u32 w0[4] = {vr[0][c].x, vr[0][c].y, vr[0][c].z, vr[0][c].w};
            const u32 w1[4] = {vr[1][c].x, vr[1][c].y, vr[1][c].z, vr[1][c].w};
            const u32 w2[4] = {vr[2][c].x, vr[2][c].y, vr[2][c].z, vr[2][c].w};
            const u32 w3[4] = {vr[3][c].x, vr[3][c].y, vr[3][c].z, vr[3][c].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 a[4] = {prmt(w0[j], w1[j], 0x5410), prmt(w0[j], w1[j], 0x7632), prmt(w2[j], w3[j], 0x5410),
                                  prmt(w2[j], w3[j], 0x7632)};
                mma_m16n8k16(acc[c * 4 + j], a, pb.x, pb.y);
            }
        }
    }
    // the row sums: each lane holds its keys' share; add the 8 lanes of this tig
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) l[e] += __shfl_xor_sync(0xffffffffu, l[e], o);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int h = 2 * tig + e;
        if (h >= GROUP) continue;
        float* out = red + (warp * GROUP + h) * HEAD_DIM;
#pragma unroll
        for (int c = 0; c < VSETS; ++c)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                out[64 * c + 8 * gid + 2 * j] = acc[c * 4 + j][e];
                out[64 * c + 8 * gid + 2 * j + 1] = acc[c * 4 + j][2 + e];
            }
        if (gid == 0) { ml[(warp * GROUP + h) * 2] = m[e]; ml[(warp * GROUP + h) * 2 + 1] = l[e]; }
    }
}
#endif
