// The fused backward's fp32 dQ accumulator (BackwardParams::dq_accum): per (batch, query head),
// tiles of 64 query rows x 64 columns (16 KB, contiguous, so that one bulk reduction adds a
// whole tile), ordered by row block then column block. Inside a tile, rows of 64 floats whose
// float2 slots are swizzled by row: a warp's accumulator fragment (8 rows x 4 float2 per store)
// then hits distinct shared-memory banks when it is staged.
#pragma once
#include "../common/params.cuh"

namespace cuattn {

constexpr int kDqTileRows = 64;
constexpr int kDqTileFloats = kDqTileRows * 64;

// Float offset of (row, col) inside a tile; col is even for the first float of a pair. The
// swizzle flips bits 2 and up of the slot index, so slots 2i and 2i + 1 stay adjacent (16 bytes).
__device__ __forceinline__ int dq_tile_offset(int row, int col) {
  return row * 64 + (((col / 2) ^ ((row % 8) * 4)) * 2) + col % 2;
}

// The tile holding rows 64 * row_block.. and columns 64 * col_block.. of (batch, head).
__device__ __forceinline__ float* dq_accum_tile(const BackwardParams& p, int batch, int head, int row_block, int col_block) {
  const int row_blocks = (p.attn.seqlen_q + kDqTileRows - 1) / kDqTileRows, col_blocks = p.dq_accum_cols / 64;
  return p.dq_accum + ((i64(batch) * p.attn.heads_q + head) * row_blocks + row_block) * i64(col_blocks) * kDqTileFloats +
         i64(col_block) * kDqTileFloats;
}

}  // namespace cuattn
