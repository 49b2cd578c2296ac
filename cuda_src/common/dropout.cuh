// Dropout on the attention probabilities, regenerated wherever it is needed and never stored.
//
// Element (query row i, key j) of query head h of sequence b draws a 16-bit number from
// Philox4x32-10 (Salmon et al., SC'11) keyed by the 64-bit seed: the counter
//   (j & ~9, i & ~8, b * heads_q + h, 0)
// gives 128 bits, eight 16-bit words, one for each element of the group
//   rows {i0, i0 + 8} x keys {j0, j0 + 1, j0 + 8, j0 + 9},
// element (i, j) taking word 4 * bit3(i) + 2 * bit3(j) + bit0(j) (word w is half w % 2 of 32-bit
// output w / 2, low half first). The element is kept when its word >= threshold, and kept
// probabilities are multiplied by 65536 / (65536 - threshold). The group is the union of what
// one lane holds in an mma / wgmma accumulator tile (rows g, g + 8, key pairs 2t, 2t + 8): one
// draw covers 8 elements there, and 4 in the transposed tiles of the dK / dV kernels, so every
// kernel reproduces the same mask from coordinates alone. cuattn/reference.py holds the host twin.
#pragma once
#include "dtypes.cuh"
#include "int_types.cuh"
#include "params.cuh"

namespace cuattn {

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 key) {
  constexpr u32 kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u, kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const u32 hi0 = __umulhi(kM0, c.x), lo0 = kM0 * c.x;
    const u32 hi1 = __umulhi(kM1, c.z), lo1 = kM1 * c.z;
    c = make_uint4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
    key.x += kW0;
    key.y += kW1;
  }
  return c;
}

// The dropout draws of one (sequence, query head).
struct DropoutDraws {
  uint2 key;
  u32 head_word;
  u32 threshold;

  __device__ __forceinline__ DropoutDraws(const AttnParams& p, int seq, int head)
      : head_word(u32(seq) * u32(p.heads_q) + u32(head)), threshold(p.dropout_threshold) {
    const u64 seed = p.dropout_seed_ptr != nullptr ? *reinterpret_cast<const u64*>(p.dropout_seed_ptr) : p.dropout_seed;
    key = make_uint2(u32(seed), u32(seed >> 32));
  }

  // The group of rows {row0, row0 + 8} (row0 % 16 < 8) x keys {col0, +1, +8, +9} (col0 % 16 < 8,
  // even): bit w set when word w is kept.
  __device__ __forceinline__ u32 group_keeps(int row0, int col0) const {
    const uint4 r = philox4x32_10(make_uint4(u32(col0), u32(row0), head_word, 0u), key);
    const u32 words[4] = {r.x, r.y, r.z, r.w};
    u32 bits = 0;
#pragma unroll
    for (int w = 0; w < 8; ++w) bits |= u32(((words[w / 2] >> (16 * (w % 2))) & 0xffffu) >= threshold) << w;
    return bits;
  }

  // Whether element (row, col) is kept (one draw per element: for kernels off the tile layout).
  __device__ __forceinline__ bool keeps(int row, int col) const {
    const u32 bits = group_keeps(row & ~8, col & ~9);
    return (bits >> (((row >> 3) & 1) * 4 + ((col >> 3) & 1) * 2 + (col & 1))) & 1u;
  }

  // x <- x * kept_scale where kept, 0 where dropped, over a warp's 16 x 8*N accumulator tile (mma
  // C fragments: the lane holds rows row0 + g (+ 8), keys col0 + 8 * nt + 2t (+ 1)); row0 and
  // col0 multiples of 16. Each draw is applied as it is made (few registers live).
  template <int N>
  __device__ __forceinline__ void drop_rows(float (&x)[N][4], int row0, int col0, int lane, float kept_scale) const {
    static_assert(N % 2 == 0, "key tiles in pairs");
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nt = 0; nt < N; nt += 2) {
      const u32 bits = group_keeps(row0 + g, col0 + nt * 8 + 2 * t);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          x[nt][2 * h + e] = (bits >> (4 * h + e)) & 1u ? x[nt][2 * h + e] * kept_scale : 0.f;
          x[nt + 1][2 * h + e] = (bits >> (4 * h + 2 + e)) & 1u ? x[nt + 1][2 * h + e] * kept_scale : 0.f;
        }
    }
  }

  // Bit 4 * nt + e set when element e of n-tile nt of a transposed tile (dK / dV kernels: the
  // lane holds keys key0 + g (+ 8) as rows, queries q0 + 8 * nt + 2t (+ 1) as columns) is kept;
  // key0 and q0 multiples of 16. Called by the whole warp.
  template <int N>
  __device__ __forceinline__ u64 transposed_keeps(int q0, int key0, int lane) const {
    static_assert(N % 2 == 0 && N <= 16, "query tiles in pairs, 64 bits");
    const int g = lane / 4, t = lane % 4;
    const int parity = g & 1;  // the key's bit 0: the half of each 32-bit output it takes
    u64 mask = 0;
#pragma unroll
    for (int nt = 0; nt < N; nt += 2) {
      // Lanes g and g ^ 1 (lane ^ 4) need the same two groups, queries q + e for e = 0, 1 (the
      // keys' two parities): each draws the one of e = its parity, and they swap.
      const u32 mine = group_keeps(q0 + nt * 8 + 2 * t + parity, key0 + (g & ~1));
      const u32 partners = __shfl_xor_sync(0xffffffffu, mine, 4);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const u32 bits = e == parity ? mine : partners;
#pragma unroll
        for (int kh = 0; kh < 2; ++kh) {  // key + 8 * kh: word 2 * kh (+ 4 for query + 8)
          mask |= u64((bits >> (2 * kh + parity)) & 1u) << (4 * nt + 2 * kh + e);
          mask |= u64((bits >> (4 + 2 * kh + parity)) & 1u) << (4 * (nt + 1) + 2 * kh + e);
        }
      }
    }
    return mask;
  }
};

__device__ __forceinline__ bool kept(u64 mask, int nt, int e) { return (mask >> (4 * nt + e)) & 1u; }

// x <- x * kept_scale where kept, 0 where dropped.
template <int N>
__device__ __forceinline__ void apply_keeps(float (&x)[N][4], u64 mask, float kept_scale) {
#pragma unroll
  for (int nt = 0; nt < N; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[nt][e] = kept(mask, nt, e) ? x[nt][e] * kept_scale : 0.f;
}

// c_tiles_to_a (common/mma.cuh) of the kept elements only, the dropped ones as 0.
template <typename T, int N>
__device__ __forceinline__ void c_tiles_to_a_kept(const float (&c)[N][4], int kk, u64 mask, u32 (&a)[4]) {
  const auto x = [&](int nt, int e) { return kept(mask, nt, e) ? c[nt][e] : 0.f; };
  a[0] = pack2<T>(x(2 * kk, 0), x(2 * kk, 1));
  a[1] = pack2<T>(x(2 * kk, 2), x(2 * kk, 3));
  a[2] = pack2<T>(x(2 * kk + 1, 0), x(2 * kk + 1, 1));
  a[3] = pack2<T>(x(2 * kk + 1, 2), x(2 * kk + 1, 3));
}

}  // namespace cuattn
