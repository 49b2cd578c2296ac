// Vectorized global loads and stores of VEC elements converted to / from float.
#pragma once
#include "dtypes.cuh"

namespace cuattn {

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec { T v[VEC]; };

template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* src, float (&dst)[VEC]) {
  const Vec<T, VEC> raw = *reinterpret_cast<const Vec<T, VEC>*>(src);
#pragma unroll
  for (int i = 0; i < VEC; ++i) dst[i] = to_float(raw.v[i]);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_floats(T* dst, const float (&src)[VEC]) {
  Vec<T, VEC> raw;
#pragma unroll
  for (int i = 0; i < VEC; ++i) raw.v[i] = from_float<T>(src[i]);
  *reinterpret_cast<Vec<T, VEC>*>(dst) = raw;
}

}  // namespace cuattn
