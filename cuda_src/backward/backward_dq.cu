// Attention backward, dQ: the kernel of backward/dq_block.cuh, one CTA per (query block, query
// head, batch).
#include "backward/dq_block.cuh"

namespace cuattn {

template <typename T, int HEAD_DIM, int BLOCK_K, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT = false, bool SPARSE = false>
__global__ void __launch_bounds__(128, 1) backward_dq_kernel(const __grid_constant__ BackwardParams p) {
  const GridCell cell = grid_cell<SPARSE>(p.attn);
  backward_dq_block<T, HEAD_DIM, BLOCK_K, SOFTCAP, LAYOUT, DROPOUT, SPARSE, false>(p, cell.x, cell.y, gridDim.x);
}

}  // namespace cuattn
