// The dK/dV loop of the Hopper (sm_90a) backward kernels, FlashAttention-2's scheme on warpgroup
// tensor cores. One CTA per (key block, KV head, sequence): 64 keys per warpgroup, or above
// head_dim 128 64 keys shared by two warpgroups (dkdv_share_step). It keeps K, V and the fp32
// dK / dV accumulators on chip and streams the query blocks of every query head of the KV
// head's group (GQA sums in registers; dK and dV written once, deterministic). Per query
// block each warpgroup forms S^T = K Q^T and dP^T = V dO^T for its keys, P^T and dS^T,
// dV += P^T dO and dK += dS^T Q.
//
// FUSE_DQ (backward_wgmma_fused.cu) also forms dQ: dS^T goes through shared memory so that the
// CTA's partial dQ = dS K over all its keys is one product per warpgroup piece, staged in fp32
// and added into p.dq_accum by one bulk reduction (TMA) per piece, in an order that varies from
// run to run. Without it (backward_wgmma_dkdv.cu) backward_wgmma_dq.cu forms dQ.
#pragma once
#include "../common/grid.cuh"
#include "../common/bulk_async.cuh"
#include "../common/mask.cuh"
#include "../common/params.cuh"
#include "../common/seq_layout.cuh"
#include "../common/tile_copy.cuh"
#include "../common/vector_io.cuh"
#include "../common/wgmma.cuh"
#include "dq_accum.cuh"
#include "head_rows.cuh"
#include "score_grad.cuh"
#include "wgmma_traits.cuh"

namespace cuattn {

// Stores a warp's dS^T rows (A fragments over K_STEPS x 16 query columns from query0) into the
// shared dS^T tile: key rows of BN, query columns in 128-byte-swizzled column blocks of 64.
template <int BN, int K_STEPS>
__device__ __forceinline__ void store_ds_transposed(unsigned char* sdS, const u32 (&ds)[K_STEPS][4], int key_row, int lane, int query0 = 0) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kk = 0; kk < K_STEPS; ++kk)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = key_row + g + (e % 2) * 8, query = query0 + kk * 16 + (e / 2) * 8;
      const int block = query / kSwizzleBlockElems, chunk = (query % kSwizzleBlockElems) / 8;
      *reinterpret_cast<u32*>(sdS + block * (BN * kSwizzleRowBytes) + swizzled_chunk(row, chunk) + 4 * t) = ds[kk][e];
    }
}

// Stages a warpgroup's dQ piece (64 rows x COLS, fp32 C fragments) in its stage and hands it to
// one bulk reduction into the dq_accum tile dst() (where `store` holds) issued by `issuer`; the
// warpgroup's previous reduction must have read the stage first (WAIT_READ; without it the
// stage is one that no reduction in flight reads).
template <int COLS, int STAGE_BYTES, bool WAIT_READ = true, class Dst>
__device__ __forceinline__ void reduce_dq_piece(const float (&dq)[COLS / 8][4], float* stage, bool issuer, int wg, int lane, Dst&& dst, bool store) {
  const int warp = (threadIdx.x / 32) % 4, g = lane / 4, t = lane % 4;
  if (WAIT_READ && issuer) bulk_wait_read<0>();
  named_barrier_sync(1 + wg, 128);  // the warpgroup's previous reduction has read the stage
#pragma unroll
  for (int i = 0; i < COLS / 8; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp * 16 + g + h * 8, col = i * 8 + 2 * t;
      const float pair[2] = {dq[i][2 * h], dq[i][2 * h + 1]};
      store_floats<float, 2>(stage + (col / 64) * kDqTileFloats + dq_tile_offset(row, col % 64), pair);
    }
  fence_proxy_async();
  named_barrier_sync(1 + wg, 128);  // the piece is staged
  if (issuer && store) {
    bulk_reduce_add_f32(dst(), stage, STAGE_BYTES);
    bulk_commit();
  }
}

// P^T of a warp's 16 keys x N_TILES * 8 queries (from query m0; their lse from sLse) as 16-bit
// A operands, in place of the scores s (times softcap's gradient); returns the dropout keeps.
template <typename T, bool SOFTCAP, bool DROPOUT, int N_TILES>
__device__ __forceinline__ u64 transposed_probs(float (&s)[N_TILES][4], u32 (&p_frag)[N_TILES / 2][4], const float* sLse, const KeyBand& band,
                                                bool masked, int m0, int key0, int lane, const AttnParams& a, int batch, int head) {
  u64 keeps = 0;
  if constexpr (DROPOUT) keeps = DropoutDraws(a, batch, head).transposed_keeps<N_TILES>(m0, key0, lane);
  if (SOFTCAP || masked) {  // softcap: one path, the two do not fit the registers at d64
#pragma unroll
    for (int kk = 0; kk < N_TILES / 2; ++kk)
      transposed_probs_k_step<T, SOFTCAP, true, N_TILES, DROPOUT>(s, kk, p_frag[kk], sLse, band, m0, key0, lane, a, keeps);
  } else {
#pragma unroll
    for (int kk = 0; kk < N_TILES / 2; ++kk)
      transposed_probs_k_step<T, SOFTCAP, false, N_TILES, DROPOUT>(s, kk, p_frag[kk], sLse, band, m0, key0, lane, a, keeps);
  }
  return keeps;
}

// One step of the dK/dV loop for this warp's 16 keys x BLOCK_M streamed queries (K and V tiles of
// BN rows, this warpgroup's 64 from row 64 * wg; Q and dO tiles of BLOCK_M rows; their rows'
// lse and delta in shared memory). P^T and dS^T are left in p_frag and ds_frag as 16-bit A
// operands, and the product dK += dS^T Q still in flight (wgmma_wait<0> completes it).
// `under_scores` runs while the score products compute.
template <typename T, int HEAD_DIM, int BLOCK_M, int BN, bool SOFTCAP, bool DROPOUT, class UnderScores, class BeforeDk>
__device__ __forceinline__ void dkdv_step_products(float (&dk)[HEAD_DIM / 8][4], float (&dv)[HEAD_DIM / 8][4], u32 (&p_frag)[BLOCK_M / 16][4],
                                                   u32 (&ds_frag)[BLOCK_M / 16][4], u32 k_addr, u32 v_addr, u32 q_addr, u32 do_addr, int wg,
                                                   const float* sLse, const float* sDelta, const KeyBand& band, bool masked, int m0,
                                                   int warp_key0, int lane, const AttnParams& a, int batch, int head, UnderScores&& under_scores, BeforeDk&& before_dk) {
  constexpr int kNTiles = BLOCK_M / 8, kSteps = BLOCK_M / 16;
  // S^T and dP^T (this warp's 16 keys x BLOCK_M queries) as two groups: P^T is formed and
  // dV += P^T dO issued while dP^T is still in the tensor cores, and dS^T while dV runs.
  float s[kNTiles][4], dp[kNTiles][4];
  wgmma_fence();
  wgmma_rows_by_rows<T, BLOCK_M, HEAD_DIM>(s, k_addr, BN, wg * 64, q_addr);
  wgmma_commit();
  wgmma_rows_by_rows<T, BLOCK_M, HEAD_DIM>(dp, v_addr, BN, wg * 64, do_addr);
  wgmma_commit();
  under_scores();
  wgmma_wait<1>();
  fence_registers(s);

  const u64 keeps = transposed_probs<T, SOFTCAP, DROPOUT>(s, p_frag, sLse, band, masked, m0, warp_key0, lane, a, batch, head);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) wgmma_rs_mn<T, HEAD_DIM>(dv, p_frag[kk], mn_major_desc(do_addr, BLOCK_M, kk));  // dV += P^T dO
  wgmma_commit();
  wgmma_wait<1>();  // dP^T (dV may still run)
  fence_registers(dp);
  if constexpr (DROPOUT) apply_keeps(dp, keeps, a.dropout_scale);

  transposed_score_grads(dp, s, sDelta, lane);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) c_tiles_to_a<T>(dp, kk, ds_frag[kk]);
  before_dk();
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) wgmma_rs_mn<T, HEAD_DIM>(dk, ds_frag[kk], mn_major_desc(q_addr, BLOCK_M, kk));  // dK += dS^T Q
  wgmma_commit();
}

// One step of the column-share form (head_dim above 128; WgmmaBackwardTraits::kColumnSplits):
// warpgroup wg forms S^T and dP^T of the CTA's BN = 64 keys against queries wg * BLOCK_M / 2.. of the
// step (n32 products over every column), then P^T and dS^T, and stores both (16-bit) into the
// shared tiles sP and sdS (key rows, query columns). After both warpgroups have, it issues
// dV += P^T dO and dK += dS^T Q over all the step's queries for its columns (`out_offset` bytes
// into the Q and dO tiles); wgmma_wait<0> completes them.
template <typename T, int HEAD_DIM, int BLOCK_M, int BN, bool SOFTCAP, bool DROPOUT, int OUT_TILES>
__device__ __forceinline__ void dkdv_share_step(float (&dk)[OUT_TILES][4], float (&dv)[OUT_TILES][4], unsigned char* sP, unsigned char* sdS,
                                                u32 k_addr, u32 v_addr, u32 q_addr, u32 do_addr, u32 out_offset, int wg, const float* sLse,
                                                const float* sDelta, const KeyBand& band, bool masked, int m0, int warp_key_row, int warp_key0,
                                                int lane, const AttnParams& a, int batch, int head) {
  constexpr int kQueries = BLOCK_M / 2, kNTiles = kQueries / 8, kSteps = kQueries / 16;
  const int q0 = wg * kQueries;  // this warpgroup's first query of the step
  float s[kNTiles][4], dp[kNTiles][4];
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) wgmma_ss<T, kQueries>(s, k_major_desc(k_addr, BN, 0, kk), k_major_desc(q_addr, BLOCK_M, q0, kk), kk > 0);
  wgmma_commit();
#pragma unroll
  for (int kk = 0; kk < HEAD_DIM / 16; ++kk) wgmma_ss<T, kQueries>(dp, k_major_desc(v_addr, BN, 0, kk), k_major_desc(do_addr, BLOCK_M, q0, kk), kk > 0);
  wgmma_commit();
  wgmma_wait<1>();
  fence_registers(s);

  u32 frag[kSteps][4];  // P^T, then dS^T, as 16-bit fragments
  const u64 keeps = transposed_probs<T, SOFTCAP, DROPOUT>(s, frag, sLse + q0, band, masked, m0 + q0, warp_key0, lane, a, batch, head);
  store_ds_transposed<BN>(sP, frag, warp_key_row, lane, q0);
  wgmma_wait<0>();
  fence_registers(dp);
  if constexpr (DROPOUT) apply_keeps(dp, keeps, a.dropout_scale);
  transposed_score_grads(dp, s, sDelta + q0, lane);
#pragma unroll
  for (int kk = 0; kk < kSteps; ++kk) c_tiles_to_a<T>(dp, kk, frag[kk]);
  store_ds_transposed<BN>(sdS, frag, warp_key_row, lane, q0);
  fence_proxy_async();
  // Both warpgroups' P^T and dS^T are in shared memory. (Shares of unequal widths reach this
  // barrier from their own instantiations: the non-aligned form.)
  if constexpr (HEAD_DIM % 128 != 0)
    cta_barrier_unaligned();
  else
    __syncthreads();

  const u32 p_addr = smem_addr(sP), ds_addr = smem_addr(sdS);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < BLOCK_M / 16; ++kk)
    wgmma_ss_kmn<T, OUT_TILES * 8>(dv, k_major_desc(p_addr, BN, 0, kk), mn_major_desc(do_addr + out_offset, BLOCK_M, kk), true);  // dV += P^T dO
#pragma unroll
  for (int kk = 0; kk < BLOCK_M / 16; ++kk)
    wgmma_ss_kmn<T, OUT_TILES * 8>(dk, k_major_desc(ds_addr, BN, 0, kk), mn_major_desc(q_addr + out_offset, BLOCK_M, kk), true);  // dK += dS^T Q
  wgmma_commit();
}

// backward_wgmma_dkdv_body as run by a warpgroup that accumulates TILES n8 column tiles of dK and
// dV (column shares of unequal widths, at 192, compile it once for each).
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, int CTAS_PER_SM, bool SOFTCAP, bool FUSE_DQ, SeqLayout LAYOUT, bool DROPOUT,
          bool SPARSE, int TILES>
__device__ __forceinline__ void backward_wgmma_dkdv_share(const BackwardParams& p) {
  using Tr = WgmmaFusedTraits<HEAD_DIM, BLOCK_M, WARPGROUPS>;
  constexpr int BN = Tr::kBlockResident;  // keys per CTA
  constexpr int kSteps = BLOCK_M / 16;     // k16 steps of the dV / dK products
  constexpr bool kSplit = Tr::kColumnSplits > 1;
  static_assert(!kSplit || FUSE_DQ, "column shares: the fused kernel");
  // Shared memory of the dS^T tile and of the dQ stages (column shares stage in the Q / dO tiles,
  // or a 64-column share in a stage of its own).
  constexpr int kDsBytes = FUSE_DQ ? Tr::kDsBytes : 0, kDqStageBytes = FUSE_DQ && !kSplit ? Tr::kDqStageBytes : 0;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < (FUSE_DQ ? Tr::kSmemBytes : Tr::Base::kSmemBytes)) __trap();  // launch contract
  unsigned char* sK = smem_raw + (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
  unsigned char* sV = sK + Tr::kResidentBytes;
  unsigned char* sQ_ring = sV + Tr::kResidentBytes;
  unsigned char* sdO_ring = sQ_ring + Tr::kStages * Tr::kStreamBytes;
  unsigned char* sdS = sdO_ring + Tr::kStages * Tr::kStreamBytes;
  unsigned char* sP = sdS + kDsBytes;  // column shares: the step's P^T
  float* sDq_stage = reinterpret_cast<float*>(sP + Tr::kPBytes);  // per warpgroup, kDqCols / 64 tiles (or the share's)
  float* sLse_ring = sDq_stage + (WARPGROUPS * kDqStageBytes + Tr::kShareStageBytes) / 4;
  float* sDelta_ring = sLse_ring + Tr::kStages * BLOCK_M;

  const AttnParams& a = p.attn;
  const int splits = LAYOUT == SeqLayout::kDense && !FUSE_DQ && !SPARSE ? p.query_splits : 1;  // BackwardParams::query_splits
  // The causal launch order for dense calls (its packed forms at d128 would spill).
  const GridCell cell = SPARSE || LAYOUT != SeqLayout::kDense ? grid_cell<SPARSE>(a) : key_block_cell(a);
  const int n_block = cell.x / splits;
  const int kv_head = cell.y, batch = cta_batch(a);
  const int n0 = n_block * BN;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int out_col0 = kSplit ? wg * Tr::kOutCols : 0;  // this warpgroup's first gradient column
  const SeqSpan span = seq_span<LAYOUT>(a, batch);
  if (!grid_covers<LAYOUT, BN>(span.seqlen_k, int(gridDim.x) / splits) && cell.x == 0)
    mark_uncovered_key_grads<T>(p, batch, kv_head, span, int(gridDim.x) / splits * BN);
  if (!block_in_sequence<LAYOUT>(n0, span.seqlen_k)) return;

  const T* k = head_rows<T>(a.k, a.k_strides, batch, kv_head, span.k_row0);
  const T* v = head_rows<T>(a.v, a.v_strides, batch, kv_head, span.k_row0);
  const KeyBand band(a, span);
  const auto plan = query_steps<SPARSE, BLOCK_M>(a, span, band, batch, kv_head, n0, BN, cell.x % splits, splits);

  const auto load_step = [&](int step, int stage) {
    const int head = plan.head(kv_head, step), m0 = plan.m0(step);
    const T* q = head_rows<T>(a.q, a.q_strides, batch, head, span.q_row0);
    const T* dout = head_rows<T>(p.dout, p.dout_strides, batch, head, span.q_row0);
    load_tile_sw128<Tr, BLOCK_M>(sQ_ring + stage * Tr::kStreamBytes, q, a.q_strides[1], m0, span.seqlen_q, a.head_dim);
    load_tile_sw128<Tr, BLOCK_M>(sdO_ring + stage * Tr::kStreamBytes, dout, p.dout_strides[1], m0, span.seqlen_q, a.head_dim);
    RowStats(p, batch, head, span).load<BLOCK_M>(sLse_ring + stage * BLOCK_M, sDelta_ring + stage * BLOCK_M, m0, span.seqlen_q);
  };

  load_tile_sw128<Tr, BN>(sK, k, a.k_strides[1], n0, span.seqlen_k, a.head_dim);
  load_tile_sw128<Tr, BN>(sV, v, a.v_strides[1], n0, span.seqlen_k, a.head_dim);
  if (plan.steps > 0) load_step(0, 0);
  cp_async_commit();

  const int warp_key_row = (kSplit ? 0 : wg * 64) + warp * 16;  // in the CTA's key block
  const int warp_key0 = n0 + warp_key_row;
  const u32 k_addr = smem_addr(sK), v_addr = smem_addr(sV), ds_addr = smem_addr(sdS);
  const u32 out_offset = out_col0 * BLOCK_M * 2;  // the warpgroup's columns in the Q and dO tiles
  const bool issuer = threadIdx.x % 128 == 0;

  constexpr int kTiles = TILES;
  float dk[kTiles][4], dv[kTiles][4];
#pragma unroll
  for (int dt = 0; dt < kTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  // This warpgroup's piece of each step's dQ tile: rows 64 * row_piece.., columns col0.. (column
  // shares: one 64-column piece per 64 of its columns, from its first).
  constexpr int kPieces = kSplit ? kTiles * 8 / 64 : Tr::kDqPiecesPerWarpgroup;
  constexpr bool kShareStage = kSplit && kTiles * 8 < 128;  // too few columns in the Q / dO tiles for its piece
  static_assert(kSplit ? Tr::kDqRowPieces == 1 && kPieces <= (kShareStage ? Tr::kShareStageBytes / Tr::kDqStageBytes : 2) : kPieces == 1,
                "column shares: pieces staged in the Q and dO tiles (one each) or in the share's stage");
  const int row_piece = kSplit ? 0 : wg * kPieces / Tr::kDqColPieces;
  const int col0 = kSplit ? out_col0 : (wg * kPieces % Tr::kDqColPieces) * Tr::kDqCols;
  const u32 ds_piece_addr = ds_addr + row_piece * BN * kSwizzleRowBytes, k_piece_addr = k_addr + col0 * BN * 2;
  float* stage_dq = sDq_stage + wg * kDqStageBytes / 4;  // (column shares: none)
  // With one CTA per SM nothing else fills the tensor cores while a warpgroup stages its dQ
  // piece, so that moves under the next step's score products (the piece's registers stay live
  // across the step). With more CTAs per SM they overlap it instead, and registers are scarcer.
  constexpr bool kDeferDq = FUSE_DQ && CTAS_PER_SM == 1 && !kSplit;
  float dq[Tr::kDqCols / 8][4];  // the last step's piece (deferred: its product in flight)
  int dq_head = 0, dq_m0 = 0;    // and where it goes
#pragma unroll
  for (int i = 0; i < Tr::kDqCols / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[i][e] = 0.f;

  const auto reduce_dq = [&]() {
    reduce_dq_piece<Tr::kDqCols, Tr::kDqStageBytes>(
        dq, stage_dq, issuer, wg, lane, [&] { return dq_accum_tile(p, batch, dq_head, span, dq_m0 / 64 + row_piece, col0 / 64); },
        dq_m0 + row_piece * 64 < span.seqlen_q);
  };

  for (int step = 0, stage = 0; step < plan.steps; ++step, stage ^= 1) {
    cp_async_wait<0>();
    if constexpr (kDeferDq) {
      wgmma_wait<0>();  // the last step's dQ product, which read sdS
      fence_registers(dq);
    }
    if (kSplit && issuer) bulk_wait_read<0>();  // the last step's dQ pieces, staged in the tiles loaded next
    fence_proxy_async();
    // This stage landed; every warpgroup finished with the other one and with sdS.
    if constexpr (kSplit && Tr::kLastOutCols != Tr::kOutCols)
      cta_barrier_unaligned();
    else
      __syncthreads();
    if (step + 1 < plan.steps) {
      load_step(step + 1, stage ^ 1);
      cp_async_commit();
    }
    const int head = plan.head(kv_head, step), m0 = plan.m0(step);
    const int m_last = min(m0 + BLOCK_M, span.seqlen_q) - 1;
    const bool masked = !band.all_visible(m0, m_last, warp_key0, warp_key0 + 15);
    const u32 q_addr = smem_addr(sQ_ring + stage * Tr::kStreamBytes), do_addr = smem_addr(sdO_ring + stage * Tr::kStreamBytes);
    const float* sLse = sLse_ring + stage * BLOCK_M;
    const float* sDelta = sDelta_ring + stage * BLOCK_M;

    if constexpr (kSplit) {
      dkdv_share_step<T, HEAD_DIM, BLOCK_M, BN, SOFTCAP, DROPOUT>(dk, dv, sP, sdS, k_addr, v_addr, q_addr, do_addr, out_offset, wg, sLse, sDelta, band,
                                                              masked, m0, warp_key_row, warp_key0, lane, a, batch, head);
      // The step's dQ pieces (unscaled) = dS K over the CTA's keys, one after the other (the first
      // behind dV and dK), each staged in this warpgroup's columns of the step's Q (piece 0) or dO
      // tile, which dK and dV have read by then, or in the share's own stage, which the last
      // step's reduction has read (bulk_wait_read above). (Both behind dV and dK need 64 more
      // registers: 1.5% slower, H100.)
#pragma unroll
      for (int piece = 0; piece < kPieces; ++piece) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
          wgmma_ss_mn<T, Tr::kDqCols>(dq, mn_major_desc(ds_piece_addr, BN, kk), mn_major_desc(k_piece_addr + piece * Tr::kDqCols * BN * 2, BN, kk),
                                      kk > 0);
        wgmma_commit();
        wgmma_wait<0>();
        if (piece == 0) {
          fence_registers(dv);
          fence_registers(dk);
        }
        fence_registers(dq);
        float* staged = kShareStage ? sDq_stage + piece * Tr::kDqStageBytes / 4
                                    : reinterpret_cast<float*>((piece == 0 ? sQ_ring : sdO_ring) + stage * Tr::kStreamBytes + out_offset);
        reduce_dq_piece<Tr::kDqCols, Tr::kDqStageBytes, false>(
            dq, staged, issuer, wg, lane, [&] { return dq_accum_tile(p, batch, head, span, m0 / 64, col0 / 64 + piece); },
            m0 < span.seqlen_q && col0 + piece * Tr::kDqCols < a.head_dim);  // (columns past head_dim: zeros)
      }
    } else {
      u32 p_frag[kSteps][4], ds_frag[kSteps][4];  // P^T and dS^T as 16-bit A operands
      dkdv_step_products<T, HEAD_DIM, BLOCK_M, BN, SOFTCAP, DROPOUT>(dk, dv, p_frag, ds_frag, k_addr, v_addr, q_addr, do_addr, wg, sLse, sDelta,
                                                                     band, masked, m0, warp_key0, lane, a, batch, head, [&] {
                                                                       if (kDeferDq && step > 0) reduce_dq();  // under the score products
                                                                     }, [] {});

      if constexpr (FUSE_DQ) {
        store_ds_transposed<BN>(sdS, ds_frag, warp_key_row, lane);
        fence_proxy_async();
        __syncthreads();  // the CTA's dS^T is in shared memory
      }
      wgmma_wait<0>();
      fence_registers(p_frag);
      fence_registers(ds_frag);
      fence_registers(dv);
      fence_registers(dk);

      if constexpr (FUSE_DQ) {
        // This step's dQ piece (unscaled) = dS K over the CTA's keys.
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          wgmma_ss_mn<T, Tr::kDqCols>(dq, mn_major_desc(ds_piece_addr, BN, kk), mn_major_desc(k_piece_addr, BN, kk), kk > 0);
        }
        wgmma_commit();
        dq_head = head;
        dq_m0 = m0;
        if constexpr (!kDeferDq) {
          wgmma_wait<0>();
          fence_registers(dq);
          reduce_dq();
        }
      }
    }
  }
  if (kDeferDq && plan.steps > 0) {
    wgmma_wait<0>();
    fence_registers(dq);
    reduce_dq();
  }
  if (FUSE_DQ && issuer) bulk_wait<0>();

  if (LAYOUT == SeqLayout::kDense && (p.sum_grads & kSumDkDv)) {  // added into fp32 sums, this split's
    const int split = FUSE_DQ || SPARSE ? 0 : cell.x % p.query_splits;  // one split under a mask
    float* dk_sum = head_rows<float>(static_cast<float*>(p.dk) + split * p.split_stride, p.dk_strides, batch, kv_head, span.k_row0) + out_col0;
    float* dv_sum = head_rows<float>(static_cast<float*>(p.dv) + split * p.split_stride, p.dv_strides, batch, kv_head, span.k_row0) + out_col0;
    add_acc_rows<kTiles>(dk, a.scale, dk_sum, p.dk_strides[1], warp_key0, span.seqlen_k, a.head_dim - out_col0, lane);
    add_acc_rows<kTiles>(dv, DROPOUT ? a.dropout_scale : 1.f, dv_sum, p.dv_strides[1], warp_key0, span.seqlen_k, a.head_dim - out_col0, lane);
    return;
  }
  T* dk_out = head_rows<T>(p.dk, p.dk_strides, batch, kv_head, span.k_row0) + out_col0;
  T* dv_out = head_rows<T>(p.dv, p.dv_strides, batch, kv_head, span.k_row0) + out_col0;
  store_acc_rows<T, kTiles>(dk, a.scale, dk_out, p.dk_strides[1], warp_key0, span.seqlen_k, a.head_dim - out_col0, lane);
  store_acc_rows<T, kTiles>(dv, DROPOUT ? a.dropout_scale : 1.f, dv_out, p.dv_strides[1], warp_key0, span.seqlen_k, a.head_dim - out_col0, lane);
}

// DROPOUT: dropout on the probabilities (common/dropout.cuh): dV from the kept P^T, dS^T from the
// kept dP^T. SPARSE: only the blocks of a block mask (common/block_sparse.cuh; dense layout, one
// split). Above head_dim 128 (Tr::kColumnSplits; fused only) the two warpgroups share the
// CTA's 64 keys (dkdv_share_step): each forms the scores of half of a step's queries, and its
// share of dK, dV and dQ's columns (128 and 128 at 256; 128 and 64 at 192), each warpgroup
// running the body compiled for its share's width (not a generic lambda inside one body: NVRTC
// 12.x and 13.0-13.1 refuse those in device code).
template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, int CTAS_PER_SM, bool SOFTCAP, bool FUSE_DQ, SeqLayout LAYOUT, bool DROPOUT,
          bool SPARSE>
__device__ __forceinline__ void backward_wgmma_dkdv_body(const BackwardParams& p) {
  using Tr = WgmmaFusedTraits<HEAD_DIM, BLOCK_M, WARPGROUPS>;
  if constexpr (Tr::kColumnSplits > 1 && Tr::kLastOutCols != Tr::kOutCols) {
    if (threadIdx.x < 128)
      backward_wgmma_dkdv_share<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CTAS_PER_SM, SOFTCAP, FUSE_DQ, LAYOUT, DROPOUT, SPARSE, Tr::kOutCols / 8>(p);
    else
      backward_wgmma_dkdv_share<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CTAS_PER_SM, SOFTCAP, FUSE_DQ, LAYOUT, DROPOUT, SPARSE, Tr::kLastOutCols / 8>(p);
  } else {
    backward_wgmma_dkdv_share<T, HEAD_DIM, BLOCK_M, WARPGROUPS, CTAS_PER_SM, SOFTCAP, FUSE_DQ, LAYOUT, DROPOUT, SPARSE, Tr::kDTiles>(p);
  }
}

}  // namespace cuattn
