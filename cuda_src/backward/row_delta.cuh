// delta = rowsum(dout * out) - dlse of one query row summed inside a gradient kernel, for the
// one-launch backward of small problems (backward_small.cu), which has no backward_prep pass
// before it. The sum is in fp32, as backward_prep's for 16-bit tensors.
#pragma once
#include "../common/params.cuh"
#include "../common/seq_layout.cuh"
#include "../common/vector_io.cuh"

namespace cuattn {

/// \brief delta of query row `row` of (seq, head), split over LANES consecutive lanes of a warp
/// (lane_in_row 0 .. LANES - 1, 8 columns per load); every one of them returns the sum, 0 past
/// seqlen_q. All 32 lanes of the warp must call it (the sum is shuffled). 16-bit tensors.
template <typename T, int HEAD_DIM, int LANES>
__device__ __forceinline__ float own_row_delta(const BackwardParams& p, int seq, int head, const SeqSpan& span, int row, int lane_in_row) {
  static_assert(sizeof(T) == 2 && LANES > 0 && 32 % LANES == 0, "16-bit rows, whole lane groups per warp");
  constexpr int kVec = 8;
  const AttnParams& a = p.attn;
  const bool valid = row < span.seqlen_q;
  float sum = 0.f;
  if (valid) {
    const T* out = static_cast<const T*>(a.out) + seq * a.out_strides[0] + (span.q_row0 + row) * a.out_strides[1] + head * a.out_strides[2];
    const T* dout = static_cast<const T*>(p.dout) + seq * p.dout_strides[0] + (span.q_row0 + row) * p.dout_strides[1] + head * p.dout_strides[2];
#pragma unroll
    for (int c0 = 0; c0 < HEAD_DIM; c0 += LANES * kVec) {
      const int c = c0 + lane_in_row * kVec;
      if (c < a.head_dim) {
        float o[kVec], d[kVec];
        load_floats<T, kVec>(out + c, o);
        load_floats<T, kVec>(dout + c, d);
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum = fmaf(o[e], d[e], sum);
      }
    }
  }
#pragma unroll
  for (int offset = LANES / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (valid && p.dlse != nullptr) sum -= p.dlse[seq * p.dlse_strides[0] + head * p.dlse_strides[1] + span.q_row0 + row];
  return sum;
}

}  // namespace cuattn
