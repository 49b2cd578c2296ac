// Pieces of the float32 backward on the CUDA cores (backward_fp32_dq, backward_fp32_dkdv). Each
// warp owns 4 resident rows; a lane takes one row of every 32-row streamed tile. Streamed tiles
// sit in shared memory padded by one float, so that lanes reading different rows hit different
// banks. Dot products accumulate in fp64, as in forward_fp32, so that large scores keep fp32
// accuracy in the recomputed probabilities.
#pragma once
#include "../common/dtypes.cuh"
#include "../common/fp64_exponent.cuh"

namespace cuattn {

constexpr int kF32BwdRowsPerWarp = 4;
constexpr int kF32BwdWarps = 4;
constexpr int kF32BwdBlock = kF32BwdRowsPerWarp * kF32BwdWarps;  // resident rows per CTA
constexpr int kF32BwdTile = 32;                                   // streamed rows per step

// Rows [row0, row0 + 32) of one head's (seqlen, head_dim) slice into a padded shared tile (row
// stride HEAD_DIM + 1); rows past seqlen and columns past head_dim read as zero.
template <int HEAD_DIM>
__device__ __forceinline__ void load_f32_tile(float* dst, const float* src, i64 row_stride, int row0, int seqlen, int head_dim) {
  for (int i = threadIdx.x; i < kF32BwdTile * HEAD_DIM; i += kF32BwdWarps * 32) {
    const int r = i / HEAD_DIM, c = i % HEAD_DIM;
    dst[r * (HEAD_DIM + 1) + c] = (row0 + r < seqlen && c < head_dim) ? src[(row0 + r) * row_stride + c] : 0.f;
  }
}

__device__ __forceinline__ double dot_f64(const float* a, const float* b, int n) {
  double dot = 0.0;
#pragma unroll 8
  for (int c = 0; c < n; ++c) dot = fma(double(a[c]), double(b[c]), dot);
  return dot;
}

// The softcapped score and d(capped)/d(raw) / scale, as in forward_fp32 and apply_softcap.
__device__ __forceinline__ float softcap_score(float s, float scale, float softcap, float& cap_grad) {
  const float th = tanhf(s * (scale / softcap));
  cap_grad = 1.f - th * th;
  return softcap * th;
}

}  // namespace cuattn
