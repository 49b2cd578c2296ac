// Attention forward for Hopper (sm_90a): the FlashAttention-2 loop of forward.cu with its matmuls
// on warpgroup tensor cores. Each warpgroup owns 64 query rows; S = Q K^T reads Q and K from
// 128-byte-swizzled shared memory, O += P V takes P from registers and V from shared memory.
//
// The loop is software-pipelined inside each warpgroup (FlashAttention-3's intra-warpgroup
// overlap): at key block j a warpgroup issues S_j = Q K_j^T and then O += P_{j-1} V_{j-1}, waits
// for S_j only, and runs the softmax of block j while the P V product is still on the tensor
// cores; O is rescaled for block j's new row maxima once that product has completed. K and V
// stream through two-slot cp.async rings of their own, one block apart: iteration j loads
// K_{j+1} and V_j, so V_{j-1} is still resident for the product issued at j. One CTA barrier per
// block: after it the copies waited for have landed and every warpgroup is done with the slots
// the new copies overwrite (K_{j-1}: its S product was waited for at j-1; V_{j-2}: its P V too).
// A paged cache's key offsets (common/tile_copy.cuh) follow the same rule: before the barrier
// of iteration j, the K offsets of block j+1 and the V offsets of block j.
// Then the two warpgroups issue their products in turn (kIssueInTurn: warpgroup 1 waits at a
// named barrier for warpgroup 0's), so that warpgroup 0's softmax runs while the tensor cores
// work on warpgroup 1's products rather than both softmaxes at once; the copies of the next
// blocks are issued last.
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "common/dropout.cuh"
#include "common/head_view.cuh"
#include "common/mask.cuh"
#include "common/named_barrier.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "common/tile_copy.cuh"
#include "common/wgmma.cuh"
#include "forward/accumulate.cuh"
#include "forward/online_softmax.cuh"
#include "forward/staged_out.cuh"
#include "forward/values_step.cuh"
#include "forward/wgmma_traits.cuh"

namespace cuattn {

// Whether the warpgroups issue their products in turn (warpgroup 1 after warpgroup 0, named
// barrier kBarInTurn). The turn keeps a few more registers live across its barrier; the variants
// that were already at their register cap would spill with it (ptxas report, the offline gate)
// and issue together instead: block-sparse, paged caches at head_dim 256, packed sequences with
// dropout from 128 up.
template <int HEAD_DIM, SeqLayout LAYOUT, bool DROPOUT, bool SPARSE>
constexpr bool kIssueInTurn = !SPARSE && !(LAYOUT == SeqLayout::kPagedCache && HEAD_DIM == 256) &&
                              !(DROPOUT && LAYOUT == SeqLayout::kPacked && HEAD_DIM >= 128);
constexpr int kBarInTurn = 4;  // 0 is __syncthreads, 1 + wg the epilogue's

/// \brief One block of query rows of one (sequence, head): writes its rows of out and lse.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, bool SOFTCAP, SeqLayout LAYOUT, bool FOLD, bool DROPOUT, bool SPARSE>
__device__ __forceinline__ void forward_wgmma_block(const AttnParams& p, int seq, int head, const SeqSpan& span, const HeadView<T>& head_view, int m_block,
                                                    unsigned char* smem_raw) {
  using Tr = WgmmaForwardTraits<HEAD_DIM, BLOCK_N, WARPGROUPS>;
  static_assert(WARPGROUPS == 2, "the turn of the products is between two warpgroups");
  unsigned char* sQ = smem_raw + (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
  unsigned char* sK_ring = sQ + Tr::kQBytes;  // kStages K tiles, then kStages V tiles
  unsigned char* sV_ring = sK_ring + Tr::kStages * Tr::kKVBytes;

  const int m0 = m_block * Tr::kBlockM;
  const int m_last = min(m0 + Tr::kBlockM, span.seqlen_q) - 1;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const KeyBand band(p, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  const int n_first = key_first / BLOCK_N;
  const int n_last = key_last < key_first ? n_first - 1 : key_last / BLOCK_N;
  const KeyTiles<SPARSE, BLOCK_N, Tr::kBlockM> tiles(p, seq, head, m0, n_first, n_last);

  float acc[1][Tr::kDTiles][4];
  float row_max[1][2] = {{neg_inf(), neg_inf()}}, row_sum[1][2] = {{0.f, 0.f}};
#pragma unroll
  for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][dt][e] = 0.f;

  constexpr bool PAGED = LAYOUT == SeqLayout::kPagedCache;
  i64* s_offsets = reinterpret_cast<i64*>(smem_raw + Tr::kSmemBytes);  // paged: two blocks' key offsets (kPageAheadBytes)
  const CacheRows<true> cache(p, seq);                                 // paged: the block table's row (unused otherwise)
  // K (kv = 0) or V (kv = 1) of key block n_block into slot `stage` of its ring.
  const auto load_block = [&](int kv, int n_block, int stage) {  // kv: a constant at every call
    unsigned char* dst = (kv == 0 ? sK_ring : sV_ring) + stage * Tr::kKVBytes;
    const int n0 = n_block * BLOCK_N;
    if constexpr (PAGED) {
      const i64* offsets = s_offsets + (n_block & 1) * 2 * BLOCK_N + kv * BLOCK_N;
      load_paged_tile<Tr, BLOCK_N, true>(dst, kv == 0 ? head_view.k : head_view.v, offsets, n0, span.seqlen_k, p.head_dim);
    } else {
      load_tile_sw128<Tr, BLOCK_N>(dst, kv == 0 ? head_view.k : head_view.v, kv == 0 ? p.k_strides[1] : p.v_strides[1], n0, span.seqlen_k,
                                   p.head_dim);
    }
  };
  // Paged: the page of this thread's key in the block after next (its K offsets are stored at
  // the next iteration) and in the next block (its V offsets, likewise).
  int page_ahead = 0, page_next = 0;
  if (tiles.any()) {
    if constexpr (PAGED) {
      page_next = page_of_key<BLOCK_N>(cache, n_last, n_first, span.seqlen_k);
      store_key_offsets<BLOCK_N>(s_offsets, p, cache, n_last, page_next);
      page_ahead = page_of_key<BLOCK_N>(cache, n_last - 1, n_first, span.seqlen_k);
      __syncthreads();
    }
    load_tile_sw128<Tr, Tr::kBlockM>(sQ, head_view.q, p.q_strides[1], m0, span.seqlen_q, p.head_dim);
    load_block(0, tiles.start(), 0);
    cp_async_commit();
  }
  // This warp's rows (masking is per warp). Every warpgroup computes every key block of the
  // CTA, masked where its rows see none of it: a product issued or waited for in a branch the
  // compiler cannot prove warpgroup-uniform makes ptxas serialize every wgmma (C7518 / C7519).
  const int warp_first_row = m0 + wg * 64 + warp * 16;
  const int warp_last_row = min(warp_first_row + 16, span.seqlen_q) - 1;
  const u32 q_addr = smem_addr(sQ);

  float s[1][Tr::kNTiles][4];
  u32 probs[BLOCK_N / 16][4];  // P of the block before, packed: the A operand of its P V product
  // Waits for K of block i (and V of the block before) to land.
  const auto landed = [&](int n_block) {
    cp_async_wait<0>();
    if constexpr (PAGED) {  // read after the barrier: K of the next block, V of this one
      store_key_offsets<BLOCK_N, 0>(s_offsets, p, cache, n_block - 1, page_ahead);
      store_key_offsets<BLOCK_N, 1>(s_offsets, p, cache, n_block, page_next);
      page_next = page_ahead;
    }
    fence_proxy_async();  // this thread's copies, visible to the tensor cores' async proxy
    __syncthreads();      // K[n_block], V of the block before (and Q) landed; the slots loaded next are free
  };
  // Loads K of the next block and V of this one (after landed).
  const auto copy_next = [&](int i, int n_block) {
    if (tiles.has_next(i, n_block)) load_block(0, tiles.next(i, n_block), (i & 1) ^ 1);
    load_block(1, n_block, i & 1);
    cp_async_commit();
    if constexpr (PAGED) page_ahead = page_of_key<BLOCK_N>(cache, n_block - 2, n_first, span.seqlen_k);  // stored next iteration
  };
  const auto issue_scores = [&](int i) {
    wgmma_fence();
    wgmma_rows_by_rows<T, BLOCK_N, HEAD_DIM>(s[0], q_addr, Tr::kBlockM, wg * 64, smem_addr(sK_ring + (i & 1) * Tr::kKVBytes));
    wgmma_commit();
  };
  // Scores to probabilities (S landed); whether O must be rescaled by alpha once its product is done.
  const auto probabilities = [&](int n0, float (&alpha)[1][2]) {
    fence_registers(s[0]);
    if (SOFTCAP) softcap_scores(s, p);
    if (!band.all_visible(warp_first_row, warp_last_row, n0, n0 + BLOCK_N - 1)) mask_scores(s, band, warp_first_row, n0);
    const bool rescale = softmax_block(s, row_max, row_sum, p.exp2_scale, [&](int, int h, float a) { alpha[0][h] = a; });
    if constexpr (DROPOUT) DropoutDraws(p, seq, head).drop_rows<Tr::kNTiles, false>(s[0], warp_first_row, n0, lane);
    return rescale;
  };
  const auto issue_values = [&](int i) {  // O += P V of block i (P in probs)
    wgmma_fence();
    wgmma_regs_by_tile<T, BLOCK_N, HEAD_DIM>(acc[0], probs, smem_addr(sV_ring + (i & 1) * Tr::kKVBytes));
    wgmma_commit();
  };

  // Key blocks from last to first, so that the partially masked diagonal block comes first
  // (block-sparse: the kept blocks, common/block_sparse.cuh; paged: consecutive blocks).
  int i = 0;
  if (tiles.any()) {
    const int n_block = tiles.start();
    landed(n_block);
    issue_scores(0);
    copy_next(0, n_block);
    wgmma_wait<0>();
    float alpha[1][2];
    probabilities(n_block * BLOCK_N, alpha);  // O is still zero: nothing to rescale
    pack_a_operands<T, BLOCK_N>(probs, s[0]);
    for (int n = tiles.next(0, n_block); tiles.more(++i, n); n = tiles.next(i, n)) {
      landed(n);
      // Warpgroup 0's products first, then warpgroup 1's behind them on the tensor cores: its
      // softmax then overlaps their products instead of both softmaxes running at once.
      constexpr bool kInTurn = kIssueInTurn<HEAD_DIM, LAYOUT, DROPOUT, SPARSE>;
      if (kInTurn && wg == 1) named_barrier_sync(kBarInTurn, 256);
      issue_scores(i);
      issue_values(i - 1);
      if (kInTurn && wg == 0) named_barrier_arrive(kBarInTurn, 256);
      copy_next(i, n);
      wgmma_wait<1>();  // S only: groups complete in order
      const bool rescale = probabilities(n * BLOCK_N, alpha);
      wgmma_wait<0>();
      rescale_and_pack<T, BLOCK_N>(acc, probs, s, rescale, alpha);
    }
    cp_async_wait<0>();  // V of the last block
    fence_proxy_async();
    __syncthreads();
    issue_values(i - 1);
    wgmma_wait<0>();
    fence_registers(acc[0]);
    fence_registers(probs);
  }

  // Epilogue: normalize (folding into the accumulator when there is one: forward/accumulate.cuh),
  // stage the warpgroup's rows of out in sQ and store them (forward/staged_out.cuh).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    RowTotal total = finish_row(row_max[0][h], row_sum[0][h], p.exp2_scale, head_view.sink);
    if constexpr (DROPOUT) total.inv *= p.dropout_scale;  // kept probabilities, scaled up
    const int r = wg * 64 + warp * 16 + g + h * 8;  // row of the CTA's tile
    if constexpr (!FOLD) {
      stage_out_row<T, Tr::kBlockM>(sQ, acc[0], h, r, total.inv);
      if (t == 0 && m0 + r < span.seqlen_q && head_view.lse != nullptr) head_view.lse[m0 + r] = total.lse;
    } else {
      const int row = m0 + r;
      fold_out_row<T, Tr::kBlockM>(sQ, acc[0], h, r, total.inv, total.lse, p, head_view.lse, head_view.accum, row, row < span.seqlen_q);
    }
  }
  if (!FOLD || p.out != nullptr) store_staged_rows<T, Tr::kBlockM, HEAD_DIM>(sQ, head_view.out, p.out_strides[1], m0, wg, span.seqlen_q, p.head_dim);
}

/// \brief Attention forward: one CTA per (block of query rows, head, sequence)
/// (common/grid.cuh, common/seq_layout.cuh); query blocks run heaviest-first. CTAS_PER_SM
/// bounds the registers (65536 / (threads * CTAS_PER_SM)).
/// FOLD: fold the result into the fp32 accumulator AttnParams::accum (forward/accumulate.cuh).
/// DROPOUT: dropout on the probabilities (common/dropout.cuh). SPARSE: only the blocks of a
/// block mask (common/block_sparse.cuh; dense layout).
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, int CTAS_PER_SM, bool SOFTCAP, SeqLayout LAYOUT, bool FOLD = false,
          bool DROPOUT = false, bool SPARSE = false>
__global__ void __launch_bounds__(WARPGROUPS * 128, CTAS_PER_SM) forward_wgmma_kernel(const __grid_constant__ AttnParams p) {
  using Tr = WgmmaForwardTraits<HEAD_DIM, BLOCK_N, WARPGROUPS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes + (LAYOUT == SeqLayout::kPagedCache ? kPageAheadBytes<BLOCK_N> : 0)) __trap();  // launch contract
  const GridCell cell = grid_cell<SPARSE>(p);
  const int head = cell.y, seq = cta_batch(p);
  const SeqSpan span = seq_span<LAYOUT>(p, seq);
  const HeadView<T> head_view(p, seq, head, span);
  const bool covered = for_each_row_block<LAYOUT, Tr::kBlockM>(cell.x, span.seqlen_q, [&](int m_block) {
    forward_wgmma_block<T, HEAD_DIM, BLOCK_N, WARPGROUPS, SOFTCAP, LAYOUT, FOLD, DROPOUT, SPARSE>(p, seq, head, span, head_view, m_block, smem_raw);
  });
  if (!covered && cell.x == 0)
    mark_uncovered_rows<T>(head_view.out, p.out_strides[1], head_view.lse, p.head_dim, int(gridDim.x) * Tr::kBlockM, span.seqlen_q);
}

}  // namespace cuattn
