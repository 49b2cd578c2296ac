// Attention backward, dQ: one CTA per (query block, query head, batch) keeps Q, dO, and the
// fp32 dQ accumulator on chip and streams the visible key blocks (two-stage ring). Per key
// block each warp forms S = Q K^T for its 16 rows, P from the saved lse, dP = dO V^T,
// dS = P (dP - delta) and dQ += dS K. No atomics: the result is deterministic.
#pragma once
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "backward/head_rows.cuh"
#include "backward/row_delta.cuh"
#include "backward/score_grad.cuh"
#include "backward/traits.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "common/tile_copy.cuh"

namespace cuattn {

/// \brief dQ of query block grid_x - 1 - block_x (heaviest first under a causal mask) of one
/// (query head block_y, sequence) (common/grid.cuh; common/seq_layout.cuh), BLOCK_K keys per
/// step. OWN_DELTA: each row's delta is summed here (backward/row_delta.cuh), not read from p.delta. DROPOUT: dropout on the probabilities (common/dropout.cuh). SPARSE:
/// only the blocks of a block mask (common/block_sparse.cuh; dense layout).
template <typename T, int HEAD_DIM, int BLOCK_K, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT, bool SPARSE, bool OWN_DELTA>
__device__ __forceinline__ void backward_dq_block(const BackwardParams& p, int block_x, int block_y, int grid_x) {
  using Tr = BackwardTraits<HEAD_DIM, BLOCK_K>;
  constexpr int BM = Tr::kBlockResident;  // query rows per CTA
  constexpr int BN = Tr::kBlockStream;    // keys per step
  constexpr int RS = Tr::kRowStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sdO = sQ + Tr::kSmemResident;
  T* sK_ring = sdO + Tr::kSmemResident;
  T* sV_ring = sK_ring + Tr::kStages * Tr::kSmemStream;

  const AttnParams& a = p.attn;
  const int m_block = grid_x - 1 - block_x;  // heaviest first under a causal mask
  const int head = block_y, batch = cta_batch(a);
  const int m0 = m_block * BM;
  const SeqSpan span = seq_span<LAYOUT>(a, batch);
  if (!grid_covers<LAYOUT, BM>(span.seqlen_q, grid_x) && block_x == 0)
    mark_uncovered_rows<T>(head_rows<T>(p.dq, p.dq_strides, batch, head, span.q_row0), p.dq_strides[1], nullptr, a.head_dim, grid_x * BM, span.seqlen_q);
  if (!block_in_sequence<LAYOUT>(m0, span.seqlen_q)) return;
  const int m_last = min(m0 + BM, span.seqlen_q) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int kv_head = head / (a.heads_q / a.heads_kv);

  const T* q = head_rows<T>(a.q, a.q_strides, batch, head, span.q_row0);
  const T* dout = head_rows<T>(p.dout, p.dout_strides, batch, head, span.q_row0);
  const T* k = head_rows<T>(a.k, a.k_strides, batch, kv_head, span.k_row0);
  const T* v = head_rows<T>(a.v, a.v_strides, batch, kv_head, span.k_row0);
  const KeyBand band(a, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  const int n_first = key_first / BN;
  const int n_last = key_last < key_first ? n_first - 1 : key_last / BN;
  const KeyTiles<SPARSE, BN, BM> tiles(a, batch, head, m0, n_first, n_last);

  const int warp_first_row = m0 + warp * 16;
  const int warp_last_row = min(warp_first_row + 16, span.seqlen_q) - 1;
  const int warp_first_key = band.first_key(warp_first_row), warp_last_key = band.last_key(warp_last_row);
  float shift[2], delta[2];  // rows g and g + 8 of the warp
  const RowStats stats(p, batch, head, span);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (OWN_DELTA) {
      shift[h] = stats.shift(warp_first_row + g + h * 8, span.seqlen_q);
    } else {
      stats.row(warp_first_row + g + h * 8, span.seqlen_q, shift[h], delta[h]);
    }
  }

  const auto load_kv = [&](int n_block, int stage) {
    load_tile<Tr, BN>(sK_ring + stage * Tr::kSmemStream, k, a.k_strides[1], n_block * BN, span.seqlen_k, a.head_dim);
    load_tile<Tr, BN>(sV_ring + stage * Tr::kSmemStream, v, a.v_strides[1], n_block * BN, span.seqlen_k, a.head_dim);
  };
  if (tiles.any()) {
    load_tile<Tr, BM>(sQ, q, a.q_strides[1], m0, span.seqlen_q, a.head_dim);
    load_tile<Tr, BM>(sdO, dout, p.dout_strides[1], m0, span.seqlen_q, a.head_dim);
    load_kv(tiles.start(), 0);
    cp_async_commit();
  }
  if constexpr (OWN_DELTA) {  // summed while the tiles load, by the 4 lanes of each row
#pragma unroll
    for (int h = 0; h < 2; ++h) delta[h] = own_row_delta<T, HEAD_DIM, 4>(p, batch, head, span, warp_first_row + g + h * 8, t);
  }

  float dq[Tr::kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[dt][e] = 0.f;
  const float sc = a.exp2_scale;

  for (int i = 0, n_block = tiles.start(), stage = 0; tiles.more(i, n_block); n_block = tiles.next(i, n_block), ++i, stage ^= 1) {
    const int n0 = n_block * BN;
    cp_async_wait<0>();
    __syncthreads();  // this stage (and Q, dO) landed; every warp finished with the other one
    if (tiles.has_next(i, n_block)) {
      load_kv(tiles.next(i, n_block), stage ^ 1);
      cp_async_commit();
    }
    if (warp_last_row < warp_first_row || n0 > warp_last_key || n0 + BN <= warp_first_key) continue;
    const bool masked = !band.all_visible(warp_first_row, warp_last_row, n0, n0 + BN - 1);
    const T* sK = sK_ring + stage * Tr::kSmemStream;
    const T* sV = sV_ring + stage * Tr::kSmemStream;

    float s[Tr::kNTiles][4] = {};
    mma_rows_by_rows<T, HEAD_DIM, Tr::kNTiles, RS>(s, sQ + warp * 16 * RS, sK, lane);
    float cap_grad[SOFTCAP ? Tr::kNTiles : 1][4];
    if constexpr (SOFTCAP) apply_softcap(s, cap_grad, a.scale, a.softcap);
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(fmaf(s[nt][e], sc, -shift[e / 2]));
        if (masked && !band.visible(warp_first_row + g + (e / 2) * 8, n0 + nt * 8 + 2 * t + (e % 2))) s[nt][e] = 0.f;
      }
    float dp[Tr::kNTiles][4] = {};
    mma_rows_by_rows<T, HEAD_DIM, Tr::kNTiles, RS>(dp, sdO + warp * 16 * RS, sV, lane);
    if constexpr (DROPOUT) DropoutDraws(a, batch, head).drop_rows(dp, warp_first_row, n0, lane, a.dropout_scale);  // dS from the kept dP
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dp[nt][e] = s[nt][e] * (dp[nt][e] - delta[e / 2]);
        if constexpr (SOFTCAP) dp[nt][e] *= cap_grad[nt][e];
      }
    mma_frag_by_tile<T, Tr::kNTiles, Tr::kDTiles, RS>(dq, dp, sK, lane);
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
