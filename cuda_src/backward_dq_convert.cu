// dQ of the fused backward: dq = scale * dq_accum, the fp32 sums the dK/dV kernel added with
// atomics, stored in the gradient dtype.
#include "common/dtypes.cuh"
#include "common/params.cuh"

namespace cuattn {

/// \brief One warp per query row (batch, row, head), rows in that order; 8 warps per CTA.
template <typename T>
__global__ void __launch_bounds__(256) backward_dq_convert_kernel(const __grid_constant__ BackwardParams p) {
  const AttnParams& a = p.attn;
  const i64 rows = i64(a.batch) * a.seqlen_q * a.heads_q;
  const i64 row = i64(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int head = row % a.heads_q;
  const int i = (row / a.heads_q) % a.seqlen_q;
  const int batch = row / (i64(a.heads_q) * a.seqlen_q);
  const float* src = p.dq_accum + row * a.head_dim;
  T* dst = static_cast<T*>(p.dq) + batch * p.dq_strides[0] + i * p.dq_strides[1] + head * p.dq_strides[2];
  for (int c = 2 * lane; c < a.head_dim; c += 64) {
    *reinterpret_cast<u32*>(dst + c) = pack2<T>(src[c] * a.scale, src[c + 1] * a.scale);
  }
}

}  // namespace cuattn
