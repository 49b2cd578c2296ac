// Attention backward, dK and dV (FlashAttention-2 scheme, transposed): one CTA per (key block,
// KV head [x column half above head_dim 128], batch) keeps its K and V tiles and fp32 dK / dV
// accumulators on chip and streams the query blocks of every query head of the KV head's group,
// so that GQA sums happen in registers and every gradient element is written once
// (deterministic). Per query block, each warp forms S^T = K Q^T for its 16 keys, P^T from the
// saved lse, dV += P^T dO, dP^T = V dO^T, dS^T = P^T (dP^T - delta) and dK += dS^T Q.
#pragma once
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

// CTAs that share a key block above head_dim 128, each with half of the dK / dV columns.
template <int HEAD_DIM>
constexpr int kDkdvSplits = HEAD_DIM > 128 ? 2 : 1;

// Whether the block-sparse kernel takes its cell from the launch order (grid_cell): not at
// head_dim 224 with softcap, where the cell's two registers spill (255 in use; its launches
// are not ordered: cuattn/kernels/backward.py DKDV_UNORDERED).
template <int HEAD_DIM, bool SOFTCAP>
constexpr bool kDkdvOrdered = !(HEAD_DIM == 224 && SOFTCAP);

/// \brief dK and dV of key block block_x / splits (query split block_x % splits; grid_x CTAs on
/// this axis) of one (KV head x column split block_y, sequence) (common/grid.cuh;
/// common/seq_layout.cuh), BLOCK_Q queries per step. STATS_IN_SMEM stages each step's lse and
/// delta in shared memory with its tiles; without it (a device whose shared memory fits only the
/// tiles) they are read from global memory where they are used. DROPOUT: dropout on the
/// probabilities (common/dropout.cuh). SPARSE: only the blocks of a block mask
/// (common/block_sparse.cuh; dense layout, one split). OWN_DELTA: each step's delta is summed
/// here (backward/row_delta.cuh), not read from p.delta.
template <typename T, int HEAD_DIM, int BLOCK_Q, bool STATS_IN_SMEM, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT, bool SPARSE, bool OWN_DELTA>
__device__ __forceinline__ void backward_dkdv_block(const BackwardParams& p, int block_x, int block_y, int grid_x) {
  using Tr = BackwardTraits<HEAD_DIM, BLOCK_Q, kDkdvSplits<HEAD_DIM>, STATS_IN_SMEM>;
  constexpr int BM = Tr::kBlockStream;    // queries per step
  constexpr int BN = Tr::kBlockResident;  // keys per CTA
  constexpr int RS = Tr::kRowStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + Tr::kSmemResident;
  T* sQ_ring = sV + Tr::kSmemResident;
  T* sdO_ring = sQ_ring + Tr::kStages * Tr::kSmemStream;
  float* sLse_ring = reinterpret_cast<float*>(sdO_ring + Tr::kStages * Tr::kSmemStream);
  float* sDelta_ring = sLse_ring + Tr::kStages * BM;

  const AttnParams& a = p.attn;
  const int splits = LAYOUT == SeqLayout::kDense && !SPARSE ? p.query_splits : 1;  // BackwardParams::query_splits
  const int n_block = block_x / splits;
  const int kv_head = block_y / Tr::kSplits, batch = cta_batch(a);
  const int col0 = block_y % Tr::kSplits * Tr::kOutCols;  // first gradient column of this CTA
  const int n0 = n_block * BN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const SeqSpan span = seq_span<LAYOUT>(a, batch);
  if (!grid_covers<LAYOUT, BN>(span.seqlen_k, grid_x / splits) && block_x == 0 && col0 == 0)
    mark_uncovered_key_grads<T>(p, batch, kv_head, span, grid_x / splits * BN);
  if (!block_in_sequence<LAYOUT>(n0, span.seqlen_k)) return;

  const T* k = head_rows<T>(a.k, a.k_strides, batch, kv_head, span.k_row0);
  const T* v = head_rows<T>(a.v, a.v_strides, batch, kv_head, span.k_row0);
  const KeyBand band(a, span);
  const auto plan = query_steps<SPARSE, BM>(a, span, band, batch, kv_head, n0, BN, block_x % splits, splits);

  const auto load_step = [&](int step, int stage) {
    const int head = plan.head(kv_head, step), m0 = plan.m0(step);
    const T* q = head_rows<T>(a.q, a.q_strides, batch, head, span.q_row0);
    const T* dout = head_rows<T>(p.dout, p.dout_strides, batch, head, span.q_row0);
    load_tile<Tr, BM>(sQ_ring + stage * Tr::kSmemStream, q, a.q_strides[1], m0, span.seqlen_q, a.head_dim);
    load_tile<Tr, BM>(sdO_ring + stage * Tr::kSmemStream, dout, p.dout_strides[1], m0, span.seqlen_q, a.head_dim);
    if constexpr (OWN_DELTA) {  // the step's rows' delta summed here, kLanes lanes a row
      constexpr int kLanes = Tr::kThreads / BM;
      static_assert(STATS_IN_SMEM && Tr::kThreads % BM == 0 && 32 % kLanes == 0, "own delta: whole rows per warp, staged in shared memory");
      RowStats(p, batch, head, span).load<BM, false>(sLse_ring + stage * BM, nullptr, m0, span.seqlen_q);
      const int row = threadIdx.x / kLanes;
      const float delta = own_row_delta<T, HEAD_DIM, kLanes>(p, batch, head, span, m0 + row, threadIdx.x % kLanes);
      if (threadIdx.x % kLanes == 0) sDelta_ring[stage * BM + row] = delta;
    } else if constexpr (STATS_IN_SMEM) {
      RowStats(p, batch, head, span).load<BM>(sLse_ring + stage * BM, sDelta_ring + stage * BM, m0, span.seqlen_q);
    }
  };

  load_tile<Tr, BN>(sK, k, a.k_strides[1], n0, span.seqlen_k, a.head_dim);
  load_tile<Tr, BN>(sV, v, a.v_strides[1], n0, span.seqlen_k, a.head_dim);
  if (plan.steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[Tr::kOutTiles][4], dv[Tr::kOutTiles][4];
#pragma unroll
  for (int dt = 0; dt < Tr::kOutTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  const int warp_key0 = n0 + warp * 16;
  const int warp_key_last = min(warp_key0 + 15, span.seqlen_k - 1);
  const float sc = a.exp2_scale;

  for (int step = 0, stage = 0; step < plan.steps; ++step, stage ^= 1) {
    cp_async_wait<0>();
    __syncthreads();  // this stage landed; every warp finished with the other one
    if (step + 1 < plan.steps) {
      load_step(step + 1, stage ^ 1);
      cp_async_commit();
    }
    const int m0 = plan.m0(step);
    const int m_last = min(m0 + BM, span.seqlen_q) - 1;
    if (warp_key_last < warp_key0 || warp_key0 > band.last_key(m_last) || warp_key_last < band.first_key(m0)) continue;
    const bool masked = !band.all_visible(m0, m_last, warp_key0, warp_key0 + 15);
    const T* sQ = sQ_ring + stage * Tr::kSmemStream;
    const T* sdO = sdO_ring + stage * Tr::kSmemStream;
    const float* sLse = sLse_ring + stage * BM;
    const float* sDelta = sDelta_ring + stage * BM;
    const RowStats stats(p, batch, plan.head(kv_head, step), span);

    float s[Tr::kNTiles][4] = {};
    mma_rows_by_rows<T, HEAD_DIM, Tr::kNTiles, RS>(s, sK + warp * 16 * RS, sQ, lane);
    float cap_grad[SOFTCAP ? Tr::kNTiles : 1][4];
    if constexpr (SOFTCAP) apply_softcap(s, cap_grad, a.scale, a.softcap);
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt) {
      float shift[2];  // of queries m0 + nt * 8 + 2 * t (+ 1)
      if constexpr (STATS_IN_SMEM) {
        float lse[2];
        load_floats<float, 2>(sLse + nt * 8 + 2 * t, lse);
        shift[0] = lse_to_exp2_shift(lse[0]), shift[1] = lse_to_exp2_shift(lse[1]);
      } else {
        float unused;
        for (int i = 0; i < 2; ++i) stats.row(m0 + nt * 8 + 2 * t + i, span.seqlen_q, shift[i], unused);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(fmaf(s[nt][e], sc, -shift[e % 2]));
        if (masked && !band.visible(m0 + nt * 8 + 2 * t + (e % 2), warp_key0 + g + (e / 2) * 8)) s[nt][e] = 0.f;
      }
    }
    u64 keeps = 0;  // dropout: dV takes the kept probabilities, dS the kept dP
    if constexpr (DROPOUT) keeps = DropoutDraws(a, batch, plan.head(kv_head, step)).transposed_keeps<Tr::kNTiles>(m0, warp_key0, lane);
    mma_frag_by_tile<T, Tr::kNTiles, Tr::kOutTiles, RS, DROPOUT>(dv, s, sdO + col0, lane, keeps);

    float dp[Tr::kNTiles][4] = {};
    mma_rows_by_rows<T, HEAD_DIM, Tr::kNTiles, RS>(dp, sV + warp * 16 * RS, sdO, lane);
    if constexpr (DROPOUT) apply_keeps(dp, keeps, a.dropout_scale);
#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt) {
      float delta[2];
      if constexpr (STATS_IN_SMEM) {
        load_floats<float, 2>(sDelta + nt * 8 + 2 * t, delta);
      } else {
        float unused;
        for (int i = 0; i < 2; ++i) stats.row(m0 + nt * 8 + 2 * t + i, span.seqlen_q, unused, delta[i]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dp[nt][e] = s[nt][e] * (dp[nt][e] - delta[e % 2]);
        if constexpr (SOFTCAP) dp[nt][e] *= cap_grad[nt][e];
      }
    }
    mma_frag_by_tile<T, Tr::kNTiles, Tr::kOutTiles, RS>(dk, dp, sQ + col0, lane);
  }

  const SeqSpan out_span = seq_span<LAYOUT>(a, batch);  // read again: fewer registers live in the loop
  if (LAYOUT == SeqLayout::kDense && (p.sum_grads & kSumDkDv)) {  // added into fp32 sums, this split's
    const int split = SPARSE ? 0 : block_x % p.query_splits;  // one split under a mask
    float* dk_sum = head_rows<float>(static_cast<float*>(p.dk) + split * p.split_stride, p.dk_strides, batch, kv_head, out_span.k_row0) + col0;
    float* dv_sum = head_rows<float>(static_cast<float*>(p.dv) + split * p.split_stride, p.dv_strides, batch, kv_head, out_span.k_row0) + col0;
    add_acc_rows<Tr::kOutTiles>(dk, a.scale, dk_sum, p.dk_strides[1], warp_key0, out_span.seqlen_k, a.head_dim - col0, lane);
    add_acc_rows<Tr::kOutTiles>(dv, DROPOUT ? a.dropout_scale : 1.f, dv_sum, p.dv_strides[1], warp_key0, out_span.seqlen_k, a.head_dim - col0, lane);
    return;
  }
  T* dk_out = head_rows<T>(p.dk, p.dk_strides, batch, kv_head, out_span.k_row0) + col0;
  T* dv_out = head_rows<T>(p.dv, p.dv_strides, batch, kv_head, out_span.k_row0) + col0;
  store_acc_rows<T, Tr::kOutTiles>(dk, a.scale, dk_out, p.dk_strides[1], warp_key0, out_span.seqlen_k, a.head_dim - col0, lane);
  store_acc_rows<T, Tr::kOutTiles>(dv, DROPOUT ? a.dropout_scale : 1.f, dv_out, p.dv_strides[1], warp_key0, out_span.seqlen_k, a.head_dim - col0, lane);
}

}  // namespace cuattn
