// Sums of partial results in fp32: schedules that visit the keys in pieces (cuattn/chunked.py,
// cuattn/dist/ring.py) get one dQ (or dK / dV) per piece in the input type and add them here,
// so that the total is rounded to that type once, by the launch that writes out.
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

constexpr int kSumThreads = 256;

/// \brief SumParams over runs of elements, 8 elements per thread per step; the grid strides
/// over the whole (outer x inner) range. TO: the output type. out's rows (row_elems elements,
/// a multiple of 8) may lie out_row_stride apart; piece's and sum's are contiguous.
template <typename T, typename TO>
__global__ void __launch_bounds__(kSumThreads) sum_partials_kernel(const __grid_constant__ SumParams p) {
  constexpr int kVec = 8;
  const T* piece = static_cast<const T*>(p.piece);
  const i64 total = p.outer * p.inner;
  for (i64 i = (i64(blockIdx.x) * kSumThreads + threadIdx.x) * kVec; i < total; i += i64(gridDim.x) * kSumThreads * kVec) {
    const i64 run = i / p.inner, at = i % p.inner;
    float x[kVec] = {};
    if (piece != nullptr) load_floats<T, kVec>(piece + run * p.piece_stride + at, x);
    float* sum = p.sum + run * p.sum_stride + at;
    if (!p.fresh) {
#pragma unroll
      for (int j = 0; j < kVec; j += 4) {
        const float4 s = *reinterpret_cast<const float4*>(sum + j);
        x[j] += s.x, x[j + 1] += s.y, x[j + 2] += s.z, x[j + 3] += s.w;
      }
    }
    if (p.out != nullptr) {
      const i64 row = at / p.row_elems;
      TO* dst = static_cast<TO*>(p.out) + run * p.out_stride + row * p.out_row_stride + (at - row * p.row_elems);
      store_floats_by_16_bytes<TO, kVec>(dst, x);  // out (a caller's gradient) is 16-byte aligned, not 32
    } else {
#pragma unroll
      for (int j = 0; j < kVec; j += 4) *reinterpret_cast<float4*>(sum + j) = make_float4(x[j], x[j + 1], x[j + 2], x[j + 3]);
    }
  }
}

}  // namespace cuattn
