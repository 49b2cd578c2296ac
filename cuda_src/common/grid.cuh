// Where a CTA sits in an attention launch: (block of rows, head, batch) = (blockIdx.x,
// blockIdx.y, blockIdx.z + batch_offset). gridDim.z is at most 65535, so cuattn/kernels/variant.py
// launches larger batches in slices of that many, each with its batch_offset.
#pragma once
#include "params.cuh"

namespace cuattn {

__device__ __forceinline__ int cta_batch(const AttnParams& p) { return blockIdx.z + p.batch_offset; }

}  // namespace cuattn
