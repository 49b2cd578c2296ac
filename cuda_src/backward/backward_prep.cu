// Backward preprocessing: delta = rowsum(dout * out) - dlse for every query row, in fp32, and
// zeros in the dQ accumulator when the fused kernel will add into one. The gradient
// kernels form dS = P * (dP - delta); the dlse term carries a gradient that flowed into lse
// (d lse / d s = P).
#include "backward/head_rows.cuh"
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

constexpr int kPrepWarps = 8;

// delta's sum: fp64 for float32 tensors, whose kernels keep fp32 accuracy by summing in fp64.
template <typename T> struct RowSum { using type = float; };
template <> struct RowSum<float> { using type = double; };

// Zeros the whole dQ accumulator of packed sequences, whose tiles a packed row does not find
// without a search (backward/dq_accum.cuh), with every thread of the grid.
__device__ __forceinline__ void zero_packed_dq_accum(const BackwardParams& p) {
  const i64 quads = i64(p.attn.heads_q) * p.dq_accum_tile_strides[1] * (p.dq_accum_cols / 64) * kDqTileFloats / 4;
  const float zeros[4] = {0.f, 0.f, 0.f, 0.f};
  for (i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x; i < quads; i += i64(gridDim.x) * blockDim.x) store_floats<float, 4>(p.dq_accum + 4 * i, zeros);
}

/// \brief A group of kRowLanes lanes per query row (GroupQueryRow: dense or packed rows);
/// HEAD_DIM is the head-dim bucket (head_dim <= HEAD_DIM).
template <typename T, int HEAD_DIM, SeqLayout LAYOUT>
__global__ void __launch_bounds__(kPrepWarps * 32) backward_prep_kernel(const __grid_constant__ BackwardParams p) {
  constexpr int kVec = sizeof(T) == 4 ? 1 : 16 / sizeof(T);  // float32 tensors carry no alignment contract
  const AttnParams& a = p.attn;
  const GroupQueryRow<kPrepWarps, LAYOUT> r(a);
  const int lane = r.lane();
  using Sum = typename RowSum<T>::type;
  Sum sum = 0;
  if (r.valid) {
    const T* out = static_cast<const T*>(a.out) + r.batch * a.out_strides[0] + r.row * a.out_strides[1] + r.head * a.out_strides[2];
    const T* dout = static_cast<const T*>(p.dout) + r.batch * p.dout_strides[0] + r.row * p.dout_strides[1] + r.head * p.dout_strides[2];
    constexpr int kSteps = (HEAD_DIM + kRowLanes * kVec - 1) / (kRowLanes * kVec);
    float o[kSteps][kVec], d[kSteps][kVec];  // every load issued before the first use
#pragma unroll
    for (int i = 0; i < kSteps; ++i) {
      const int c = (i * kRowLanes + lane) * kVec;
      if (c < a.head_dim) {
        load_floats<T, kVec>(out + c, o[i]);
        load_floats<T, kVec>(dout + c, d[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < kSteps; ++i)
      if ((i * kRowLanes + lane) * kVec < a.head_dim)
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum = fma(Sum(o[i][e]), Sum(d[i][e]), sum);
    if (LAYOUT == SeqLayout::kDense && p.dq_accum != nullptr) {
      const float zeros[4] = {0.f, 0.f, 0.f, 0.f};
      const SeqSpan span = seq_span<LAYOUT>(a, r.batch);
      for (int c = lane * 4; c < p.dq_accum_cols; c += kRowLanes * 4) store_floats<float, 4>(r.dq_accum_quad(p, r.batch, span, r.row, c), zeros);
    }
  }
  if (LAYOUT == SeqLayout::kPacked && p.dq_accum != nullptr) zero_packed_dq_accum(p);
#pragma unroll
  for (int offset = kRowLanes / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (r.valid && lane == 0) {
    if (p.dlse != nullptr) sum -= p.dlse[r.batch * p.dlse_strides[0] + r.head * p.dlse_strides[1] + r.row];
    p.delta[r.batch * p.delta_strides[0] + r.head * p.delta_strides[1] + r.row] = float(sum);
  }
}

}  // namespace cuattn
