// Attention backward in one pass for Hopper (sm_90a): dK and dV as backward_wgmma_dkdv.cu, and
// dQ summed into p.dq_accum by bulk reductions (backward/wgmma_dkdv_loop.cuh with FUSE_DQ).
// Not deterministic: attention_backward's default; backward_dq_finish converts dq_accum.
#include "backward/wgmma_dkdv_loop.cuh"

namespace cuattn {

template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, int CTAS_PER_SM, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT = false,
          bool SPARSE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128, CTAS_PER_SM) backward_wgmma_fused_kernel(const __grid_constant__ BackwardParams p) {
  backward_wgmma_dkdv_body<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CTAS_PER_SM, SOFTCAP, true, LAYOUT, DROPOUT, SPARSE>(p);
}

}  // namespace cuattn
