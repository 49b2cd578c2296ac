// Attention forward for Hopper (sm_90a): the FlashAttention-2 loop of forward.cu with its matmuls
// on warpgroup tensor cores. Each warpgroup owns 64 query rows; S = Q K^T reads Q and K from
// 128-byte-swizzled shared memory, O += P V takes P from registers and V from shared memory.
// K/V blocks stream through a two-stage cp.async ring shared by the CTA; the warpgroups'
// matmuls and softmax interleave on the SM's tensor cores and ALUs.
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "common/dropout.cuh"
#include "common/head_view.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "common/tile_copy.cuh"
#include "common/wgmma.cuh"
#include "forward/accumulate.cuh"
#include "forward/online_softmax.cuh"
#include "forward/wgmma_traits.cuh"

namespace cuattn {

/// \brief One block of query rows of one (sequence, head): writes its rows of out and lse.
template <typename T, int HEAD_DIM, int BLOCK_N, int WARPGROUPS, bool SOFTCAP, SeqLayout LAYOUT, bool FOLD, bool DROPOUT, bool SPARSE>
__device__ __forceinline__ void forward_wgmma_block(const AttnParams& p, int seq, int head, const SeqSpan& span, const HeadView<T>& head_view, int m_block,
                                                    unsigned char* smem_raw) {
  using Tr = WgmmaForwardTraits<HEAD_DIM, BLOCK_N, WARPGROUPS>;
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
  const KeyTiles<SPARSE, BLOCK_N> tiles(p, seq, head, m0, n_first, n_last);

  float acc[1][Tr::kDTiles][4];
  float row_max[1][2] = {{neg_inf(), neg_inf()}}, row_sum[1][2] = {{0.f, 0.f}};
#pragma unroll
  for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][dt][e] = 0.f;

  constexpr bool PAGED = LAYOUT == SeqLayout::kPagedCache;
  i64* s_offsets = reinterpret_cast<i64*>(smem_raw + Tr::kSmemBytes);  // paged: two blocks' key offsets (kPageAheadBytes)
  const CacheRows<true> cache(p, seq);                                 // paged: the block table's row (unused otherwise)
  const auto load_kv = [&](int n_block, int stage) {
    const int n0 = n_block * BLOCK_N;
    if constexpr (PAGED) {
      const i64* offsets = s_offsets + (n_block & 1) * 2 * BLOCK_N;
      load_paged_tile<Tr, BLOCK_N, true>(sK_ring + stage * Tr::kKVBytes, head_view.k, offsets, n0, span.seqlen_k, p.head_dim);
      load_paged_tile<Tr, BLOCK_N, true>(sV_ring + stage * Tr::kKVBytes, head_view.v, offsets + BLOCK_N, n0, span.seqlen_k, p.head_dim);
    } else {
      load_tile_sw128<Tr, BLOCK_N>(sK_ring + stage * Tr::kKVBytes, head_view.k, p.k_strides[1], n0, span.seqlen_k, p.head_dim);
      load_tile_sw128<Tr, BLOCK_N>(sV_ring + stage * Tr::kKVBytes, head_view.v, p.v_strides[1], n0, span.seqlen_k, p.head_dim);
    }
  };
  int page_ahead = 0;  // paged: the page of this thread's key in the block after next
  if (tiles.any()) {
    if constexpr (PAGED) {
      store_key_offsets<BLOCK_N>(s_offsets, p, cache, n_last, page_of_key<BLOCK_N>(cache, n_last, n_first, span.seqlen_k));
      page_ahead = page_of_key<BLOCK_N>(cache, n_last - 1, n_first, span.seqlen_k);
      __syncthreads();
    }
    load_tile_sw128<Tr, Tr::kBlockM>(sQ, head_view.q, p.q_strides[1], m0, span.seqlen_q, p.head_dim);
    load_kv(tiles.start(), 0);
    cp_async_commit();
  }
  // This warpgroup's rows and the keys they see (a warpgroup skips the key blocks none of its
  // rows see), and this warp's rows (masking is per warp).
  const int wg_first_row = m0 + wg * 64;
  const int wg_last_row = min(wg_first_row + 64, span.seqlen_q) - 1;
  const int wg_first_key = band.first_key(wg_first_row), wg_last_key = band.last_key(wg_last_row);
  const int warp_first_row = wg_first_row + warp * 16;
  const int warp_last_row = min(warp_first_row + 16, span.seqlen_q) - 1;
  const u32 q_addr = smem_addr(sQ);

  // Key blocks from last to first, so that the partially masked diagonal block comes first
  // (block-sparse: the kept blocks, common/block_sparse.cuh; paged: consecutive blocks).
  for (int i = 0, n_block = tiles.start(), stage = 0; tiles.more(i, n_block); n_block = tiles.next(i, n_block), ++i, stage ^= 1) {
    const int n0 = n_block * BLOCK_N;
    cp_async_wait<0>();
    if constexpr (PAGED) store_key_offsets<BLOCK_N>(s_offsets, p, cache, n_block - 1, page_ahead);  // read after the barrier
    fence_proxy_async();  // this thread's copies, visible to the tensor cores' async proxy
    __syncthreads();      // K/V[n_block] (and Q) landed; every warpgroup finished with the other stage
    if (tiles.has_next(i, n_block)) {
      load_kv(tiles.next(i, n_block), stage ^ 1);
      cp_async_commit();
    }
    if constexpr (PAGED) page_ahead = page_of_key<BLOCK_N>(cache, n_block - 2, n_first, span.seqlen_k);  // stored next iteration
    if (wg_last_row < wg_first_row || n0 > wg_last_key || n0 + BLOCK_N <= wg_first_key) continue;
    const u32 k_addr = smem_addr(sK_ring + stage * Tr::kKVBytes), v_addr = smem_addr(sV_ring + stage * Tr::kKVBytes);

    float s[1][Tr::kNTiles][4];
    wgmma_fence();
    wgmma_rows_by_rows<T, BLOCK_N, HEAD_DIM>(s[0], q_addr, Tr::kBlockM, wg * 64, k_addr);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s[0]);

    if (SOFTCAP) softcap_scores(s, p);
    if (!band.all_visible(warp_first_row, warp_last_row, n0, n0 + BLOCK_N - 1)) mask_scores(s, band, warp_first_row, n0);
    online_softmax(s, row_max, row_sum, acc, p.exp2_scale);
    if constexpr (DROPOUT) DropoutDraws(p, seq, head).drop_rows<Tr::kNTiles, false>(s[0], warp_first_row, n0, lane);

    wgmma_fence();
    wgmma_frag_by_tile<T, BLOCK_N, HEAD_DIM>(acc[0], s[0], v_addr);  // O += P V
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(acc[0]);
  }

  // Epilogue: normalize (folding into the accumulator when there is one: forward/accumulate.cuh),
  // stage the warpgroup's rows of out in its own rows of sQ (no other warpgroup reads them; its
  // own matmuls are done), then store them in 16-byte chunks.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    RowTotal total = finish_row(row_max[0][h], row_sum[0][h], p.exp2_scale, head_view.sink);
    if constexpr (DROPOUT) total.inv *= p.dropout_scale;  // kept probabilities, scaled up
    const int r = wg * 64 + warp * 16 + g + h * 8;  // row of the CTA's tile
    if constexpr (!FOLD) {
#pragma unroll
      for (int dt = 0; dt < Tr::kDTiles; ++dt) {
        const int col = dt * 8 + 2 * t;
        unsigned char* dst = sQ + (col / kSwizzleBlockElems) * Tr::kBlockM * kSwizzleRowBytes +
                             swizzled_chunk(r, col % kSwizzleBlockElems / 8) + (col % 8) * 2;
        *reinterpret_cast<u32*>(dst) = pack2<T>(acc[0][dt][2 * h] * total.inv, acc[0][dt][2 * h + 1] * total.inv);
      }
      if (t == 0 && m0 + r < span.seqlen_q && head_view.lse != nullptr) head_view.lse[m0 + r] = total.lse;
    } else {  // the same for the whole CTA; the quad's first lane reads and writes lse
      const int row = m0 + r;
      const bool in_range = row < span.seqlen_q;
      const Fold fold = fold_weights(__shfl_sync(0xffffffff, accumulated_lse(p, head_view.lse + row, in_range && t == 0), lane & ~3), total.lse);
      float* acc_row = head_view.accum + row * p.accum_strides[1];
#pragma unroll
      for (int d0 = 0; d0 < Tr::kDTiles; d0 += kFoldLoads) {
        float2 old[kFoldLoads];
        load_acc_pairs<Tr::kDTiles>(old, acc_row, d0, t, p.head_dim, in_range && fold.keep > 0.f);
#pragma unroll
        for (int dt = d0; dt < d0 + kFoldLoads && dt < Tr::kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          const float w = total.inv * fold.take;
          float2 o = make_float2(acc[0][dt][2 * h] * w, acc[0][dt][2 * h + 1] * w);
          if (in_range && col < p.head_dim) {
            o = make_float2(fmaf(fold.keep, old[dt - d0].x, o.x), fmaf(fold.keep, old[dt - d0].y, o.y));
            *reinterpret_cast<float2*>(acc_row + col) = o;
          }
          unsigned char* dst = sQ + (col / kSwizzleBlockElems) * Tr::kBlockM * kSwizzleRowBytes +
                               swizzled_chunk(r, col % kSwizzleBlockElems / 8) + (col % 8) * 2;
          *reinterpret_cast<u32*>(dst) = pack2<T>(o.x, o.y);
        }
      }
      if (t == 0 && in_range && head_view.lse != nullptr) head_view.lse[row] = fold.lse;
    }
  }
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");  // this warpgroup's rows staged
  constexpr int kOutChunks = 64 * Tr::kChunksPerRow;
#pragma unroll
  for (int i = 0; i < kOutChunks / 128; ++i) {
    const int chunk = i * 128 + threadIdx.x % 128;
    const int r = wg * 64 + chunk / Tr::kChunksPerRow, c = chunk % Tr::kChunksPerRow;
    if (m0 + r < span.seqlen_q && c * 8 < p.head_dim && (!FOLD || p.out != nullptr)) {
      *reinterpret_cast<uint4*>(head_view.out + (m0 + r) * p.out_strides[1] + c * 8) = *reinterpret_cast<const uint4*>(
          sQ + (c / 8) * Tr::kBlockM * kSwizzleRowBytes + swizzled_chunk(r, c % 8));
    }
  }
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
