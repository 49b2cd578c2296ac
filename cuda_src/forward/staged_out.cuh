// The Hopper forwards' output path: each warpgroup stages its 64 rows of out in its own rows of
// the Q tile (128-byte-swizzled column blocks, common/wgmma.cuh; its products are done and no
// other warpgroup reads those rows), then stores them to global memory in 16-byte chunks.
#pragma once
#include "../common/named_barrier.cuh"
#include "../common/wgmma.cuh"
#include "accumulate.cuh"

namespace cuattn {

// Where column pair (col, col + 1) of row r sits in the staged tile of BLOCK_M rows.
template <int BLOCK_M>
__device__ __forceinline__ unsigned char* staged_at(unsigned char* tile, int r, int col) {
  return tile + (col / kSwizzleBlockElems) * BLOCK_M * kSwizzleRowBytes + swizzled_chunk(r, col % kSwizzleBlockElems / 8) + (col % 8) * 2;
}

// Row half h (rows g and g + 8 of the warp's m16 tile) of the accumulator, times `scale`, into
// row r of the staged tile of BLOCK_M rows.
template <typename T, int BLOCK_M, int D_TILES>
__device__ __forceinline__ void stage_out_row(unsigned char* tile, const float (&acc)[D_TILES][4], int h, int r, float scale) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int dt = 0; dt < D_TILES; ++dt) {
    const int col = dt * 8 + 2 * t;
    *reinterpret_cast<u32*>(staged_at<BLOCK_M>(tile, r, col)) = pack2<T>(acc[dt][2 * h] * scale, acc[dt][2 * h + 1] * scale);
  }
}

// The same row half, times `scale`, folded into the fp32 accumulator's row `row` (and its lse)
// by the rule of forward/accumulate.cuh, and the folded row staged (the launch of a row's last
// piece stores it as out, and leaves the accumulator's values unwritten: nothing reads them
// after it). The quad's first lane reads and writes the lse; rows past the sequence
// (!in_range) touch neither.
template <typename T, int BLOCK_M, int D_TILES>
__device__ __forceinline__ void fold_out_row(unsigned char* tile, const float (&acc)[D_TILES][4], int h, int r, float scale, float piece_lse,
                                             const AttnParams& p, float* lse, float* accum, int row, bool in_range) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  const Fold fold = fold_weights(__shfl_sync(0xffffffff, accumulated_lse(p, lse + row, in_range && t == 0), lane & ~3), piece_lse);
  float* acc_row = accum + row * p.accum_strides[1];
  const bool last_piece = p.out != nullptr;
#pragma unroll
  for (int d0 = 0; d0 < D_TILES; d0 += kFoldLoads) {
    float2 old[kFoldLoads];
    load_acc_pairs<D_TILES>(old, acc_row, d0, t, p.head_dim, in_range && fold.keep > 0.f);
#pragma unroll
    for (int dt = d0; dt < d0 + kFoldLoads && dt < D_TILES; ++dt) {
      const int col = dt * 8 + 2 * t;
      const float w = scale * fold.take;
      float2 o = make_float2(acc[dt][2 * h] * w, acc[dt][2 * h + 1] * w);
      if (in_range && col < p.head_dim) {
        o = make_float2(fmaf(fold.keep, old[dt - d0].x, o.x), fmaf(fold.keep, old[dt - d0].y, o.y));
        if (!last_piece) *reinterpret_cast<float2*>(acc_row + col) = o;
      }
      *reinterpret_cast<u32*>(staged_at<BLOCK_M>(tile, r, col)) = pack2<T>(o.x, o.y);
    }
  }
  if (t == 0 && in_range && lse != nullptr) lse[row] = fold.lse;
}

// Warpgroup wg's 64 staged rows (rows m0 + wg * 64 .. of out, row stride out_stride) once the
// warpgroup has staged them all (named barrier 1 + wg); rows past seqlen_q and columns past
// head_dim are not written.
template <typename T, int BLOCK_M, int HEAD_DIM>
__device__ __forceinline__ void store_staged_rows(const unsigned char* tile, T* out, i64 out_stride, int m0, int wg, int seqlen_q, int head_dim) {
  constexpr int kChunksPerRow = HEAD_DIM / 8;
  named_barrier_sync(1 + wg, 128);
#pragma unroll
  for (int i = 0; i < 64 * kChunksPerRow / 128; ++i) {
    const int chunk = i * 128 + threadIdx.x % 128;
    const int r = wg * 64 + chunk / kChunksPerRow, c = chunk % kChunksPerRow;
    if (m0 + r < seqlen_q && c * 8 < head_dim) {
      *reinterpret_cast<uint4*>(out + (m0 + r) * out_stride + c * 8) =
          *reinterpret_cast<const uint4*>(tile + (c / 8) * BLOCK_M * kSwizzleRowBytes + swizzled_chunk(r, c % 8));
    }
  }
}

}  // namespace cuattn
