// Device-side check of the cu_seqlens offsets of a varlen call whose offsets live on the GPU
// (the host never reads them: that would synchronize). The attention kernels clamp offsets into
// [0, total], so bad ones never move an access out of bounds; this kernel makes them an error:
// the first bad entry found is written, once, into a word of pinned host memory that the host
// reads at its next varlen call (cuattn/packed.py decodes it).
#include "common/params.cuh"

namespace cuattn {

// Report codes: 1 + 4 * which (0 query, 1 key) + rule.
enum OffsetRule { kFirstNotZero = 0, kDecreasing = 1, kLastNotTotal = 2, kLongerThanBound = 3 };

__device__ __forceinline__ void check_offset_entry(const OffsetCheckParams& p, int which, int i) {
  const int* cu = p.cu_seqlens[which];
  const int here = cu[i];
  int rule = -1;
  if (i == 0) {
    if (here != 0) rule = kFirstNotZero;
  } else {
    const int before = cu[i - 1];
    if (here < before) rule = kDecreasing;
    else if (i64(here) - before > p.bounds[which]) rule = kLongerThanBound;
  }
  if (rule < 0 && i == p.batch && here != p.totals[which]) rule = kLastNotTotal;
  if (rule >= 0) atomicCAS(p.report, 0ull, (u64(1 + 4 * which + rule) << 32) | u32(i));
}

template <int THREADS>
__global__ void __launch_bounds__(THREADS) check_offsets_kernel(const __grid_constant__ OffsetCheckParams p) {
  // 64-bit: with batch near 2**31 the step past the last entry would wrap an int to a negative index
  for (i64 i = i64(blockIdx.x) * THREADS + threadIdx.x; i <= p.batch; i += i64(gridDim.x) * THREADS) {
    check_offset_entry(p, 0, int(i));
    check_offset_entry(p, 1, int(i));
  }
}

}  // namespace cuattn
