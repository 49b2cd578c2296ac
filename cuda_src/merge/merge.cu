// Merge of partial attention results (out_i, lse_i) over disjoint key sets:
//   lse = log(sum_i exp(lse_i)),  out = sum_i exp(lse_i - lse) * out_i.
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

constexpr int kMergeThreads = 256;

/// \brief Merges num_partials partial results into dst. Each row (b, s, h) is handled by a
/// group of lanes of one warp (the power of two <= 32 that covers head_dim / VEC), each lane
/// VEC contiguous elements at a time; the grid strides over rows. dst may alias partial 0
/// (in-place accumulation).
template <typename T, int VEC>
__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const __grid_constant__ MergeParams p) {
  int group = 1;
  while (group < 32 && group * VEC < p.head_dim) group *= 2;
  const int rows_per_warp = 32 / group;
  const int lane = threadIdx.x % 32;
  const int member = lane % group;
  const int warps_in_grid = gridDim.x * (blockDim.x / 32);
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const i64 rows = i64(p.batch) * p.seqlen * p.heads;

  // The trip count is uniform per warp so that every lane reaches the __syncwarp below.
  for (i64 base = i64(warp) * rows_per_warp; base < rows; base += i64(warps_in_grid) * rows_per_warp) {
    const i64 row = base + lane / group;
    const bool valid = row < rows;
    const int h = valid ? int(row % p.heads) : 0;
    const int s = valid ? int((row / p.heads) % p.seqlen) : 0;
    const int b = valid ? int(row / (i64(p.heads) * p.seqlen)) : 0;

    float lse_max = neg_inf();
    for (int i = 0; i < p.num_partials && valid; ++i) {
      const float l = p.lses[i][b * p.lse_strides[i][0] + h * p.lse_strides[i][1] + s * p.lse_strides[i][2]];
      lse_max = fmaxf(lse_max, l);
    }
    // All partials empty: sum stays 0 and the merged row is out = 0, lse = -inf.
    const float shift = lse_max == neg_inf() ? 0.f : lse_max;
    float weights[kMaxMergePartials];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxMergePartials; ++i) {
      weights[i] = 0.f;
      if (i < p.num_partials && valid) {
        const float l = p.lses[i][b * p.lse_strides[i][0] + h * p.lse_strides[i][1] + s * p.lse_strides[i][2]];
        weights[i] = expf(l - shift);
        sum += weights[i];
      }
    }
    const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;

    if (valid) {
      T* dst = static_cast<T*>(p.dst_out) + b * p.dst_out_strides[0] + s * p.dst_out_strides[1] + h * p.dst_out_strides[2];
      for (int col = member * VEC; col < p.head_dim; col += group * VEC) {
        float acc[VEC];
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxMergePartials; ++i) {
          if (weights[i] == 0.f) continue;  // empty partials are never read
          const T* src = static_cast<const T*>(p.outs[i]) + b * p.out_strides[i][0] + s * p.out_strides[i][1] + h * p.out_strides[i][2];
          float x[VEC];
          load_floats<T, VEC>(src + col, x);
          const float w = weights[i] * inv_sum;
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[e] = fmaf(w, x[e], acc[e]);
        }
        store_floats<T, VEC>(dst + col, acc);
      }
    }
    // Every lane has read lse of partial 0 (which dst_lse may alias) before it is overwritten.
    __syncwarp();
    if (valid && member == 0) {
      p.dst_lse[b * p.dst_lse_strides[0] + h * p.dst_lse_strides[1] + s * p.dst_lse_strides[2]] =
          sum > 0.f ? shift + logf(sum) : neg_inf();
    }
  }
}

}  // namespace cuattn
