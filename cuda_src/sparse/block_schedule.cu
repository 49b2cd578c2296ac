// The order of a block-sparse launch's CTAs (AttnParams::block_schedule). A CTA's work is one
// grid cell (a tile of rows of one head) and costs about the kept blocks of its mask row; a
// mask where a few rows keep far more blocks than the rest (a global row or column) would leave
// those cells to the end of the launch, where they run alone. Cells of at least twice the
// average weight are moved to the front, heaviest power-of-two class first; within a class,
// and for all the rest, the launch's own order stays (x fastest, so that CTAs running together
// share a head's K / V or Q / dO in L2: sorting every cell by weight cost the backward up to 27%
// on random masks). The attention kernels read which cell each CTA does (grid_cell,
// common/grid.cuh). One CTA per order: it sums the weights; each warp counts the classes of a
// contiguous run of cells; one warp turns the counts into each (class, warp)'s first position
// (classes from the heaviest, warps in order); then each warp places its run 32 cells at a
// time (lanes of one class by lane rank). The order is deterministic.
#include "common/block_sparse.cuh"
#include "common/params.cuh"

namespace cuattn {

constexpr int kScheduleClasses = 32;  // class c >= 1: weight in [2^c, 2^(c+1)) x the average
constexpr int kCachedCells = 16384;   // cells whose weight is kept in shared memory between passes

__device__ __forceinline__ int cell_weight(const BlockScheduleParams& p, int entry, int cell) {
  const int x = cell % p.tiles, y = cell / p.tiles;
  const int row = p.reversed ? p.tiles - 1 - x : x;
  const int mask_row = min(int(i64(row) * p.tile_rows / kSparseBlock), p.mask_rows - 1);
  const int head0 = y / p.y_per_head * p.group;
  i64 weight = 0;  // counts clamped: a malformed mask cannot overflow the sum
  for (int g = 0; g < p.group; ++g) weight += min(max(p.counts[entry * p.count_strides[0] + (head0 + g) * p.count_strides[1] + mask_row], 0), 0xffff);
  return int(min(weight, i64(0xffff)));
}

__device__ __forceinline__ int weight_class(int weight, float average) {
  const float ratio = __fdiv_rn(float(weight), average);
  return ratio >= 2.f ? min(ilogbf(ratio), kScheduleClasses - 1) : 0;  // ilogbf: exact floor(log2)
}

/// \brief Fills the schedule of entry blockIdx.x (BlockScheduleParams::schedule, common/params.cuh).
template <int THREADS>
__global__ void __launch_bounds__(THREADS) block_schedule_kernel(const __grid_constant__ BlockScheduleParams p) {
  constexpr int kWarps = THREADS / 32;
  static_assert(THREADS % 32 == 0 && kWarps <= 32 && kScheduleClasses == 32, "whole warps, at most a warp of them; a class per lane");
  __shared__ unsigned short cached[kCachedCells];
  __shared__ int slots[kWarps][kScheduleClasses];  // cells per (warp, class), then the next position of each
  __shared__ unsigned long long total;
  const int entry = blockIdx.x, cells = p.ys * p.tiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  slots[warp][lane] = 0;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long sum = 0;
  for (int i = threadIdx.x; i < cells; i += THREADS) {
    const int w = cell_weight(p, entry, i);
    if (i < kCachedCells) cached[i] = w;
    sum += w;
  }
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffff, sum, offset);
  if (lane == 0) atomicAdd(&total, sum);
  __syncthreads();
  const float average = max(__fdiv_rn(float(total), float(max(cells, 1))), 1.f);
  const auto weight = [&](int i) { return i < kCachedCells ? int(cached[i]) : cell_weight(p, entry, i); };
  const int run = (cells + kWarps - 1) / kWarps, first = warp * run, last = min(first + run, cells);  // this warp's cells
  const auto class_of = [&](int i) { return i < last ? weight_class(weight(i), average) : -1; };  // -1: past the run
  for (int base = first; base < first + run; base += 32) {  // whole warps: every lane in each step
    const int c = class_of(base + lane);
    const unsigned peers = __match_any_sync(0xffffffff, c);
    if (c >= 0 && lane == __ffs(peers) - 1) slots[warp][c] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();

  if (warp == 0) {  // lane c: class c's first position (the cells of the classes above), then each warp's
    int count = 0;
    for (int w = 0; w < kWarps; ++w) count += slots[w][lane];
    int above = count;  // inclusive suffix sum over classes, then less its own
    for (int offset = 1; offset < 32; offset *= 2) {
      const int n = __shfl_down_sync(0xffffffff, above, offset);
      if (lane + offset < 32) above += n;
    }
    int next = above - count;
    for (int w = 0; w < kWarps; ++w) {
      const int n = slots[w][lane];
      slots[w][lane] = next;
      next += n;
    }
  }
  __syncthreads();

  int* order = p.schedule + i64(entry) * cells;
  for (int base = first; base < first + run; base += 32) {
    const int i = base + lane, c = class_of(i);
    const unsigned peers = __match_any_sync(0xffffffff, c);
    const int leader = __ffs(peers) - 1;
    int at = 0;
    if (lane == leader && c >= 0) {
      at = slots[warp][c];
      slots[warp][c] = at + __popc(peers);
    }
    at = __shfl_sync(0xffffffff, at, leader);
    if (c >= 0) order[at + __popc(peers & ((1u << lane) - 1))] = i;
    __syncwarp();
  }
}

}  // namespace cuattn
