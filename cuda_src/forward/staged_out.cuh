// The Hopper forwards' output path: each warpgroup stages its 64 rows of out in its own rows of
// the Q tile (128-byte-swizzled column blocks, common/wgmma.cuh; its products are done and no
// other warpgroup reads those rows), then stores them to global memory in 16-byte chunks.
#pragma once
#include "../common/named_barrier.cuh"
#include "../common/wgmma.cuh"

namespace cuattn {

// Row half h (rows g and g + 8 of the warp's m16 tile) of the accumulator, times `scale`, into
// row r of the staged tile of BLOCK_M rows.
template <typename T, int BLOCK_M, int D_TILES>
__device__ __forceinline__ void stage_out_row(unsigned char* tile, const float (&acc)[D_TILES][4], int h, int r, float scale) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int dt = 0; dt < D_TILES; ++dt) {
    const int col = dt * 8 + 2 * t;
    unsigned char* dst = tile + (col / kSwizzleBlockElems) * BLOCK_M * kSwizzleRowBytes + swizzled_chunk(r, col % kSwizzleBlockElems / 8) + (col % 8) * 2;
    *reinterpret_cast<u32*>(dst) = pack2<T>(acc[dt][2 * h] * scale, acc[dt][2 * h + 1] * scale);
  }
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
