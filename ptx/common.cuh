// common.cuh: helpers shared by every voltserve kernel (fp16 <-> fp32, vector loads, warp/block reductions).
//
// Kernels are header-free on purpose: fp16 is stored as raw 16-bit words (`half_t`) and converted with PTX
// `cvt` instructions (SM53+), so NVRTC needs no CUDA include directory and a CUDA 12 / CUDA 13 header mix-up
// cannot happen. All arithmetic is fp32 (the SM70 rule: fp16 storage, fp32 accumulate).
#pragma once

typedef unsigned short half_t;            // IEEE fp16 bits
typedef unsigned char u8;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// weight formats (kernels.WTYPES): quant.cuh's compile-time WTYPE, s8_xq.cuh's run-time format
#define WTYPE_F16 0
#define WTYPE_Q4_0 1
#define WTYPE_Q4_1 2
#define WTYPE_Q8_0 3

#define VOLT_DEVICE __device__ __forceinline__
#define VOLT_NEG_INF (-__int_as_float(0x7f800000))

VOLT_DEVICE float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

VOLT_DEVICE half_t f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Round-trip through fp16 (what a torch fp16 op does between two steps).
VOLT_DEVICE float round_h(float f) { return h2f(f2h(f)); }
// Element i of an fp16 (f16) or fp32 array as fp32: the sampler kernels' logits, whose dtype a build fixes.
VOLT_DEVICE float load_f16_or_f32(const void* data, i64 i, bool f16) {
    return f16 ? h2f(reinterpret_cast<const half_t*>(data)[i]) : reinterpret_cast<const float*>(data)[i];
}

// Two packed fp16 values of one 32-bit word.
VOLT_DEVICE void unpack2(u32 w, float& lo, float& hi) {
    lo = h2f((half_t)(w & 0xffffu));
    hi = h2f((half_t)(w >> 16));
}

VOLT_DEVICE u32 pack2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }

// The 8 packed fp16 values of one 16-byte vector -> fp32.
VOLT_DEVICE void unpack8(const uint4& v, float* out) {
    unpack2(v.x, out[0], out[1]);
    unpack2(v.y, out[2], out[3]);
    unpack2(v.z, out[4], out[5]);
    unpack2(v.w, out[6], out[7]);
}

// 8 fp16 values (one 16-byte vector) -> fp32. p must be 16-byte aligned.
VOLT_DEVICE void load8(const half_t* p, float* out) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    unpack8(v, out);
}

// 8 fp32 values -> one 16-byte vector of packed fp16.
VOLT_DEVICE uint4 pack8(const float* in) {
    uint4 v;
    v.x = pack2(in[0], in[1]);
    v.y = pack2(in[2], in[3]);
    v.z = pack2(in[4], in[5]);
    v.w = pack2(in[6], in[7]);
    return v;
}

// RMSNorm's output of 8 elements: fp16(s * inv_rms * w), in rms_norm's order ((s * inv) * w); s packed fp16,
// w the 8 fp32 norm weights as two float4s. rms_norm and gemv's fused-norm prologue store the same values.
VOLT_DEVICE uint4 norm_scale8(const uint4& sv, float inv_rms, const float4& w0, const float4& w1) {
    float s[8];
    unpack8(sv, s);
    const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) s[e] = s[e] * inv_rms * w[e];
    return pack8(s);
}

// The 32-bit shared-state-space address of a generic pointer into shared memory (for PTX that takes one).
VOLT_DEVICE u32 smem_u32(const void* p) {
    u32 s;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
    return s;
}

VOLT_DEVICE float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

VOLT_DEVICE float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum for blockDim.x a multiple of 32 (<= 1024); every thread gets the result.
// `scratch` holds >= 32 floats of shared memory; the call syncs twice so scratch can be reused after.
VOLT_DEVICE float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : 0.f;
    v = warp_sum(v);
    __syncthreads();
    return v;
}

VOLT_DEVICE float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < num_warps ? scratch[lane] : VOLT_NEG_INF;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// Programmatic dependent launch (PDL, SM90+). The launcher sets CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
// on SM90+, so a kernel may start while the previous one in the stream still runs. Contract of every kernel here:
// call pdl_enter() before the first read of anything an earlier kernel wrote and before the first global write
// (only constant data such as weights, and the step's metadata that a host copy uploads before the step's first
// kernel, may be touched before it, e.g. prefetched into L2). pdl_enter waits until
// the previous grid has completed and its writes are visible, then lets the next grid launch, so at most two
// grids overlap and a chain of waits orders every kernel after all earlier ones. Below SM90, and for a launch
// without the attribute, both instructions are no-ops (PTX ISA 7.8 griddepcontrol).
VOLT_DEVICE void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Prefetch the 128-byte lines of [p, p + bytes) into L2, `stride` threads from index `tid` (SM90+ only: below,
// without PDL overlap, it would only add instructions). For constant data read before pdl_enter().
VOLT_DEVICE void prefetch_l2(const void* p, i64 bytes, int tid, int stride) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const char* c = reinterpret_cast<const char*>(p);
    for (i64 off = (i64)tid * 128; off < bytes; off += (i64)stride * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
#endif
}

// Split-K arrival by thread 0 after a __syncthreads that follows every thread's partial stores: *counter += 1
// with acquire-release semantics at GPU scope; returns the old value. The release (cumulative over the block's
// stores ordered before it by the barrier) publishes this block's partials; the acquire, with a barrier after it,
// makes the other blocks' partials visible to this block (PTX ISA, memory consistency model: release and
// acquire patterns). Replaces a __threadfence (fence.sc.gpu) in every thread on both sides.
VOLT_DEVICE int arrive_acq_rel(int* counter) {
    int old;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
    return old;
}

// Params structs are checked against their Python ctypes mirror: the launcher passes
// -DVOLT_<NAME>_BYTES=<ctypes.sizeof(mirror)>, so a drifting layout fails to compile (even on CI).
#define VOLT_CHECK_PARAMS(T, BYTES) static_assert(sizeof(T) == (BYTES), #T " drifted from its Python mirror")
