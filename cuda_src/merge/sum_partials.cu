// Sums of partial gradients in fp32: schedules that visit the keys in pieces (cuattn/chunked.py)
// get one dQ per piece in the input type and add them here, so that the total is rounded to
// that type once, by the launch that adds the last piece.
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

constexpr int kSumThreads = 256;

/// \brief One piece of SumParams, 8 elements per thread per step; the grid strides.
template <typename T>
__global__ void __launch_bounds__(kSumThreads) sum_partials_kernel(const __grid_constant__ SumParams p) {
  constexpr int kVec = 8;
  const T* piece = static_cast<const T*>(p.piece);
  for (i64 i = (i64(blockIdx.x) * kSumThreads + threadIdx.x) * kVec; i < p.count; i += i64(gridDim.x) * kSumThreads * kVec) {
    float x[kVec];
    load_floats<T, kVec>(piece + i, x);
    if (!p.fresh) {
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        const float4 s = *reinterpret_cast<const float4*>(p.sum + i + j);
        x[j] += s.x, x[j + 1] += s.y, x[j + 2] += s.z, x[j + 3] += s.w;
      }
    }
    if (p.out != nullptr) {
      store_floats<T, kVec>(static_cast<T*>(p.out) + i, x);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; j += 4) *reinterpret_cast<float4*>(p.sum + i + j) = make_float4(x[j], x[j + 1], x[j + 2], x[j + 3]);
    }
  }
}

}  // namespace cuattn
