// The last step of a split decode (decode.cu): each row's fp32 partials (normalized out, lse),
// one per key split, merged by their lse into out (the input dtype) and lse. One CTA per row:
// the threads read the splits' lse together (split s in thread s) while warp w reads the
// partial rows of splits w, w + 4, ..., w + 12 (4 columns per lane); the weights are formed
// from the lses, and each warp sums its partial rows (four more in flight per further round
// past 16 splits); the warps' sums are added through shared memory. The row's latency is that
// of one read for up to 16 splits, not one per split. The head's sink, if any, joins here as one
// more term of the denominator (common/sink.cuh).
#include "common/dependent_launch.cuh"
#include "common/dtypes.cuh"
#include "common/params.cuh"
#include "common/sink.cuh"

namespace cuattn {

constexpr int kCombineWarps = 4;
constexpr int kCombineMaxSplits = 128;  // cuattn/kernels/decode.py MAX_SPLITS: one per thread

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(kCombineWarps * 32) decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  static_assert(kCombineMaxSplits == kCombineWarps * 32, "one split's lse per thread");
  constexpr int kChunks = (HEAD_DIM / 4 + 31) / 32;  // float4 columns per lane
  constexpr int kInFlight = 4;                       // partial rows per warp per round
  __shared__ float s_weight[kCombineMaxSplits];
  __shared__ float s_reduce[kCombineWarps];
  __shared__ __align__(16) float s_out[kCombineWarps][HEAD_DIM];

  wait_for_previous_grid();  // launched while decode.cu's grid may still run (cuattn/launch.py)
  allow_next_grid();
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const i64 row = blockIdx.x;  // (seq, token, head)
  const i64 rows = i64(p.batch) * p.seqlen_q * p.heads_q;
  const int head = int(row % p.heads_q), token = int(row / p.heads_q % p.seqlen_q), seq = int(row / p.heads_q / p.seqlen_q);
  const i64 lse_at = (i64(seq) * p.heads_q + head) * p.seqlen_q + token, lse_split = i64(p.batch) * p.heads_q * p.seqlen_q;
  const int splits = min(p.num_splits, kCombineMaxSplits);

  // Every split's partial row is written (zeros where it saw no key): loaded whatever its weight.
  const float* part = p.partial_out + row * p.head_dim;
  const i64 split_stride = rows * p.head_dim;
  float4 x[kInFlight][kChunks];
  const auto load_round = [&](int s0) {
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int s = s0 + j * kCombineWarps;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int c = (i * 32 + lane) * 4;
        x[j][i] = s < splits && c < p.head_dim ? *reinterpret_cast<const float4*>(part + s * split_stride + c) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  };

  // lse: max over the splits, then weights exp(lse_s - max) and their sum; the first round of
  // partial rows is loaded together with the lses.
  const float lse = int(threadIdx.x) < splits ? p.partial_lse[threadIdx.x * lse_split + lse_at] : neg_inf();
  load_round(warp);
  float shift = lse;
#pragma unroll
  for (int d = 16; d > 0; d /= 2) shift = fmaxf(shift, __shfl_xor_sync(0xffffffff, shift, d));
  if (lane == 0) s_reduce[warp] = shift;
  __syncthreads();
  const float sink = sink_of(p.sink, head);
  shift = fmaxf(fmaxf(fmaxf(s_reduce[0], s_reduce[1]), fmaxf(s_reduce[2], s_reduce[3])), sink);
  // A NaN lse (a split that met a NaN or +inf score; fmaxf passed over it) weighs NaN: out and lse NaN.
  const float weight = isnan(lse) ? lse : shift == neg_inf() || lse == neg_inf() ? 0.f : expf(lse - shift);
  float l = weight;
#pragma unroll
  for (int d = 16; d > 0; d /= 2) l += __shfl_xor_sync(0xffffffff, l, d);
  s_weight[threadIdx.x] = weight;
  __syncthreads();  // every weight written, every s_reduce read
  if (lane == 0) s_reduce[warp] = l;

  float4 o[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) o[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = warp; s0 < splits; s0 += kCombineWarps * kInFlight) {
    if (s0 != warp) load_round(s0);
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) {
      const int s = s0 + j * kCombineWarps;
      const float w = s < splits ? s_weight[s] : 0.f;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        if (w != 0.f) o[i].x += w * x[j][i].x, o[i].y += w * x[j][i].y, o[i].z += w * x[j][i].z, o[i].w += w * x[j][i].w;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = (i * 32 + lane) * 4;
    if (c < HEAD_DIM) *reinterpret_cast<float4*>(&s_out[warp][c]) = o[i];
  }
  __syncthreads();
  l = s_reduce[0] + s_reduce[1] + s_reduce[2] + s_reduce[3] + (sink == neg_inf() ? 0.f : expf(sink - shift));
  const float inv = l > 0.f ? 1.f / l : 0.f;
  T* out = static_cast<T*>(p.out) + seq * p.out_strides[0] + token * p.out_strides[1] + head * p.out_strides[2];
  for (int c = threadIdx.x; c < p.head_dim; c += kCombineWarps * 32)
    out[c] = from_float<T>((s_out[0][c] + s_out[1][c] + s_out[2][c] + s_out[3][c]) * inv);
  if (threadIdx.x == 0 && p.lse != nullptr) p.lse[seq * p.lse_strides[0] + head * p.lse_strides[1] + token] = l > 0.f ? shift + logf(l) : l == 0.f ? neg_inf() : l;
}

}  // namespace cuattn
