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

/// store_floats in pieces of at most 16 bytes, for destinations aligned to no more than that
/// (a wider vector, 8 floats, compiles to one 32-byte store on sm_100 and later).
template <typename T, int VEC>
__device__ __forceinline__ void store_floats_by_16_bytes(T* dst, const float (&src)[VEC]) {
  constexpr int kPiece = VEC * sizeof(T) > 16 ? 16 / int(sizeof(T)) : VEC;
#pragma unroll
  for (int i = 0; i < VEC; i += kPiece) store_floats<T, kPiece>(dst + i, *reinterpret_cast<const float(*)[kPiece]>(src + i));
}

/// VEC elements held as the 32-bit words they were loaded in (16-bit types two to a word), so
/// that values waiting in registers take no more registers than their bytes; element types
/// narrower than a word at an odd count are held as they are.
template <typename T, int VEC, bool WHOLE_WORDS = (VEC * sizeof(T)) % 4 == 0>
struct Words;
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Words<T, VEC, true> { u32 w[VEC * sizeof(T) / 4]; };
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Words<T, VEC, false> { T v[VEC]; };

__device__ __forceinline__ float half_of_word(bf16, u32 word, int high) {
  return __uint_as_float(high ? word & 0xffff0000u : word << 16);
}
__device__ __forceinline__ float half_of_word(f16, u32 word, int high) {
  f16 h;
  h.bits = u16(high ? word >> 16 : word & 0xffffu);
  return to_float(h);
}

template <typename T, int VEC>
__device__ __forceinline__ float element(const Words<T, VEC, true>& x, int e) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(x.w[e]);
  } else {
    return half_of_word(T{}, x.w[e / 2], e % 2);
  }
}
template <typename T, int VEC>
__device__ __forceinline__ float element(const Words<T, VEC, false>& x, int e) { return to_float(x.v[e]); }

}  // namespace cuattn
