// Tile shapes of the tensor-core backward kernels. Each of the 4 warps owns 16 rows of the
// resident block (keys in backward_dkdv, queries in backward_dq); the other operand streams
// through a two-stage shared-memory ring in blocks of BLOCK_STREAM rows. Above head_dim 128 the
// dK/dV kernel splits the gradient columns over SPLITS CTAs (each recomputes the scores): two
// 16 x head_dim fp32 accumulators would not fit in registers. STREAM_ROW_STATS: each stage also
// holds the streamed rows' lse and delta (the dK/dV kernel, unless the device's shared memory
// only fits the tiles; cuattn/kernels/backward.py picks BLOCK_STREAM and it by that limit).
#pragma once
#include "../common/dtypes.cuh"

namespace cuattn {

template <int HEAD_DIM, int BLOCK_STREAM, int SPLITS = 1, bool STREAM_ROW_STATS = false>
struct BackwardTraits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockResident = kWarps * 16;
  static constexpr int kBlockStream = BLOCK_STREAM;
  static constexpr int kNTiles = BLOCK_STREAM / 8;   // n8 tiles of a warp's 16 x BLOCK_STREAM scores
  static constexpr int kDTiles = HEAD_DIM / 8;       // n8 tiles of a 16 x head_dim accumulator
  static constexpr int kSplits = SPLITS;
  static constexpr int kOutCols = HEAD_DIM / SPLITS;  // gradient columns one CTA accumulates
  static constexpr int kOutTiles = kOutCols / 8;
  static constexpr int kRowStride = HEAD_DIM + 8;    // padded shared rows, as in the forward
  static constexpr int kChunksPerRow = HEAD_DIM / 8;
  static constexpr int kStages = 2;
  static constexpr int kSmemResident = kBlockResident * kRowStride;
  static constexpr int kSmemStream = BLOCK_STREAM * kRowStride;
  // Two resident tiles, two streamed tiles per stage, and per stage two fp32 row vectors.
  static constexpr int kSmemBytes =
      (2 * kSmemResident + 2 * kStages * kSmemStream) * 2 + (STREAM_ROW_STATS ? 2 * kStages * BLOCK_STREAM * 4 : 0);

  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "backward head-dim bucket");
  static_assert(kOutCols % 16 == 0, "whole 16-column steps per split");
  static_assert(BLOCK_STREAM % 16 == 0, "whole k16 steps");
};

}  // namespace cuattn
