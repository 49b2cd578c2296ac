// Softmax exponents of the float32 (CUDA-core) kernels, formed in fp64. A raw score of a few
// hundred rounded to fp32 is off by ~1e-5, which exp turns into a relative error of that size in
// the probability, and the backward (through delta = rowsum(dout * out)) into one of every
// gradient. Shifts stay fp32 values computed one way (no fma contraction), so that every use
// of a row's shift agrees exactly.
#pragma once
#include "dtypes.cuh"

namespace cuattn {

// The base-2 shift of a row whose max score is row_max (0 for a row that has seen nothing yet).
__device__ __forceinline__ float exp2_shift(float row_max, float exp2_scale) {
  return row_max == neg_inf() ? 0.f : __fmul_rn(row_max, exp2_scale);
}

__device__ __forceinline__ float exp2_minus_shift(double score, float exp2_scale, double shift) {
  return exp2f(float(fma(score, double(exp2_scale), -shift)));
}

// Natural-log lse from a row's base-2 shift and probability sum; -inf for a row that saw no key,
// NaN for one whose sum is NaN (a NaN or +inf score, as common/sink.cuh normalize_row).
__device__ __forceinline__ float lse_from_shift(float shift, float row_sum) {
  return row_sum > 0.f ? float((double(shift) + double(log2f(row_sum))) * 0.6931471805599453) : isnan(row_sum) ? row_sum : neg_inf();
}

// common/sink.cuh normalize_row in fp64, from a base-2 shift, the row's fp64 probability sum
// and its sink (natural units, -inf for none).
struct RowTotalF64 {
  double inv;
  float lse;
};
__device__ __forceinline__ RowTotalF64 normalize_row_f64(float shift, double row_sum, float sink) {
  if (isnan(row_sum)) return {row_sum, float(row_sum)};
  if (sink == neg_inf()) return {row_sum > 0.0 ? 1.0 / row_sum : 0.0, lse_from_shift(shift, float(row_sum))};
  const double sink2 = double(sink) * 1.4426950408889634;
  const double top = row_sum > 0.0 ? fmax(double(shift), sink2) : sink2;
  const double kept = row_sum > 0.0 ? exp2(double(shift) - top) : 0.0;
  const double total = row_sum * kept + exp2(sink2 - top);
  return {kept / total, float((top + log2(total)) * 0.6931471805599453)};
}

// The base-2 shift of a saved lse, in fp64; +inf for lse = -inf, so that probabilities are 0.
__device__ __forceinline__ double lse_to_exp2_shift_f64(float lse) {
  return lse == neg_inf() ? double(-neg_inf()) : double(lse) * 1.4426950408889634;
}

}  // namespace cuattn
