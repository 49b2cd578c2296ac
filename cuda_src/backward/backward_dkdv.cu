// Attention backward, dK and dV: the kernel of backward/dkdv_block.cuh, one CTA per (key block
// [x query split], KV head [x column split], batch).
#include "backward/dkdv_block.cuh"

namespace cuattn {

template <typename T, int HEAD_DIM, int BLOCK_Q, bool STATS_IN_SMEM, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT = false, bool SPARSE = false>
__global__ void __launch_bounds__(128, 1) backward_dkdv_kernel(const __grid_constant__ BackwardParams p) {
  const GridCell cell = grid_cell<SPARSE && kDkdvOrdered<HEAD_DIM, SOFTCAP>>(p.attn);
  backward_dkdv_block<T, HEAD_DIM, BLOCK_Q, STATS_IN_SMEM, SOFTCAP, LAYOUT, DROPOUT, SPARSE, false>(p, cell.x, cell.y, gridDim.x);
}

}  // namespace cuattn
