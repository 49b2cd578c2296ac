// Named barriers (bar.sync / bar.arrive): a barrier over some warps of a CTA. With arrive on one
// side and sync on the other they hand work from producer warps to consumer warps without
// stopping the producers.
#pragma once

namespace cuattn {

// Waits at barrier `id` (1..15; 0 is __syncthreads) until `threads` threads (a multiple of 32,
// the arriving ones included) have reached it.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts this warp at barrier `id` without waiting; orders its earlier memory accesses before
// the release of the warps that sync there.
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// The CTA's barrier 0 in its non-aligned form: for threads that reach it from different
// instructions (warpgroups running different instantiations of one loop). __syncthreads and
// bar.sync are barrier.sync.aligned, undefined unless every thread executes the same one.
__device__ __forceinline__ void cta_barrier_unaligned() { asm volatile("barrier.sync 0;\n" ::: "memory"); }

}  // namespace cuattn
