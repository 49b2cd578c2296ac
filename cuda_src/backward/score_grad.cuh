// Shared steps of the backward kernels on one warp's 16 x N tile of scores (mma C fragments):
// probabilities from the saved lse, and dS = P * (dP - delta) through the optional softcap.
#pragma once
#include "../common/dropout.cuh"
#include "../common/dtypes.cuh"
#include "../common/mask.cuh"
#include "../common/mma.cuh"
#include "../common/params.cuh"
#include "../common/vector_io.cuh"

namespace cuattn {

constexpr float kLog2e = 1.4426950408889634f;

// lse (natural log) to the base-2 shift of the exponent; a row that saw no key (lse = -inf)
// becomes +inf so that its probabilities are exactly 0.
__device__ __forceinline__ float lse_to_exp2_shift(float lse) {
  return lse == neg_inf() ? -neg_inf() : lse * kLog2e;
}

// Applies softcap to raw scores in place and keeps d(capped)/d(raw) / scale = 1 - tanh^2.
template <int N>
__device__ __forceinline__ void apply_softcap(float (&s)[N][4], float (&cap_grad)[N][4], float scale, float softcap) {
  const float pre = scale / softcap;
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float th = tanhf(s[nt][e] * pre);
      s[nt][e] = softcap * th;
      cap_grad[nt][e] = 1.f - th * th;
    }
}

// P and dS = P (dP - delta) of one raw score x in one pass, the softcap applied (and
// differentiated) on the way; shift is the row's exp2 shift, visible false forces P = 0.
struct ProbGrad {
  float prob;
  float grad;
};
// P alone (the first half of prob_and_grad, for kernels that form dS later): cap_grad gets
// d(capped)/d(raw) / scale, 1 without softcap.
template <bool SOFTCAP>
__device__ __forceinline__ float prob_of_score(float x, float shift, bool visible, const AttnParams& a, float& cap_grad) {
  cap_grad = 1.f;
  if constexpr (SOFTCAP) {
    const float th = tanhf(x * (a.scale / a.softcap));
    x = a.softcap * th;
    cap_grad = 1.f - th * th;
  }
  return visible ? exp2f(fmaf(x, a.exp2_scale, -shift)) : 0.f;
}
template <bool SOFTCAP>
__device__ __forceinline__ ProbGrad prob_and_grad(float x, float dp, float shift, float delta, bool visible, const AttnParams& a) {
  float cap_grad;
  const float prob = prob_of_score<SOFTCAP>(x, shift, visible, a, cap_grad);
  return {prob, prob * (dp - delta) * cap_grad};
}

// One k16 step of a warp's transposed scores (16 keys x queries, C fragments): n8 tiles 2kk and
// 2kk + 1 become probabilities, packed into the A fragment p, and keep P * d(capped)/d(raw) for
// dS^T. Columns are queries m0 + col with their lse in sLse[col]; rows are keys key0 + g (+ 8).
// The row stats are read once per column pair, and without MASKED (every element visible) the
// step has no per-element branch.
// With KEEPS, p holds only the elements that dropout keeps (bits of `keeps`, common/dropout.cuh).
template <typename T, bool SOFTCAP, bool MASKED, int N, bool KEEPS = false>
__device__ __forceinline__ void transposed_probs_k_step(float (&s)[N][4], int kk, u32 (&p)[4], const float* sLse, const KeyBand& band,
                                                        int m0, int key0, int lane, const AttnParams& a, u64 keeps = 0) {
  const int g = lane / 4, t = lane % 4;
  float cap_grad[2][4];
#pragma unroll
  for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt) {
    float lse[2];
    load_floats<float, 2>(sLse + nt * 8 + 2 * t, lse);
    const float shift[2] = {lse_to_exp2_shift(lse[0]), lse_to_exp2_shift(lse[1])};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool visible = !MASKED || band.visible(m0 + nt * 8 + 2 * t + (e % 2), key0 + g + (e / 2) * 8);
      s[nt][e] = prob_of_score<SOFTCAP>(s[nt][e], shift[e % 2], visible, a, cap_grad[nt % 2][e]);
    }
  }
  if constexpr (KEEPS) {
    c_tiles_to_a_kept<T>(s, kk, keeps, p);
  } else {
    c_tiles_to_a<T>(s, kk, p);
  }
#pragma unroll
  for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[nt][e] *= cap_grad[nt % 2][e];
}

// dS^T = (P * cap_grad) (dP^T - delta) in place over a warp's transposed tile, delta of query
// column col in sDelta[col].
template <int N>
__device__ __forceinline__ void transposed_score_grads(float (&dp)[N][4], const float (&prob)[N][4], const float* sDelta, int lane) {
  const int t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < N; ++nt) {
    float delta[2];
    load_floats<float, 2>(sDelta + nt * 8 + 2 * t, delta);
#pragma unroll
    for (int e = 0; e < 4; ++e) dp[nt][e] = prob[nt][e] * (dp[nt][e] - delta[e % 2]);
  }
}

// acc (16 x 8*N) += A (16 rows of sA, k over HEAD_DIM) * B^T where B is 8*N rows of sB: both
// operands row-major in padded shared tiles (row stride RS elements).
template <typename T, int HEAD_DIM, int N, int RS>
__device__ __forceinline__ void mma_rows_by_rows(float (&acc)[N][4], const T* sA, const T* sB, int lane) {
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM; kk += 16) {
    u32 a[4];
    ldmatrix_x4(a, sA + ((lane % 8) + ((lane / 8) % 2) * 8) * RS + kk + (lane / 16) * 8);
#pragma unroll
    for (int nt = 0; nt < N; nt += 2) {
      u32 b[4];
      ldmatrix_x4(b, sB + (nt * 8 + (lane % 8) + (lane / 16) * 8) * RS + kk + ((lane / 8) % 2) * 8);
      mma_16816<T>(acc[nt], a, b[0], b[1]);
      mma_16816<T>(acc[nt + 1], a, b[2], b[3]);
    }
  }
}

// acc (16 x 8*D) += C (16 x 8*N, fp32 C fragments) * B where B is 8*N rows x 8*D columns of sB;
// with KEEPS, C's elements that dropout drops (bits of `keeps`, common/dropout.cuh) count as 0.
template <typename T, int N, int D, int RS, bool KEEPS = false>
__device__ __forceinline__ void mma_frag_by_tile(float (&acc)[D][4], const float (&c)[N][4], const T* sB, int lane, u64 keeps = 0) {
#pragma unroll
  for (int kk = 0; kk < N / 2; ++kk) {
    u32 a[4];
    if constexpr (KEEPS) {
      c_tiles_to_a_kept<T>(c, kk, keeps, a);
    } else {
      c_tiles_to_a<T>(c, kk, a);
    }
#pragma unroll
    for (int dt = 0; dt < D; dt += 2) {
      u32 b[4];
      ldmatrix_x4_trans(b, sB + (kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * RS + dt * 8 + (lane / 16) * 8);
      mma_16816<T>(acc[dt], a, b[0], b[1]);
      mma_16816<T>(acc[dt + 1], a, b[2], b[3]);
    }
  }
}

// put(row, col, x, y) for each column pair (col, col + 1) of a warp's 16 x 8*D fp32 accumulator
// at rows row0 + (g, g + 8) below row_end and columns below head_dim.
template <int D, class Put>
__device__ __forceinline__ void for_acc_pairs(const float (&acc)[D][4], int row0, int row_end, int head_dim, int lane, Put&& put) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row0 + g + h * 8;
    if (row >= row_end) continue;
#pragma unroll
    for (int dt = 0; dt < D; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (col < head_dim) put(row, col, acc[dt][2 * h], acc[dt][2 * h + 1]);
    }
  }
}

// Stores the accumulator times `mul` as T rows (for_acc_pairs' rows and columns).
template <typename T, int D>
__device__ __forceinline__ void store_acc_rows(const float (&acc)[D][4], float mul, T* base, i64 row_stride, int row0, int row_end, int head_dim, int lane) {
  for_acc_pairs(acc, row0, row_end, head_dim, lane, [&](int row, int col, float x, float y) {
    *reinterpret_cast<u32*>(base + row * row_stride + col) = pack2<T>(x * mul, y * mul);
  });
}

// Bits of BackwardParams::sum_grads: which gradients the kernels add into fp32 sums.
constexpr int kSumDq = 1, kSumDkDv = 2;

// store_acc_rows' rows added into fp32 ones instead (BackwardParams::sum_grads).
template <int D>
__device__ __forceinline__ void add_acc_rows(const float (&acc)[D][4], float mul, float* base, i64 row_stride, int row0, int row_end, int head_dim, int lane) {
  for_acc_pairs(acc, row0, row_end, head_dim, lane, [&](int row, int col, float x, float y) {
    float2* slot = reinterpret_cast<float2*>(base + row * row_stride + col);
    const float2 old = *slot;
    *slot = make_float2(fmaf(x, mul, old.x), fmaf(y, mul, old.y));
  });
}

// add_acc_rows by atomic adds, for CTAs that add into the same rows (the TMA backward's query
// splits, BackwardParams::query_splits): the order of their additions, and so the sums' last
// bits, vary from run to run. Hopper and later (vector atomics).
template <int D>
__device__ __forceinline__ void atomic_add_acc_rows(const float (&acc)[D][4], float mul, float* base, i64 row_stride, int row0, int row_end, int head_dim,
                                                    int lane) {
  for_acc_pairs(acc, row0, row_end, head_dim, lane, [&](int row, int col, float x, float y) {
    atomicAdd(reinterpret_cast<float2*>(base + row * row_stride + col), make_float2(x * mul, y * mul));
  });
}

}  // namespace cuattn
