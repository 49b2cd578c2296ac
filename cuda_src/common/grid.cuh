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

}  // namespace cuattn
