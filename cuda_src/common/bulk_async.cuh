// Hopper (sm_90) bulk asynchronous copies (the TMA unit without a tensor map): a contiguous
// shared-memory block reduced into global memory by one thread's instruction, and the
// bulk-group waits that free its source.
#pragma once
#include "mma.cuh"
#include "named_barrier.cuh"

namespace cuattn {

// dst[0..bytes/4) += src[0..bytes/4), fp32, element-wise atomic in L2; 16-byte aligned, bytes % 16 == 0.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, const float* src, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               ::"l"(dst), "r"(smem_addr(src)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most N of this thread's bulk groups still read their shared-memory source.
template <int N>
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory"); }
// Waits until at most N of this thread's bulk groups are incomplete (writes included).
template <int N>
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory"); }

}  // namespace cuattn
