// A row's softmax denominator, with an optional sink: a per-head logit that joins every row's
// denominator and carries no value (attention sinks, as in open-weight models since 2025). A row
// whose exponents were taken relative to `shift` and sum to `l` has
//   out = acc * 2^(shift - top) / total,  total = l * 2^(shift - top) + 2^(sink - top),
// top = max(shift, sink), all in log2 units. Without a sink (sink = -inf) that is acc / l.
#pragma once
#include "dtypes.cuh"

namespace cuattn {

constexpr float kLog2eF = 1.4426950408889634f;
constexpr float kLn2F = 0.69314718055994531f;

// Head `head`'s sink logit (natural units), -inf without sinks.
__device__ __forceinline__ float sink_of(const float* sink, int head) { return sink == nullptr ? neg_inf() : sink[head]; }

// The factor that normalizes a row's accumulated output (0 for a row that saw nothing), and its
// lse in natural log (-inf for a row that saw nothing and has no sink; the sink alone otherwise).
// A NaN or +inf score makes l NaN: then both are NaN, so that a merge by lse (a fold of
// streamed chunks, a split decode) carries the NaN on instead of weighing the row's part 0.
struct RowTotal {
  float inv;
  float lse;
};
__device__ __forceinline__ RowTotal normalize_row(float shift, float l, float sink) {
  if (isnan(l)) return {l, l};
  const float sink2 = sink * kLog2eF;
  if (sink2 == neg_inf()) return {l > 0.f ? 1.f / l : 0.f, l > 0.f ? (shift + log2f(l)) * kLn2F : neg_inf()};
  const float top = l > 0.f ? fmaxf(shift, sink2) : sink2;
  const float kept = l > 0.f ? exp2f(shift - top) : 0.f;
  const float total = fmaf(l, kept, exp2f(sink2 - top));
  return {kept / total, (top + log2f(total)) * kLn2F};
}

}  // namespace cuattn
