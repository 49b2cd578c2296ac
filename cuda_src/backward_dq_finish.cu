// The last pass of the fused backward (backward_wgmma_fused.cu): dq = scale * dq_accum, from the
// fp32 accumulator's tiles (backward/dq_accum.cuh) into dq's layout and dtype.
#include "backward/head_rows.cuh"
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

constexpr int kFinishWarps = 8;

/// \brief One warp per query row (batch, row, head), rows in that order; 8 warps per CTA.
template <typename T>
__global__ void __launch_bounds__(kFinishWarps * 32) backward_dq_finish_kernel(const __grid_constant__ BackwardParams p) {
  constexpr int kVec = 2;  // the accumulator's float pairs (head_dim is even)
  const AttnParams& a = p.attn;
  WarpQueryRow<kFinishWarps> r;
  if (!r.locate(a)) return;
  T* dq = static_cast<T*>(p.dq) + r.batch * p.dq_strides[0] + r.row * p.dq_strides[1] + r.head * p.dq_strides[2];
  for (int c = (threadIdx.x % 32) * kVec; c < a.head_dim; c += 32 * kVec) {
    float x[kVec];
    load_floats<float, kVec>(r.dq_accum_pair(p, c), x);
#pragma unroll
    for (int e = 0; e < kVec; ++e) x[e] *= a.scale;
    store_floats<T, kVec>(dq + c, x);
  }
}

}  // namespace cuattn
