// Attention backward, dQ, for Hopper (sm_90a): backward_dq.cu's scheme on warpgroup tensor
// cores. One CTA per (query block of 64 rows per warpgroup, query head, sequence) keeps Q, dO and
// the fp32 dQ accumulator on chip and streams the visible key blocks. Per key block each
// warpgroup forms S = Q K^T and dP = dO V^T for its 64 rows (shared-memory operands), P from the
// saved lse, dS = P (dP - delta) and dQ += dS K (dS from registers). No atomics: deterministic.
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "backward/head_rows.cuh"
#include "backward/score_grad.cuh"
#include "backward/wgmma_traits.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "common/tile_copy.cuh"
#include "common/wgmma.cuh"

namespace cuattn {

// DROPOUT: dropout on the probabilities (common/dropout.cuh). SPARSE: only the blocks of a
// block mask (common/block_sparse.cuh; dense layout).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int CTAS_PER_SM, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT = false,
          bool SPARSE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128, CTAS_PER_SM) backward_wgmma_dq_kernel(const __grid_constant__ BackwardParams p) {
  using Tr = WgmmaBackwardTraits<HEAD_DIM, BLOCK_N, WARPGROUPS>;
  constexpr int BM = Tr::kBlockResident;  // query rows per CTA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  unsigned char* sQ = smem_raw + (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
  unsigned char* sdO = sQ + Tr::kResidentBytes;
  unsigned char* sK_ring = sdO + Tr::kResidentBytes;
  unsigned char* sV_ring = sK_ring + Tr::kStages * Tr::kStreamBytes;

  const AttnParams& a = p.attn;
  const GridCell cell = grid_cell<SPARSE>(a);
  const int m_block = gridDim.x - 1 - cell.x;  // heaviest first under a causal mask
  const int head = cell.y, batch = cta_batch(a);
  const int m0 = m_block * BM;
  const SeqSpan span = seq_span<LAYOUT>(a, batch);
  if (!grid_covers<LAYOUT, BM>(span.seqlen_q) && cell.x == 0)
    mark_uncovered_rows<T>(head_rows<T>(p.dq, p.dq_strides, batch, head, span.q_row0), p.dq_strides[1], nullptr, a.head_dim, int(gridDim.x) * BM, span.seqlen_q);
  if (!block_in_sequence<LAYOUT>(m0, span.seqlen_q)) return;
  const int m_last = min(m0 + BM, span.seqlen_q) - 1;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int kv_head = head / (a.heads_q / a.heads_kv);

  const T* q = head_rows<T>(a.q, a.q_strides, batch, head, span.q_row0);
  const T* dout = head_rows<T>(p.dout, p.dout_strides, batch, head, span.q_row0);
  const T* k = head_rows<T>(a.k, a.k_strides, batch, kv_head, span.k_row0);
  const T* v = head_rows<T>(a.v, a.v_strides, batch, kv_head, span.k_row0);
  const KeyBand band(a, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  const int n_first = key_first / BLOCK_N;
  const int n_last = key_last < key_first ? n_first - 1 : key_last / BLOCK_N;
  const KeyTiles<SPARSE, BLOCK_N, BM> tiles(a, batch, head, m0, n_first, n_last);

  const int wg_first_row = m0 + wg * 64;
  const int wg_last_row = min(wg_first_row + 64, span.seqlen_q) - 1;
  const int wg_first_key = band.first_key(wg_first_row), wg_last_key = band.last_key(wg_last_row);
  const int warp_first_row = wg_first_row + warp * 16;
  const int warp_last_row = min(warp_first_row + 16, span.seqlen_q) - 1;
  float shift[2], delta[2];  // rows g and g + 8 of the warp
  const RowStats stats(p, batch, head, span);
#pragma unroll
  for (int h = 0; h < 2; ++h) stats.row(warp_first_row + g + h * 8, span.seqlen_q, shift[h], delta[h]);

  const auto load_kv = [&](int n_block, int stage) {
    load_tile_sw128<Tr, BLOCK_N>(sK_ring + stage * Tr::kStreamBytes, k, a.k_strides[1], n_block * BLOCK_N, span.seqlen_k, a.head_dim);
    load_tile_sw128<Tr, BLOCK_N>(sV_ring + stage * Tr::kStreamBytes, v, a.v_strides[1], n_block * BLOCK_N, span.seqlen_k, a.head_dim);
  };
  if (tiles.any()) {
    load_tile_sw128<Tr, BM>(sQ, q, a.q_strides[1], m0, span.seqlen_q, a.head_dim);
    load_tile_sw128<Tr, BM>(sdO, dout, p.dout_strides[1], m0, span.seqlen_q, a.head_dim);
    load_kv(tiles.start(), 0);
    cp_async_commit();
  }

  float dq[Tr::kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;
  const u32 q_addr = smem_addr(sQ), do_addr = smem_addr(sdO);

  for (int i = 0, n_block = tiles.start(), stage = 0; tiles.more(i, n_block); n_block = tiles.next(i, n_block), ++i, stage ^= 1) {
    const int n0 = n_block * BLOCK_N;
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // this stage (and Q, dO) landed; every warpgroup finished with the other one
    if (tiles.has_next(i, n_block)) {
      load_kv(tiles.next(i, n_block), stage ^ 1);
      cp_async_commit();
    }
    if (wg_last_row < wg_first_row || n0 > wg_last_key || n0 + BLOCK_N <= wg_first_key) continue;
    const bool masked = !band.all_visible(warp_first_row, warp_last_row, n0, n0 + BLOCK_N - 1);
    const u32 k_addr = smem_addr(sK_ring + stage * Tr::kStreamBytes), v_addr = smem_addr(sV_ring + stage * Tr::kStreamBytes);

    float s[Tr::kNTiles][4], dp[Tr::kNTiles][4];
    wgmma_fence();
    wgmma_rows_by_rows<T, BLOCK_N, HEAD_DIM>(s, q_addr, BM, wg * 64, k_addr);
    wgmma_rows_by_rows<T, BLOCK_N, HEAD_DIM>(dp, do_addr, BM, wg * 64, v_addr);
    wgmma_commit();
    u64 keeps = 0;  // dropout: drawn while the products run
    if constexpr (DROPOUT) keeps = DropoutDraws(a, batch, head).row_keeps<Tr::kNTiles>(warp_first_row, n0, lane);
    wgmma_wait<0>();
    fence_registers(s);
    fence_registers(dp);
    if constexpr (DROPOUT) apply_keeps(dp, keeps, a.dropout_scale);  // dS from the kept dP

    const int t = lane % 4;
    if (SOFTCAP || masked) {
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool visible = !masked || band.visible(warp_first_row + g + (e / 2) * 8, n0 + nt * 8 + 2 * t + (e % 2));
          dp[nt][e] = prob_and_grad<SOFTCAP>(s[nt][e], dp[nt][e], shift[e / 2], delta[e / 2], visible, a).grad;  // dS
        }
    } else {  // every element visible: no per-element branch
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[nt][e] = prob_and_grad<SOFTCAP>(s[nt][e], dp[nt][e], shift[e / 2], delta[e / 2], true, a).grad;
    }
    wgmma_fence();
    wgmma_frag_by_tile<T, BLOCK_N, HEAD_DIM>(dq, dp, k_addr);  // dQ += dS K
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dq);
  }

  const SeqSpan out_span = seq_span<LAYOUT>(a, batch);  // read again: fewer registers live in the loop
  if (LAYOUT == SeqLayout::kDense && (p.sum_grads & kSumDq)) {  // added into the fp32 sum
    float* dq_sum = head_rows<float>(p.dq, p.dq_strides, batch, head, out_span.q_row0);
    add_acc_rows<Tr::kDTiles>(dq, a.scale, dq_sum, p.dq_strides[1], warp_first_row, out_span.seqlen_q, a.head_dim, lane);
    return;
  }
  T* dq_out = head_rows<T>(p.dq, p.dq_strides, batch, head, out_span.q_row0);
  store_acc_rows<T, Tr::kDTiles>(dq, a.scale, dq_out, p.dq_strides[1], warp_first_row, out_span.seqlen_q, a.head_dim, lane);
}

}  // namespace cuattn
