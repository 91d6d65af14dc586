// tma.cuh: the SM90+ pieces of a shared-memory ring fed by bulk asynchronous copies (cp.async.bulk, "TMA",
// PTX ISA 8.0) and tracked by mbarriers: what gemv_tma.cu and gemv_tma_s8.cu share. Each helper but ring_init is
// one PTX instruction (or a wait loop on one); defined on SM90+ only, where the callers guard their use.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
VOLT_DEVICE void mbar_init(unsigned long long* bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Arm `bar` for `bytes` of bulk copies (this thread's arrival counts as the phase's one expected arrival).
VOLT_DEVICE void mbar_expect_tx(unsigned long long* bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

// One arrival on `bar` (a consumer's release of its slot).
VOLT_DEVICE void mbar_arrive(unsigned long long* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) over the first `threads` threads of the block.
VOLT_DEVICE void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Wait until `bar`'s phase of parity `parity` has completed (its bytes landed in smem).
VOLT_DEVICE void mbar_wait(unsigned long long* bar, u32 parity) {
    u32 done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}" : "=r"(done) : "r"(smem_u32(bar)), "r"(parity) : "memory");
    } while (!done);
}

// One bulk copy global -> smem of `bytes` (16-byte multiple, both addresses 16-byte aligned), completing on `bar`.
VOLT_DEVICE void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar)) : "memory");
}
// Thread 0 of the block: `ring` pairs of mbarriers, full[s] expecting the producer's one arrival (+ the stage's
// bytes) and empty[s] `consumers` arrivals, made visible to the async proxy; the caller syncs the block after.
VOLT_DEVICE void ring_init(unsigned long long* full, unsigned long long* empty, int ring, u32 consumers) {
    if (threadIdx.x != 0) return;
    for (int s = 0; s < ring; ++s) {
        mbar_init(&full[s], 1);
        mbar_init(&empty[s], consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
#endif
