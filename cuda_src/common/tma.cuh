// Hopper (sm_90) tensor-memory-accelerator tile loads and the mbarriers that track them.
//
// A TMA load copies one box of a tensor (described by a CUtensorMap the host encodes,
// cuattn/tensor_map.py) into shared memory from a single thread, writing the 128-byte swizzle of
// common/wgmma.cuh itself and zero-filling what lies outside the tensor. Its completion is
// counted in bytes on an mbarrier: the issuing thread announces the bytes (expect_tx), the copy
// signals them as they land, and the barrier's phase flips once every expected arrival and byte
// is in. Waiters wait on a phase's parity; a freshly initialized barrier counts as having
// completed the phase of parity 1, so a first wait on parity 1 returns at once.
#pragma once
#include "mma.cuh"
#include "params.cuh"

namespace cuattn {

__device__ __forceinline__ void mbarrier_init(u64* bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// Makes initialized barriers visible to the async proxy (the TMA unit); then a CTA barrier.
__device__ __forceinline__ void mbarrier_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// One arrival that also announces `bytes` of TMA traffic for the current phase.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(u64* bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// Announces `bytes` of TMA traffic for the current phase without arriving (the phase then also
// waits for the arrivals the barrier was initialized with).
__device__ __forceinline__ void mbarrier_expect_bytes(u64* bar, u32 bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Blocks until the phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(u64* bar, u32 parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}
// The box of a 4-D tensor map at coordinates (c0 innermost) into dst (1024-byte aligned for the
// 128-byte swizzle), its bytes counted on bar. `map` must live in kernel parameter space
// (a __grid_constant__ parameter).
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, u64* bar, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<u64>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// Warp specialization: a warpgroup lowers (dec) or raises (inc) the registers each of its threads
// holds, so that producers hand theirs to consumers. Every thread of the warpgroup executes it.
template <int REGISTERS>
__device__ __forceinline__ void set_max_registers_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}
template <int REGISTERS>
__device__ __forceinline__ void set_max_registers_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS));
}

}  // namespace cuattn
