// The Hopper forwards' step between two P V products, once the product of the block before has
// completed: O rescaled for the new row maxima of this block (when softmax_block moved them)
// and this block's probabilities packed as the register A operand of its own P V product.
#pragma once
#include "../common/wgmma.cuh"
#include "online_softmax.cuh"

namespace cuattn {

template <typename T, int BLOCK_N, int D_TILES>
__device__ __forceinline__ void rescale_and_pack(float (&acc)[1][D_TILES][4], u32 (&probs)[BLOCK_N / 16][4], const float (&s)[1][BLOCK_N / 8][4],
                                                 bool rescale, const float (&alpha)[1][2]) {
  fence_registers(acc[0]);
  fence_registers(probs);
  if (rescale) {
    rescale_row(acc, 0, 0, alpha[0][0]);
    rescale_row(acc, 0, 1, alpha[0][1]);
  }
  pack_a_operands<T, BLOCK_N>(probs, s[0]);
}

}  // namespace cuattn
