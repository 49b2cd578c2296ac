// Backward preprocessing: delta = rowsum(dout * out) - dlse for every query row, in fp32. The
// gradient kernels form dS = P * (dP - delta); the dlse term carries a gradient that flowed
// into lse (d lse / d s = P).
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

/// \brief One warp per query row (batch, row, head), rows in that order; 8 warps per CTA.
template <typename T>
__global__ void __launch_bounds__(256) backward_prep_kernel(const __grid_constant__ BackwardParams p) {
  constexpr int kVec = sizeof(T) == 4 ? 1 : 16 / sizeof(T);  // float32 tensors carry no alignment contract
  const AttnParams& a = p.attn;
  const i64 rows = i64(a.batch) * a.seqlen_q * a.heads_q;
  const i64 row = i64(blockIdx.x) * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int head = row % a.heads_q;
  const int i = (row / a.heads_q) % a.seqlen_q;
  const int batch = row / (i64(a.heads_q) * a.seqlen_q);
  const T* out = static_cast<const T*>(a.out) + batch * a.out_strides[0] + i * a.out_strides[1] + head * a.out_strides[2];
  const T* dout = static_cast<const T*>(p.dout) + batch * p.dout_strides[0] + i * p.dout_strides[1] + head * p.dout_strides[2];
  float sum = 0.f;
  for (int c = lane * kVec; c < a.head_dim; c += 32 * kVec) {
    float o[kVec], d[kVec];
    load_floats<T, kVec>(out + c, o);
    load_floats<T, kVec>(dout + c, d);
#pragma unroll
    for (int e = 0; e < kVec; ++e) sum = fmaf(o[e], d[e], sum);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) {
    if (p.dlse != nullptr) sum -= p.dlse[batch * p.dlse_strides[0] + head * p.dlse_strides[1] + i];
    p.delta[(i64(batch) * a.heads_q + head) * a.seqlen_q + i] = sum;
  }
}

}  // namespace cuattn
