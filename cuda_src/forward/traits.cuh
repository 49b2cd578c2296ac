// Tile shapes of the tensor-core forward kernel. cuattn/kernels/forward.py holds the table that picks
// (BLOCK_M, BLOCK_N, WARPS) per head-dim bucket and computes the same shared-memory size; the
// kernel checks at entry that it was launched with at least kSmemBytes.
#pragma once
#include "../common/dtypes.cuh"

namespace cuattn {

template <int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS>
struct ForwardTraits {
  static constexpr int kHeadDim = HEAD_DIM;    // padded head dim (bucket); the true one is p.head_dim
  static constexpr int kBlockM = BLOCK_M;      // query rows per CTA
  static constexpr int kBlockN = BLOCK_N;      // keys per iteration
  static constexpr int kWarps = WARPS;
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kWarpRows = BLOCK_M / WARPS;  // each warp owns a contiguous band of rows
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kNTiles = BLOCK_N / 8;        // n8 tiles of S per m16 tile
  static constexpr int kDTiles = HEAD_DIM / 8;       // n8 tiles of O
  // Shared-memory rows are padded by 16 bytes so the 8 row addresses of an ldmatrix fall in
  // distinct bank groups.
  static constexpr int kRowStride = HEAD_DIM + 8;    // elements
  static constexpr int kChunksPerRow = HEAD_DIM / 8; // 16-byte chunks
  static constexpr int kStages = 2;                  // K/V ring: block n+1 loads while n computes
  static constexpr int kSmemQ = BLOCK_M * kRowStride;
  static constexpr int kSmemKV = BLOCK_N * kRowStride;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kStages * kSmemKV) * 2;
  // Unrolling of the S = Q K^T loop over head_dim: full unrolling lets the compiler hoist every
  // K fragment into registers at once, which spills once S and O fill most of the budget.
  static constexpr int kAccRegs = kMTiles * (kNTiles + kDTiles) * 4;
  static constexpr int kQkUnroll = kAccRegs >= 192 ? 1 : HEAD_DIM / 16;

  static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "head-dim bucket");
  static_assert(kWarpRows % 16 == 0 && kMTiles >= 1, "each warp owns whole m16 tiles");
  static_assert(BLOCK_N % 16 == 0 && kDTiles % 2 == 0 && kNTiles % 2 == 0, "x4 ldmatrix pairs tiles");
};

}  // namespace cuattn
