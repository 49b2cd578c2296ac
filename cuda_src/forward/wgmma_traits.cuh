// Tile shapes of the Hopper forward kernel (forward_wgmma.cu). cuattn/kernels/forward.py computes the same
// shared-memory size (WGMMA_TILES; Variant.contract asserts they agree); the kernel traps if launched with less.
#pragma once
#include "../common/wgmma.cuh"

namespace cuattn {

template <int HEAD_DIM, int BLOCK_N, int WARPGROUPS>
struct WgmmaForwardTraits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kBlockN = BLOCK_N;                 // keys per iteration
  static constexpr int kWarpgroups = WARPGROUPS;          // each owns 64 query rows
  static constexpr int kBlockM = 64 * WARPGROUPS;
  static constexpr int kThreads = 128 * WARPGROUPS;
  static constexpr int kNTiles = BLOCK_N / 8;             // n8 tiles of S per warp
  static constexpr int kDTiles = HEAD_DIM / 8;            // n8 tiles of O per warp
  static constexpr int kColumnBlocks = HEAD_DIM / kSwizzleBlockElems;
  static constexpr int kChunksPerRow = HEAD_DIM / 8;      // 16-byte chunks
  static constexpr int kStages = 2;                       // K/V ring: block n-1 loads while n computes
  static constexpr int kQBytes = kBlockM * HEAD_DIM * 2;
  static constexpr int kKVBytes = BLOCK_N * HEAD_DIM * 2;  // one K or V tile
  // +1024: the dynamic shared memory is realigned to the swizzle period inside the kernel.
  static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + kSwizzleAtomBytes;

  static_assert(HEAD_DIM % kSwizzleBlockElems == 0 && (HEAD_DIM == 64 || HEAD_DIM == 128 || HEAD_DIM == 256), "wgmma N of P V");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "wgmma N of Q K^T");
};

}  // namespace cuattn
