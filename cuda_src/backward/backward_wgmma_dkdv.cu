// Attention backward, dK and dV, for Hopper (sm_90a): the loop of backward/wgmma_dkdv_loop.cuh
// without dQ (backward_wgmma_dq.cu forms it). Deterministic: attention_backward's
// deterministic=True.
#include "backward/wgmma_dkdv_loop.cuh"

namespace cuattn {

template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, int CTAS_PER_SM, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT = false,
          bool SPARSE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128, CTAS_PER_SM) backward_wgmma_dkdv_kernel(const __grid_constant__ BackwardParams p) {
  backward_wgmma_dkdv_body<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CTAS_PER_SM, SOFTCAP, false, LAYOUT, DROPOUT, SPARSE>(p);
}

}  // namespace cuattn
