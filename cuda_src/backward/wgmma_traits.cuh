// Tile shapes of the Hopper backward kernels (backward_wgmma_dq.cu, backward_wgmma_dkdv.cu).
// WARPGROUPS of 64 resident rows each (queries for dQ, keys for dK/dV; above head_dim 128 the
// fused kernel's two warpgroups share 64 keys, kColumnSplits); the other operand pair
// streams through a two-stage ring in blocks of BLOCK_STREAM rows, in the 128-byte-swizzled
// layout of common/wgmma.cuh. cuattn/kernels/backward.py computes the same shared-memory size
// (Variant.contract: tests/test_compile.py asserts they agree).
#pragma once
#include "../common/wgmma.cuh"

namespace cuattn {

template <int HEAD_DIM, int BLOCK_STREAM, int WARPGROUPS>
struct WgmmaBackwardTraits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kWarpgroups = WARPGROUPS;
  static constexpr int kThreads = 128 * kWarpgroups;
  // Above head_dim 128 the warpgroups share the CTA's 64 resident rows and split the gradients'
  // columns (64 x 256 fp32 accumulators would not fit one warpgroup's registers): each forms the
  // scores of half of the streamed rows, and its columns of the gradients over all of them:
  // warpgroup 0 columns 0..kOutCols-1, warpgroup 1 the other kLastOutCols (128 at 256, 64 at 192:
  // an MN-major operand's columns start on a 64-column swizzle block).
  static constexpr int kColumnSplits = HEAD_DIM > 128 ? 2 : 1;
  static constexpr int kOutCols = kColumnSplits > 1 ? 128 : HEAD_DIM;
  static constexpr int kLastOutCols = HEAD_DIM - (kColumnSplits - 1) * kOutCols;
  static constexpr int kBlockResident = kColumnSplits > 1 ? 64 : 64 * kWarpgroups;
  static constexpr int kBlockStream = BLOCK_STREAM;
  static constexpr int kNTiles = BLOCK_STREAM / 8;  // n8 tiles of a warp's 16 x BLOCK_STREAM scores
  static constexpr int kDTiles = kOutCols / 8;      // n8 tiles of a 16 x kOutCols accumulator
  static constexpr int kChunksPerRow = HEAD_DIM / 8;
  static constexpr int kStages = 2;
  static constexpr int kResidentBytes = kBlockResident * HEAD_DIM * 2;
  static constexpr int kStreamBytes = BLOCK_STREAM * HEAD_DIM * 2;
  // Two resident tiles, two streamed tiles per stage, per stage two fp32 row vectors, and the
  // realignment of the dynamic shared memory to the swizzle period.
  static constexpr int kSmemBytes = 2 * kResidentBytes + 2 * kStages * kStreamBytes + 2 * kStages * BLOCK_STREAM * 4 + kSwizzleAtomBytes;

  static_assert((kOutCols == 64 || kOutCols == 128) && (kLastOutCols == 64 || kLastOutCols == 128), "wgmma N of the gradient products");
  static_assert(HEAD_DIM % 64 == 0, "whole swizzled column blocks");
  static_assert(kColumnSplits == 1 || kWarpgroups == kColumnSplits, "a column share per warpgroup");
  static_assert(BLOCK_STREAM == 64 || BLOCK_STREAM == 128, "wgmma N of the score products");
};

// The fused kernel (backward_wgmma_fused.cu) adds to the dK/dV tiles the step's dS^T in shared
// memory (keys x streamed queries, column blocks of 64 queries) and splits the step's dQ tile
// (BLOCK_STREAM x head_dim) into pieces of 64 rows x kDqCols columns, kDqPiecesPerWarpgroup to
// each warpgroup; each warpgroup stages a piece in fp32 for the bulk reduction into dq_accum.
// Where the columns are split (kColumnSplits) the step's P^T goes through shared memory too
// (kPBytes), and a warpgroup's 64-column pieces, one per 64 of its columns, are staged in its own
// columns of the step's Q and dO tiles, which nothing reads by then (at 256 the tiles leave no
// room for stages); a share of 64 columns (the last at 192) has too few there for its piece and
// stages it in kShareStageBytes of its own.
template <int HEAD_DIM, int BLOCK_STREAM, int WARPGROUPS>
struct WgmmaFusedTraits : WgmmaBackwardTraits<HEAD_DIM, BLOCK_STREAM, WARPGROUPS> {
  using Base = WgmmaBackwardTraits<HEAD_DIM, BLOCK_STREAM, WARPGROUPS>;
  static constexpr int kDsBytes = Base::kBlockResident * BLOCK_STREAM * 2;
  static constexpr int kDqRowPieces = BLOCK_STREAM / 64;
  static constexpr int kOutCols = Base::kOutCols;
  static constexpr bool kSplit = Base::kColumnSplits > 1;
  static constexpr int kDqCols = kSplit ? 64 : kDqRowPieces >= WARPGROUPS ? HEAD_DIM : HEAD_DIM * kDqRowPieces / WARPGROUPS;
  static constexpr int kDqColPieces = HEAD_DIM / kDqCols;
  static constexpr int kDqPieces = kDqRowPieces * kDqColPieces;
  static constexpr int kDqPiecesPerWarpgroup = kDqPieces / WARPGROUPS;  // without column shares
  static constexpr int kDqStageBytes = 64 * kDqCols * 4;  // per warpgroup, or per piece of a column share
  static constexpr int kPBytes = kSplit ? kDsBytes : 0;
  static constexpr int kShareStageBytes = kSplit && Base::kLastOutCols < 128 ? kDqStageBytes : 0;
  static constexpr int kSmemBytes = Base::kSmemBytes + kDsBytes + kPBytes + (kSplit ? kShareStageBytes : WARPGROUPS * kDqStageBytes);

  static_assert(kDqCols == 64 || kDqCols == 128, "wgmma N of the dQ product");
  static_assert(kSplit || kDqPieces % WARPGROUPS == 0, "as many dQ pieces for every warpgroup");
  static_assert(!kSplit || (kDqRowPieces == 1 && 64 * 128 * 2 == kDqStageBytes), "a 128-column share's piece fills its columns of a Q or dO tile");
};

}  // namespace cuattn
