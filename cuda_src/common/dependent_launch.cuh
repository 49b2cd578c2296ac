// Programmatic dependent launch (sm_90+): a kernel launched with programmatic stream
// serialization (cuattn/launch.py) may start while the kernel before it on the stream is still
// running; it must call wait_for_previous_grid() before it reads or writes memory that kernel
// touches. A kernel that lets the next one start early calls allow_next_grid(). Both are no-ops
// before sm_90 and when the launch was an ordinary one.
#pragma once

namespace cuattn {

// Returns once every earlier grid of the stream has finished and its writes are visible.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The next grid of the stream may launch once every CTA of this one has called this (or exited).
__device__ __forceinline__ void allow_next_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace cuattn
