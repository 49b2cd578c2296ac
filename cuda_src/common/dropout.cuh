// Dropout on the attention probabilities, regenerated wherever it is needed and never stored.
//
// Element (query row i, key j) of query head h of sequence b draws an 8-bit number from
// Philox4x32-10 (Salmon et al., SC'11) keyed by the 64-bit seed: the counter
//   (j & ~9, i & ~9, b * heads_q + h, 0)
// gives 128 bits, sixteen bytes, one for each element of the group
//   rows {i0, i0 + 1, i0 + 8, i0 + 9} x keys {j0, j0 + 1, j0 + 8, j0 + 9},
// element (i, j) taking byte 8 * bit3(i) + 4 * bit0(i) + 2 * bit3(j) + bit0(j) (byte w is byte
// w % 4 of 32-bit output w / 4, low byte first). The element is kept when its byte >= threshold
// (= round(256 p)), and kept probabilities are multiplied by 256 / (256 - threshold). In an mma /
// wgmma accumulator tile a lane holds half of a group (rows g, g + 8 of the group's rows, or in
// the transposed tiles of the dK / dV kernels keys g, g + 8 of its keys) and lane ^ 4 the other
// half: the two lanes each draw one group and swap, so one draw serves 16 elements in every
// kernel, and every kernel reproduces the same mask from coordinates alone.
// cuattn/reference.py holds the host twin.
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

// Byte w of a group: 8 * bit3(row) + 4 * bit0(row) + 2 * bit3(col) + bit0(col).
__device__ __forceinline__ int group_byte(int row, int col) { return ((row >> 3) & 1) * 8 + (row & 1) * 4 + ((col >> 3) & 1) * 2 + (col & 1); }

// The dropout draws of one (sequence, query head).
struct DropoutDraws {
  uint2 key;
  u32 head_word;
  u32 threshold4;  // the threshold in each byte

  __device__ __forceinline__ DropoutDraws(const AttnParams& p, int seq, int head)
      : head_word(u32(seq) * u32(p.heads_q) + u32(head)), threshold4(p.dropout_threshold * 0x01010101u) {
    const u64 seed = p.dropout_seed_ptr != nullptr ? *reinterpret_cast<const u64*>(p.dropout_seed_ptr) : p.dropout_seed;
    key = make_uint2(u32(seed), u32(seed >> 32));
  }

  // The 16 bytes of the group of rows {row0, +1, +8, +9} x keys {col0, +1, +8, +9} (row0 and
  // col0: bits 0 and 3 clear).
  __device__ __forceinline__ uint4 draw(int row0, int col0) const { return philox4x32_10(make_uint4(u32(col0), u32(row0), head_word, 0u), key); }

  // The same group as bits: bit w set when byte w is kept.
  __device__ __forceinline__ u32 group_keeps(int row0, int col0) const {
    const uint4 r = draw(row0, col0);
    const u32 words[4] = {r.x, r.y, r.z, r.w};
    u32 bits = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 ge = __vcmpgeu4(words[i], threshold4) & 0x01010101u;  // 1 in each kept byte
      bits |= ((ge * 0x01020408u) >> 24) << (4 * i);                  // the 4 bytes' bits, in order
    }
    return bits;
  }

  // Whether element (row, col) is kept (one draw per element: for kernels off the tile layout).
  __device__ __forceinline__ bool keeps(int row, int col) const { return (group_keeps(row & ~9, col & ~9) >> group_byte(row, col)) & 1u; }

  // The groups of two n-tile pairs (first + 2 * pair, stride apart in row0 or col0) that this
  // lane and lane ^ 4 both need. With SHARED each draws the one of its parity and they swap;
  // without (tiles of 8 or 16 columns: fewer registers) each draws both.
  template <bool SHARED>
  __device__ __forceinline__ void pair_groups(u32 (&bits)[2], int row0, int col0, int row_stride, int col_stride, int parity) const {
    if constexpr (SHARED) {
      const u32 mine = group_keeps(row0 + parity * row_stride, col0 + parity * col_stride);
      const u32 partners = __shfl_xor_sync(0xffffffffu, mine, 4);
      bits[parity] = mine;
      bits[parity ^ 1] = partners;
    } else {
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) bits[pair] = group_keeps(row0 + pair * row_stride, col0 + pair * col_stride);
    }
  }

  // Calls visit(nt, bits) with the group of key tiles nt, nt + 1 of a warp's 16 x 8*N accumulator
  // tile (mma C fragments: the lane holds rows row0 + g (+ 8), keys col0 + 8 * nt + 2t (+ 1));
  // row0 and col0 multiples of 16. Element e of tile nt + odd is bit
  // 8 * (e / 2) + 4 * parity + 2 * odd + e % 2 (row_bit). Called by the whole warp.
  template <int N, typename Visit>
  __device__ __forceinline__ void for_each_row_group(int row0, int col0, int lane, Visit&& visit) const {
    static_assert(N % 2 == 0 && (N < 8 || N % 4 == 0), "key tiles in pairs, in fours from 8");
    const int g = lane / 4, t = lane % 4, parity = g & 1;
    if constexpr (N >= 8) {  // key tiles in fours: two groups per lane pair, shared
#pragma unroll
      for (int nt = 0; nt < N; nt += 4) {
        u32 bits[2];
        pair_groups<true>(bits, row0 + (g & ~1), col0 + nt * 8 + 2 * t, 0, 16, parity);
        visit(nt, bits[0]);
        visit(nt + 2, bits[1]);
      }
    } else {  // each group drawn and used in turn (fewer registers live)
#pragma unroll
      for (int nt = 0; nt < N; nt += 2) visit(nt, group_keeps(row0 + (g & ~1), col0 + nt * 8 + 2 * t));
    }
  }
  __device__ __forceinline__ static int row_bit(int lane, int odd, int e) { return 8 * (e / 2) + 4 * ((lane / 4) & 1) + 2 * odd + e % 2; }

  // x <- x (* kept_scale with SCALED) where kept, 0 where dropped, over such a tile. The lane's
  // rows take word parity (row g) and word 2 + parity (row g + 8) of a group, byte 2 * odd + e % 2
  // of each; the byte compare's 0xff / 0 spread over a word is a mask ANDed into the float (two
  // instructions an element).
  template <int N, bool SCALED = true>
  __device__ __forceinline__ void drop_rows(float (&x)[N][4], int row0, int col0, int lane, float kept_scale = 1.f) const {
    static_assert(N % 2 == 0 && (N < 8 || N % 4 == 0), "key tiles in pairs, in fours from 8");
    const int g = lane / 4, t = lane % 4, parity = g & 1;
    const auto apply = [&](int nt, u32 row_word, u32 row8_word) {  // key tiles nt, nt + 1
      const u32 ge[2] = {__vcmpgeu4(row_word, threshold4), __vcmpgeu4(row8_word, threshold4)};
#pragma unroll
      for (int odd = 0; odd < 2; ++odd)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const u32 keep = __byte_perm(ge[e / 2], 0u, u32(2 * odd + e % 2) * 0x1111u);  // the byte (0xff or 0) in all four
          float& v = x[nt + odd][e];
          v = __uint_as_float(__float_as_uint(v) & keep);
          if constexpr (SCALED) v *= kept_scale;
        }
    };
    const auto mine = [&](const uint4& r, u32& lo, u32& hi) {  // words parity and 2 + parity
      lo = parity ? r.y : r.x;
      hi = parity ? r.w : r.z;
    };
    if constexpr (N >= 8) {  // key tiles in fours: this lane draws the pair of its parity, lane ^ 4 the other
#pragma unroll
      for (int nt = 0; nt < N; nt += 4) {
        const uint4 r = draw(row0 + (g & ~1), col0 + (nt + 2 * parity) * 8 + 2 * t);
        u32 lo, hi;
        mine(r, lo, hi);
        const u32 got_lo = __shfl_xor_sync(0xffffffffu, parity ? r.x : r.y, 4);  // the partner's rows' words
        const u32 got_hi = __shfl_xor_sync(0xffffffffu, parity ? r.z : r.w, 4);
        apply(nt, parity ? got_lo : lo, parity ? got_hi : hi);
        apply(nt + 2, parity ? lo : got_lo, parity ? hi : got_hi);
      }
    } else {  // each group drawn and applied in turn (fewer registers live)
#pragma unroll
      for (int nt = 0; nt < N; nt += 2) {
        u32 lo, hi;
        mine(draw(row0 + (g & ~1), col0 + nt * 8 + 2 * t), lo, hi);
        apply(nt, lo, hi);
      }
    }
  }

  // The same tile's keeps as bits 4 * nt + e (for apply_keeps), for a kernel that draws them
  // while its products run.
  template <int N>
  __device__ __forceinline__ u64 row_keeps(int row0, int col0, int lane) const {
    static_assert(N <= 16, "64 bits");
    u64 mask = 0;
    for_each_row_group<N>(row0, col0, lane, [&](int nt, u32 bits) {
#pragma unroll
      for (int odd = 0; odd < 2; ++odd)
#pragma unroll
        for (int e = 0; e < 4; ++e) mask |= u64((bits >> row_bit(lane, odd, e)) & 1u) << (4 * (nt + odd) + e);
    });
    return mask;
  }

  // Bit 4 * nt + e set when element e of n-tile nt of a transposed tile (dK / dV kernels: the
  // lane holds keys key0 + g (+ 8) as rows, queries q0 + 8 * nt + 2t (+ 1) as columns) is kept;
  // key0 and q0 multiples of 16. Called by the whole warp.
  template <int N>
  __device__ __forceinline__ u64 transposed_keeps(int q0, int key0, int lane) const {
    static_assert((N == 2 || N % 4 == 0) && N <= 16, "query tiles: a pair, or fours; 64 bits");
    const int g = lane / 4, t = lane % 4, parity = g & 1;
    u64 mask = 0;
#pragma unroll
    for (int nt = 0; nt < N; nt += 4) {
      u32 bits[2];  // the groups of query tiles nt, nt + 1 and nt + 2, nt + 3 (if any)
      if constexpr (N % 4 == 0) {
        pair_groups<(N >= 8)>(bits, q0 + nt * 8 + 2 * t, key0 + (g & ~1), 16, 0, parity);
      } else {
        bits[0] = group_keeps(q0 + nt * 8 + 2 * t, key0 + (g & ~1));
        bits[1] = 0;
      }
#pragma unroll
      for (int pair = 0; pair < (N % 4 == 0 ? 2 : 1); ++pair)
#pragma unroll
        for (int odd = 0; odd < 2; ++odd)  // query + 8
#pragma unroll
          for (int e = 0; e < 2; ++e)       // query + 1
#pragma unroll
            for (int kh = 0; kh < 2; ++kh)  // key + 8
              mask |= u64((bits[pair] >> (8 * odd + 4 * e + 2 * kh + parity)) & 1u) << (4 * (nt + 2 * pair + odd) + 2 * kh + e);
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
