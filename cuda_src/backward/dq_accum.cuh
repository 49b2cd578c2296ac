// The fused backward's fp32 dQ accumulator (BackwardParams::dq_accum): per (sequence, query head),
// tiles of 64 query rows x 64 columns (16 KB, contiguous, so that one bulk reduction adds a
// whole tile), ordered by row block then column block. Inside a tile, rows of 64 floats whose
// float2 slots are swizzled by row: a warp's accumulator fragment (8 rows x 4 float2 per store)
// then hits distinct shared-memory banks when it is staged.
#pragma once
#include "../common/params.cuh"
#include "../common/seq_layout.cuh"

namespace cuattn {

constexpr int kDqTileRows = 64;
constexpr int kDqTileFloats = kDqTileRows * 64;

// Float offset of (row, col) inside a tile; col is even for the first float of a pair. The
// swizzle flips bits 2 and up of the slot index, so slots 2i and 2i + 1 stay adjacent (16 bytes).
__device__ __forceinline__ int dq_tile_offset(int row, int col) {
  return row * 64 + (((col / 2) ^ ((row % 8) * 4)) * 2) + col % 2;
}

// The tile holding rows 64 * row_block.. of a sequence (common/seq_layout.cuh) and columns
// 64 * col_block.. of a query head. A (sequence, head)'s row blocks are consecutive tiles from
// seq * strides[0] + head * strides[1] + q_row0 / 64 (BackwardParams::dq_accum_tile_strides):
// dense tensors (q_row0 = 0) give every (batch, head) its own run; packed sequences share their
// head's run, sequence b shifted by b tiles so that its first block, which may begin mid-tile in
// packed rows, has a tile of its own.
__device__ __forceinline__ float* dq_accum_tile(const BackwardParams& p, int seq, int head, const SeqSpan& span, int row_block, int col_block) {
  const i64 tile = seq * p.dq_accum_tile_strides[0] + head * p.dq_accum_tile_strides[1] + span.q_row0 / kDqTileRows + row_block;
  return p.dq_accum + (tile * (p.dq_accum_cols / 64) + col_block) * kDqTileFloats;
}

}  // namespace cuattn
