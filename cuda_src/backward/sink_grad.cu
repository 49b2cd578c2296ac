// Gradient of the attention sinks (common/sink.cuh). A sink takes part in every row's softmax and
// carries no value, so with P_sink = exp(sink - lse) (lse includes the sink):
//   dsink[h] = -sum over the rows of head h of P_sink * delta,  delta = rowsum(dout * out) - dlse,
// the dS = P (dP - delta) rule with dP = 0. One CTA per query head, its rows (every sequence)
// dealt to the threads in a fixed order, kSinkGradRowsInFlight loads of lse and delta in
// flight per thread (a head's rows are few CTAs' work: latency, not bandwidth, bounds it), and
// summed in fp64: deterministic. Runs after backward_prep has written delta. PACKED: the
// statistics are (heads_q, total_q), the kernels' one-sequence view (cuattn/packed.py
// one_sequence_view).
#include "common/dtypes.cuh"
#include "common/params.cuh"

namespace cuattn {

constexpr int kSinkGradWarps = 32;
constexpr int kSinkGradRowsInFlight = 8;

template <bool PACKED>
__global__ void __launch_bounds__(kSinkGradWarps * 32) sink_grad_kernel(const __grid_constant__ BackwardParams p) {
  __shared__ double s_warp[kSinkGradWarps];
  const AttnParams& a = p.attn;
  const int head = blockIdx.x;
  const float sink = a.sink[head];
  const i64 rows = PACKED ? i64(a.total_q) : i64(a.batch) * a.seqlen_q;
  constexpr int kThreads = kSinkGradWarps * 32;
  double sum = 0.0;
  for (i64 i0 = threadIdx.x; i0 < rows; i0 += kThreads * kSinkGradRowsInFlight) {
    float lse[kSinkGradRowsInFlight], delta[kSinkGradRowsInFlight];
#pragma unroll
    for (int j = 0; j < kSinkGradRowsInFlight; ++j) {
      const i64 i = i0 + j * kThreads;
      const i64 batch = PACKED ? 0 : i / a.seqlen_q, row = PACKED ? i : i % a.seqlen_q;
      const bool valid = i < rows;
      lse[j] = valid ? a.lse[batch * a.lse_strides[0] + head * a.lse_strides[1] + row] : -neg_inf();  // past the rows: weight 0
      delta[j] = valid ? p.delta[batch * p.delta_strides[0] + head * p.delta_strides[1] + row] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kSinkGradRowsInFlight; ++j) {
      // A row that saw no key has lse = sink, so p_sink 1; with a sink of -inf, lse is -inf too.
      const float p_sink = lse[j] == neg_inf() ? 1.f : expf(sink - lse[j]);
      sum += double(p_sink) * double(delta[j]);
    }
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) sum += __shfl_xor_sync(0xffffffff, sum, d);
  if (threadIdx.x % 32 == 0) s_warp[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
#pragma unroll
    for (int w = 0; w < kSinkGradWarps; ++w) total += s_warp[w];
    p.dsink[head] = float(-total);
  }
}

}  // namespace cuattn
