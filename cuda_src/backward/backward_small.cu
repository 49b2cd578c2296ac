// Attention backward of a small problem in one launch, for calls whose time is the host's:
// the CTAs of the dQ kernel (backward/dq_block.cuh) and of the dK / dV kernel
// (backward/dkdv_block.cuh) side by side on gridDim.x, each summing the delta of the rows it
// reads (backward/row_delta.cuh) instead of reading a backward_prep pass's. No atomics, no
// scratch memory: deterministic. Dense rows, 16-bit types, head_dim <= 128 (one column split),
// no dropout, block mask or sink; cuattn/kernels/backward.py picks it for grids of one wave.
//
// Grid: x = query blocks (dQ CTAs, kBlockResident rows each) then key blocks (dK / dV CTAs),
// y = query heads (the dK / dV CTAs past heads_kv return at once), z = sequences.
#include "backward/dkdv_block.cuh"
#include "backward/dq_block.cuh"

namespace cuattn {

template <typename T, int HEAD_DIM, int BLOCK_K, int BLOCK_Q, bool SOFTCAP>
__global__ void __launch_bounds__(128, 1) backward_small_kernel(const __grid_constant__ BackwardParams p) {
  static_assert(kDkdvSplits<HEAD_DIM> == 1, "one CTA per key block");
  constexpr int kRows = BackwardTraits<HEAD_DIM, BLOCK_K>::kBlockResident;
  const int q_blocks = (p.attn.seqlen_q + kRows - 1) / kRows;
  if (int(blockIdx.x) < q_blocks) {
    backward_dq_block<T, HEAD_DIM, BLOCK_K, SOFTCAP, SeqLayout::kDense, false, false, true>(p, blockIdx.x, blockIdx.y, q_blocks);
  } else if (int(blockIdx.y) < p.attn.heads_kv) {
    backward_dkdv_block<T, HEAD_DIM, BLOCK_Q, true, SOFTCAP, SeqLayout::kDense, false, false, true>(p, blockIdx.x - q_blocks, blockIdx.y, gridDim.x - q_blocks);
  }
}

}  // namespace cuattn
