// The last step of a split decode (decode.cu): each row's fp32 partials (normalized out, lse),
// one per key split, merged by their lse into out (the input dtype) and lse. One warp per row.
#include "common/dtypes.cuh"
#include "common/params.cuh"

namespace cuattn {

constexpr int kCombineWarps = 8;

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kCombineWarps * 32) decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  constexpr int kCols = (HEAD_DIM + 31) / 32;
  const int lane = threadIdx.x % 32;
  const i64 row = i64(blockIdx.x) * kCombineWarps + threadIdx.x / 32;  // (seq, token, head)
  const i64 rows = i64(p.batch) * p.seqlen_q * p.heads_q;
  if (row >= rows) return;
  const int head = int(row % p.heads_q), token = int(row / p.heads_q % p.seqlen_q), seq = int(row / p.heads_q / p.seqlen_q);
  const i64 lse_at = (i64(seq) * p.heads_q + head) * p.seqlen_q + token, lse_split = i64(p.batch) * p.heads_q * p.seqlen_q;

  float shift = neg_inf();
  for (int s = 0; s < p.num_splits; ++s) shift = fmaxf(shift, p.partial_lse[s * lse_split + lse_at]);
  float o[kCols] = {}, l = 0.f;
  if (shift != neg_inf()) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float w = expf(p.partial_lse[s * lse_split + lse_at] - shift);
      if (w == 0.f) continue;
      l += w;
      const float* part = p.partial_out + (s * rows + row) * p.head_dim;
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int c = i * 32 + lane;
        if (c < p.head_dim) o[i] += w * part[c];
      }
    }
  }
  T* out = static_cast<T*>(p.out) + seq * p.out_strides[0] + token * p.out_strides[1] + head * p.out_strides[2];
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    const int c = i * 32 + lane;
    if (c < p.head_dim) out[c] = from_float<T>(l > 0.f ? o[i] / l : 0.f);
  }
  if (lane == 0 && p.lse != nullptr) p.lse[seq * p.lse_strides[0] + head * p.lse_strides[1] + token] = l > 0.f ? shift + logf(l) : neg_inf();
}

}  // namespace cuattn
