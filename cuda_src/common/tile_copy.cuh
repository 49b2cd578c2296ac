// Global -> shared tile copies with cp.async for the tiled attention kernels. Tr supplies
// kThreads, kChunksPerRow (16-byte chunks of the padded head dim), kRowStride and kHeadDim.
#pragma once
#include "mma.cuh"
#include "seq_layout.cuh"
#include "wgmma.cuh"

namespace cuattn {

// Copies rows [row0, row0 + ROWS) of one head of a (batch, seq, head, dim) tensor into a padded
// shared tile, zero-filling rows >= row_end and columns >= head_dim.
template <typename Tr, int ROWS, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, i64 row_stride, int row0, int row_end, int head_dim) {
  constexpr int kChunks = ROWS * Tr::kChunksPerRow;
  constexpr int kRounds = (kChunks + Tr::kThreads - 1) / Tr::kThreads;
  if constexpr (Tr::kThreads % Tr::kChunksPerRow == 0) {
    static_assert(kChunks % Tr::kThreads == 0, "whole copy rounds");
    // Each thread copies the same column of rows r, r + kRowsPerRound, ...: one address
    // computation per tile, and no predicates when the tile is whole.
    constexpr int kRowsPerRound = Tr::kThreads / Tr::kChunksPerRow;
    const int r = threadIdx.x / Tr::kChunksPerRow, c = (threadIdx.x % Tr::kChunksPerRow) * 8;
    const T* src = gmem + (row0 + r) * row_stride + c;
    T* dst = smem + r * Tr::kRowStride + c;
    if (row0 + ROWS <= row_end && head_dim == Tr::kHeadDim) {
#pragma unroll
      for (int i = 0; i < kRounds; ++i) cp_async_16(dst + i * kRowsPerRound * Tr::kRowStride, src + i * kRowsPerRound * row_stride);
    } else {
#pragma unroll
      for (int i = 0; i < kRounds; ++i) {
        const bool valid = row0 + r + i * kRowsPerRound < row_end && c < head_dim;
        cp_async_16(dst + i * kRowsPerRound * Tr::kRowStride, valid ? src + i * kRowsPerRound * row_stride : gmem, valid);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      const int chunk = i * Tr::kThreads + threadIdx.x;
      if (kChunks % Tr::kThreads != 0 && chunk >= kChunks) break;  // the last round is partial
      const int r = chunk / Tr::kChunksPerRow, c = (chunk % Tr::kChunksPerRow) * 8;
      const bool valid = row0 + r < row_end && c < head_dim;
      cp_async_16(smem + r * Tr::kRowStride + c, valid ? gmem + (row0 + r) * row_stride + c : gmem, valid);
    }
  }
}

// The same copy into the 128-byte-swizzled column-block layout of common/wgmma.cuh (no padding);
// smem is 1024-byte aligned. Each thread keeps one chunk column and swizzle phase, so a round
// copies a multiple of 8 rows; threads past a round's chunks (24 chunks a row at head_dim 192)
// copy nothing.
template <typename Tr, int ROWS, typename T>
__device__ __forceinline__ void load_tile_sw128(unsigned char* smem, const T* gmem, i64 row_stride, int row0, int row_end, int head_dim) {
  constexpr int kRowsPerRound = Tr::kThreads / Tr::kChunksPerRow / 8 * 8;
  constexpr int kRounds = (ROWS + kRowsPerRound - 1) / kRowsPerRound;
  static_assert(kRowsPerRound >= 8, "one chunk column and swizzle phase per thread");
  if (kRowsPerRound * Tr::kChunksPerRow < Tr::kThreads && int(threadIdx.x) >= kRowsPerRound * Tr::kChunksPerRow) return;
  const int r = threadIdx.x / Tr::kChunksPerRow, c = threadIdx.x % Tr::kChunksPerRow;
  unsigned char* dst = smem + (c / 8) * (ROWS * kSwizzleRowBytes) + swizzled_chunk(r, c % 8);
  const T* src = gmem + (row0 + r) * row_stride + c * 8;
  if (row0 + ROWS <= row_end && head_dim == Tr::kHeadDim) {
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      if (ROWS % kRowsPerRound != 0 && r + i * kRowsPerRound >= ROWS) break;  // the short last round
      cp_async_16(dst + i * kRowsPerRound * kSwizzleRowBytes, src + i * kRowsPerRound * row_stride);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kRounds; ++i) {
      if (ROWS % kRowsPerRound != 0 && r + i * kRowsPerRound >= ROWS) break;
      const bool valid = row0 + r + i * kRowsPerRound < row_end && c * 8 < head_dim;
      cp_async_16(dst + i * kRowsPerRound * kSwizzleRowBytes, valid ? src + i * kRowsPerRound * row_stride : gmem, valid);
    }
  }
}

// Paged caches: where each key of a block lives is read from the block table one block ahead of
// its copies. A thread per key loads its page number into a register while the block before is
// computed (page_of_key), and at the next iteration, before the barrier that precedes the
// copies, stores the key's element offsets in K and V into shared memory (store_key_offsets):
// two blocks' offsets, by block parity. The copies then neither wait on the table nor compute
// an address per chunk. Each half must be rewritten only after a barrier that follows every
// copy reading it: a kernel that copies K and V of a block in different iterations
// (forward_wgmma.cu) stores each one's offsets just before the barrier of its own copies.
template <int BLOCK_N>
constexpr int kPageAheadBytes = 2 * 2 * BLOCK_N * 8;  // two blocks, K and V, 64-bit offsets

// The block table's entry (unclamped: the load stays in flight until store_key_offsets clamps it).
template <int BLOCK_N>
__device__ __forceinline__ int page_of_key(const CacheRows<true>& cache, int n_block, int n_first, int row_end) {
  const int j = n_block * BLOCK_N + int(threadIdx.x);
  return threadIdx.x < BLOCK_N && n_block >= n_first && j < row_end ? cache.table_entry(j) : 0;
}

// Offsets of block n_block's keys: s_offsets[(n_block & 1) * 2 * BLOCK_N + key] in K, + BLOCK_N in
// V. KV: which of them to store, K (0), V (1) or both (2).
template <int BLOCK_N, int KV = 2>
__device__ __forceinline__ void store_key_offsets(i64* s_offsets, const AttnParams& p, const CacheRows<true>& cache, int n_block, int page) {
  if (threadIdx.x >= BLOCK_N) return;
  page = cache.clamp_row(page);
  const i64 pos = cache.pos_of(max(n_block, 0) * BLOCK_N + int(threadIdx.x));
  i64* offsets = s_offsets + (n_block & 1) * 2 * BLOCK_N + threadIdx.x;
  if (KV != 1) offsets[0] = page * p.k_strides[0] + pos * p.k_strides[1];
  if (KV != 0) offsets[BLOCK_N] = page * p.v_strides[0] + pos * p.v_strides[1];
}

// Key rows [row0, row0 + ROWS) of one KV head of a paged cache (gmem: the head in page 0): row
// row0 + r at gmem + row_offsets[r] (store_key_offsets). Into a padded tile (load_tile's layout)
// or, with SW128, the swizzled one of load_tile_sw128.
template <typename Tr, int ROWS, bool SW128, typename T, typename Smem>
__device__ __forceinline__ void load_paged_tile(Smem* smem, const T* gmem, const i64* row_offsets, int row0, int row_end, int head_dim) {
  constexpr int kChunks = ROWS * Tr::kChunksPerRow;
  constexpr int kRounds = (kChunks + Tr::kThreads - 1) / Tr::kThreads;
#pragma unroll
  for (int i = 0; i < kRounds; ++i) {
    const int chunk = i * Tr::kThreads + threadIdx.x;
    if (kChunks % Tr::kThreads != 0 && chunk >= kChunks) break;  // the last round is partial
    const int tile_row = chunk / Tr::kChunksPerRow, c = chunk % Tr::kChunksPerRow;
    const bool valid = row0 + tile_row < row_end && c * 8 < head_dim;
    unsigned char* dst;
    if constexpr (SW128) {
      dst = reinterpret_cast<unsigned char*>(smem) + (c / 8) * (ROWS * kSwizzleRowBytes) + swizzled_chunk(tile_row, c % 8);
    } else {
      dst = reinterpret_cast<unsigned char*>(smem + tile_row * Tr::kRowStride + c * 8);
    }
    cp_async_16(dst, gmem + (valid ? row_offsets[tile_row] + c * 8 : 0), valid);
  }
}

}  // namespace cuattn
