// Folding a forward's partial result into an fp32 accumulator (AttnParams::accum). Schedules
// that visit a row's keys in pieces (K/V chunks streamed from the host, ring steps) merge each
// piece on the spot by the exact rule
//   lse = log(exp(lse_acc) + exp(lse_piece)),
//   acc = acc * exp(lse_acc - lse) + out_piece * exp(lse_piece - lse),
// and round to the output dtype once, in the launch of the last piece. A side whose lse is
// -inf (it saw no key, or the accumulator is fresh) weighs 0 and its values are not read; a
// NaN lse on either side (a NaN or +inf score) makes the row's weights, out and lse NaN.
#pragma once
#include "../common/dtypes.cuh"
#include "../common/params.cuh"

namespace cuattn {

struct Fold {
  float keep;  // weight of the accumulator's values
  float take;  // weight of the piece's normalized output
  float lse;   // the merged lse
};

__device__ __forceinline__ Fold fold_weights(float acc_lse, float piece_lse) {
  if (isnan(acc_lse) || isnan(piece_lse)) {
    const float nan = acc_lse + piece_lse;
    return {nan, nan, nan};
  }
  const float top = fmaxf(acc_lse, piece_lse);
  if (top == neg_inf()) return {0.f, 0.f, neg_inf()};
  const float keep = acc_lse == neg_inf() ? 0.f : expf(acc_lse - top);  // one of the two is 1
  const float take = piece_lse == neg_inf() ? 0.f : expf(piece_lse - top);
  const float total = keep + take;
  return {keep / total, take / total, top + log1pf(fminf(keep, take))};
}

// The accumulator's lse of a row (-inf when fresh, or for a thread that does not read it): the
// one thread that reads a row's lse writes it back, and shares it by shuffle.
__device__ __forceinline__ float accumulated_lse(const AttnParams& p, const float* lse_row, bool in_range) {
  return p.accum_fresh || !in_range ? neg_inf() : *lse_row;
}

// Column pairs of a row whose accumulator values are loaded together: every load of a group is
// issued before any store, so that a row waits on memory once per group rather than once per
// pair (and a group's registers stay few enough not to spill at head_dim 192).
constexpr int kFoldLoads = 8;

// The accumulator's values at this thread's column pairs d0 .. d0 + kFoldLoads - 1 of one row
// (columns 8 dt + 2 (lane % 4), and the next), zeros where not read.
template <int D_TILES>
__device__ __forceinline__ void load_acc_pairs(float2 (&old)[kFoldLoads], const float* acc_row, int d0, int t, int head_dim, bool read) {
#pragma unroll
  for (int i = 0; i < kFoldLoads; ++i) {
    const int col = (d0 + i) * 8 + 2 * t;
    old[i] = read && d0 + i < D_TILES && col < head_dim ? *reinterpret_cast<const float2*>(acc_row + col) : make_float2(0.f, 0.f);
  }
}

}  // namespace cuattn
