// The per-key-block score work of the tensor-core forward kernels, on accumulator fragments in
// the m16n8 layout (mma.sync tiles, or a warpgroup's wgmma rows): softcap, the band mask, and
// the online softmax with lazy rescaling. Each thread holds rows g and g + 8 of each m-tile; a
// row's 4 owners are the lanes of one quad.
#pragma once
#include "../common/mask.cuh"
#include "../common/sink.cuh"

namespace cuattn {

// log2 of the growth of a row's max that forces a rescale (FlashAttention-4's lazy rescaling).
constexpr float kRescaleSlack = 8.f;

template <int M_TILES, int N_TILES>
__device__ __forceinline__ void softcap_scores(float (&s)[M_TILES][N_TILES][4], const AttnParams& p) {
  const float pre = p.scale / p.softcap;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mt][nt][e] = p.softcap * tanhf(s[mt][nt][e] * pre);
}

// Sets the scores of keys a row does not see to -inf. row0: query row of m-tile 0's row 0;
// n0: key of column 0.
template <int M_TILES, int N_TILES>
__device__ __forceinline__ void mask_scores(float (&s)[M_TILES][N_TILES][4], const KeyBand& band, int row0, int n0) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + mt * 16 + g + h * 8;
      const int lo = band.first_key(row) - n0 - 2 * t, hi = band.last_key(row) - n0 - 2 * t;
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = nt * 8 + e;  // key n0 + 2t + col
          if (col < lo || col > hi) s[mt][nt][2 * h + e] = neg_inf();
        }
    }
}

// Online softmax of one key block: turns the raw scores s into unnormalized probabilities and
// updates the row statistics. Scores stay unscaled; sc = exp2_scale (> 0) folds scale and
// log2(e). row_max is the shift of the exponents, not always the true running max: it is raised
// (and row_sum rescaled) only when some row of the warp grew by more than 2^kRescaleSlack, so
// most key blocks skip the rescale; p <= 2^kRescaleSlack stays exact in fp32. When the shift
// moves, rescale(mt, h, alpha) is called for each row half: the output accumulator's row must
// be multiplied by alpha. Returns whether it moved (warp-uniform).
template <int M_TILES, int N_TILES, typename Rescale>
__device__ __forceinline__ bool softmax_block(float (&s)[M_TILES][N_TILES][4], float (&row_max)[M_TILES][2],
                                              float (&row_sum)[M_TILES][2], float sc, Rescale&& rescale) {
  float block_max[M_TILES][2];
  bool grow = false;
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[mt][h];
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
      block_max[mt][h] = mx;
      // -inf - -inf is NaN, which compares false: a row that still sees no key never grows.
      grow |= mx * sc - row_max[mt][h] * sc > kRescaleSlack;
    }
  }
  const bool moved = __any_sync(0xffffffff, grow);
  if (moved) {
#pragma unroll
    for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float alpha = row_max[mt][h] == neg_inf() ? 0.f : exp2f(row_max[mt][h] * sc - block_max[mt][h] * sc);
        row_max[mt][h] = block_max[mt][h];
        row_sum[mt][h] *= alpha;
        rescale(mt, h, alpha);
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < M_TILES; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // A row that has seen no key yet keeps max -inf; exponents then use 0 so no inf - inf.
      const float shift = row_max[mt][h] == neg_inf() ? 0.f : row_max[mt][h] * sc;
      float sum = 0.f;
#pragma unroll
      for (int nt = 0; nt < N_TILES; ++nt) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[mt][nt][e] = exp2f(fmaf(s[mt][nt][e], sc, -shift));
          sum += s[mt][nt][e];
        }
      }
      row_sum[mt][h] += sum;
    }
  }
  return moved;
}

// Row half h of m-tile mt of acc, times alpha.
template <int M_TILES, int D_TILES>
__device__ __forceinline__ void rescale_row(float (&acc)[M_TILES][D_TILES][4], int mt, int h, float alpha) {
#pragma unroll
  for (int dt = 0; dt < D_TILES; ++dt) {
    acc[mt][dt][2 * h] *= alpha;
    acc[mt][dt][2 * h + 1] *= alpha;
  }
}

// softmax_block with the accumulator rescaled at once.
template <int M_TILES, int N_TILES, int D_TILES>
__device__ __forceinline__ void online_softmax(float (&s)[M_TILES][N_TILES][4], float (&row_max)[M_TILES][2],
                                               float (&row_sum)[M_TILES][2], float (&acc)[M_TILES][D_TILES][4], float sc) {
  softmax_block(s, row_max, row_sum, sc, [&](int mt, int h, float alpha) { rescale_row(acc, mt, h, alpha); });
}

// The softmax denominator of row half h of an m-tile, summed over its quad, with the head's
// sink (-inf for none): common/sink.cuh normalize_row.
__device__ __forceinline__ RowTotal finish_row(float row_max, float row_sum, float exp2_scale, float sink) {
  float l = row_sum;
  l += __shfl_xor_sync(0xffffffff, l, 1);
  l += __shfl_xor_sync(0xffffffff, l, 2);
  return normalize_row(row_max * exp2_scale, l, sink);
}

}  // namespace cuattn
