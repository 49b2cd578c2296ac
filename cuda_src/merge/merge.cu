// Merge of partial attention results (out_i, lse_i) over disjoint key sets:
//   lse = log(sum_i exp(lse_i)),  out = sum_i exp(lse_i - lse) * out_i.
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

constexpr int kMergeThreads = 256;

/// \brief Merges num_partials (<= CAP) partial results of type T into dst of type TOut (float
/// where a merge of more than 16 partials keeps a group's result unrounded for the next). Each row (b, s, h) is handled
/// by a group of lanes of one warp (the power of two <= 32 that covers head_dim / VEC), each
/// lane VEC contiguous elements; each group takes ROWS rows at a time and the grid strides
/// over them. Memory-bound, so what counts is the bytes in flight: every load of a step (the
/// rows' lses and the first BATCH partials' values) is issued before any is used, one memory
/// latency per step rather than one for the lses and another for the values. A partial with
/// lse = -inf gets weight 0 and its values are dropped by a select, so NaN or garbage there
/// never reaches dst. dst may alias partial 0 (in-place accumulation): each lane reads its
/// columns before writing them.
template <typename T, typename TOut, int VEC, int CAP, int ROWS>
__global__ void __launch_bounds__(kMergeThreads, CAP < 16 ? 2 : 1) merge_kernel(const __grid_constant__ MergeParams p) {
  constexpr int BATCH = CAP < 8 ? CAP : 8;  // partials whose values are held at once
  int group = 1;
  while (group < 32 && group * VEC < p.head_dim) group *= 2;
  const int rows_per_warp = 32 / group * ROWS;
  const int lane = threadIdx.x % 32;
  const int member = lane % group;
  const int warps_in_grid = gridDim.x * (blockDim.x / 32);
  const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const i64 rows = i64(p.batch) * p.seqlen * p.heads;
  const int first_col = member * VEC;

  // The trip count is uniform per warp so that every lane reaches the __syncwarp below.
  for (i64 base = i64(warp) * rows_per_warp; base < rows; base += i64(warps_in_grid) * rows_per_warp) {
    bool valid[ROWS];
    int b[ROWS], s[ROWS], h[ROWS];
    float weight[ROWS][CAP];
    Words<T, VEC> raw[ROWS][BATCH];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const i64 row = base + r * (32 / group) + lane / group;
      valid[r] = row < rows;
      h[r] = valid[r] ? int(row % p.heads) : 0;
      s[r] = valid[r] ? int((row / p.heads) % p.seqlen) : 0;
      b[r] = valid[r] ? int(row / (i64(p.heads) * p.seqlen)) : 0;
#pragma unroll
      for (int i = 0; i < CAP; ++i) {
        weight[r][i] = neg_inf();  // the lse until the weights are formed
        if (i < p.num_partials && valid[r]) weight[r][i] = p.lses[i][b[r] * p.lse_strides[i][0] + h[r] * p.lse_strides[i][1] + s[r] * p.lse_strides[i][2]];
      }
    }
    auto load_batch = [&](int r, int first, int col) {
#pragma unroll
      for (int j = 0; j < BATCH; ++j) {
        const int i = first + j;
        if (i < p.num_partials && valid[r] && col < p.head_dim) {
          const T* src = static_cast<const T*>(p.outs[i]) + b[r] * p.out_strides[i][0] + s[r] * p.out_strides[i][1] + h[r] * p.out_strides[i][2];
          raw[r][j] = *reinterpret_cast<const Words<T, VEC>*>(src + col);
        }
      }
    };
#pragma unroll
    for (int r = 0; r < ROWS; ++r) load_batch(r, 0, first_col);

    float lse[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float lse_max = neg_inf();
#pragma unroll
      for (int i = 0; i < CAP; ++i) lse_max = fmaxf(lse_max, weight[r][i]);
      // All partials empty: sum stays 0 and the merged row is out = 0, lse = -inf. A partial of
      // lse +inf (scores that overflowed): shift 0 makes the sum +inf, so lse +inf and out NaN
      // (below), as the reference has it, never a row that looks empty. A partial of lse NaN
      // (which fmaxf passes over) makes the sum NaN: lse and out NaN.
      const float shift = isfinite(lse_max) ? lse_max : 0.f;
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < CAP; ++i) {
        weight[r][i] = expf(weight[r][i] - shift);
        sum += weight[r][i];
      }
      const float inv_sum = sum > 0.f ? 1.f / sum : 0.f;
#pragma unroll
      for (int i = 0; i < CAP; ++i) weight[r][i] *= inv_sum;
      lse[r] = sum > 0.f ? shift + logf(sum) : sum == 0.f ? neg_inf() : sum;
    }

#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (!valid[r]) continue;
      TOut* dst = static_cast<TOut*>(p.dst_out) + b[r] * p.dst_out_strides[0] + s[r] * p.dst_out_strides[1] + h[r] * p.dst_out_strides[2];
      for (int col = first_col; col < p.head_dim; col += group * VEC) {
        float acc[VEC];
        const float start = lse[r] == -neg_inf() || isnan(lse[r]) ? __int_as_float(0x7fc00000) : 0.f;  // NaN under an lse of +inf or NaN
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = start;
#pragma unroll
        for (int first = 0; first < CAP; first += BATCH) {
          if (first > 0 || col != first_col) load_batch(r, first, col);
#pragma unroll
          for (int j = 0; j < BATCH; ++j) {
            const float w = weight[r][first + j];
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[e] = w > 0.f ? fmaf(w, element(raw[r][j], e), acc[e]) : acc[e];
          }
        }
        store_floats_by_16_bytes<TOut, VEC>(dst + col, acc);
      }
    }
    // Every lane has read lse of partial 0 (which dst_lse may alias) before it is overwritten.
    __syncwarp();
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      if (valid[r] && member == 0) p.dst_lse[b[r] * p.dst_lse_strides[0] + h[r] * p.dst_lse_strides[1] + s[r] * p.dst_lse_strides[2]] = lse[r];
    }
  }
}

}  // namespace cuattn
