// Where a CTA sits in an attention launch: (block of rows, head, batch) = (blockIdx.x,
// blockIdx.y, blockIdx.z + batch_offset). gridDim.z is at most 65535, so cuattn/kernels/variant.py
// launches larger batches in slices of that many, each with its batch_offset.
#pragma once
#include "params.cuh"

namespace cuattn {

__device__ __forceinline__ int cta_batch(const AttnParams& p) { return blockIdx.z + p.batch_offset; }

// The (x, y) grid position whose work this CTA does: its own, or in a block-sparse launch the
// cell its schedule gives it (AttnParams::block_schedule, always set there:
// sparse/block_schedule.cu), so that the cells of the heaviest mask rows start first.
struct GridCell {
  int x, y;
};

template <bool SPARSE>
__device__ __forceinline__ GridCell grid_cell(const AttnParams& p) {
  if constexpr (SPARSE) {
    const int cell = p.block_schedule[cta_batch(p) * p.block_schedule_stride + int(blockIdx.y * gridDim.x + blockIdx.x)];
    return {cell % int(gridDim.x), cell / int(gridDim.x)};
  } else {
    return {int(blockIdx.x), int(blockIdx.y)};
  }
}

// The cell of a key-block grid (the dK / dV kernels: x key block, y KV head). Under a mask whose
// band is bounded on the right only (causal), key block x's query steps fall with x, and the
// grid's own order (a head's blocks heaviest first, one head after another) leaves the last
// heads' heaviest blocks to start in the last wave. There the cells of a sequence are taken key
// block by key block, heads fastest: every head's heaviest blocks start first and the grid ends
// on light ones. Other masks keep the grid's own order.
__device__ __forceinline__ GridCell key_block_cell(const AttnParams& p) {
  if (p.window_right >= 0 && p.window_left < 0) {
    const int i = int(blockIdx.y * gridDim.x + blockIdx.x);
    return {i / int(gridDim.y), i % int(gridDim.y)};
  }
  return {int(blockIdx.x), int(blockIdx.y)};
}

}  // namespace cuattn
