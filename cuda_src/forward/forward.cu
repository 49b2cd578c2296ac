// Tensor-core attention forward (FlashAttention-2 scheme): one CTA per (query block, head,
// sequence), K/V blocks streamed through shared memory with cp.async, S = Q K^T and O += P V on
// mma.sync, online softmax in registers, lse written per row.
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "common/dropout.cuh"
#include "common/head_view.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/tile_copy.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "forward/accumulate.cuh"
#include "forward/online_softmax.cuh"
#include "forward/traits.cuh"

namespace cuattn {

/// \brief One block of query rows of one (sequence, head): writes its rows of out and lse.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool SOFTCAP, SeqLayout LAYOUT, bool FOLD, bool DROPOUT, bool SPARSE>
__device__ __forceinline__ void forward_block(const AttnParams& p, int seq, int head, const SeqSpan& span, const HeadView<T>& head_view, int m_block,
                                              unsigned char* smem_raw) {
  using Tr = ForwardTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK_ring = sQ + Tr::kSmemQ;                   // kStages K tiles, then kStages V tiles
  T* sV_ring = sK_ring + Tr::kStages * Tr::kSmemKV;

  const int m0 = m_block * BLOCK_M;
  const int m_last = min(m0 + BLOCK_M, span.seqlen_q) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const T* q = head_view.q;
  const T* k = head_view.k;
  const T* v = head_view.v;

  const KeyBand band(p, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  const int n_first = key_first / BLOCK_N;
  const int n_last = key_last < key_first ? n_first - 1 : key_last / BLOCK_N;
  const KeyTiles<SPARSE, BLOCK_N, BLOCK_M> tiles(p, seq, head, m0, n_first, n_last);

  float acc[Tr::kMTiles][Tr::kDTiles][4];
  float row_max[Tr::kMTiles][2], row_sum[Tr::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = neg_inf();
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  constexpr bool PAGED = LAYOUT == SeqLayout::kPagedCache;
  i64* s_offsets = reinterpret_cast<i64*>(smem_raw + Tr::kSmemBytes);  // paged: two blocks' key offsets (kPageAheadBytes)
  const CacheRows<true> cache(p, seq);                                 // paged: the block table's row (unused otherwise)
  const auto load_kv = [&](int n_block, int stage) {
    const int n0 = n_block * BLOCK_N;
    if constexpr (PAGED) {
      const i64* offsets = s_offsets + (n_block & 1) * 2 * BLOCK_N;
      load_paged_tile<Tr, BLOCK_N, false>(sK_ring + stage * Tr::kSmemKV, k, offsets, n0, span.seqlen_k, p.head_dim);
      load_paged_tile<Tr, BLOCK_N, false>(sV_ring + stage * Tr::kSmemKV, v, offsets + BLOCK_N, n0, span.seqlen_k, p.head_dim);
    } else {
      load_tile<Tr, BLOCK_N>(sK_ring + stage * Tr::kSmemKV, k, p.k_strides[1], n0, span.seqlen_k, p.head_dim);
      load_tile<Tr, BLOCK_N>(sV_ring + stage * Tr::kSmemKV, v, p.v_strides[1], n0, span.seqlen_k, p.head_dim);
    }
  };
  int page_ahead = 0;  // paged: the page of this thread's key in the block after next
  if (tiles.any()) {
    if constexpr (PAGED) {
      store_key_offsets<BLOCK_N>(s_offsets, p, cache, n_last, page_of_key<BLOCK_N>(cache, n_last, n_first, span.seqlen_k));
      page_ahead = page_of_key<BLOCK_N>(cache, n_last - 1, n_first, span.seqlen_k);
      __syncthreads();
    }
    load_tile<Tr, BLOCK_M>(sQ, q, p.q_strides[1], m0, span.seqlen_q, p.head_dim);
    load_kv(tiles.start(), 0);
    cp_async_commit();
  }
  const int warp_row0 = warp * Tr::kWarpRows;
  // This warp's rows and the keys they see: near the diagonal (or a window edge) a warp skips
  // the key blocks none of its rows see, and masks only the blocks its own rows cut.
  const int warp_first_row = m0 + warp_row0;
  const int warp_last_row = min(warp_first_row + Tr::kWarpRows, span.seqlen_q) - 1;
  const int warp_first_key = band.first_key(warp_first_row), warp_last_key = band.last_key(warp_last_row);

  // Key blocks from last to first, so that the partially masked diagonal block comes first. A
  // two-stage ring: the next block is copied in while this one is computed, one barrier per
  // block. (Block-sparse: the kept blocks, common/block_sparse.cuh; paged: consecutive blocks.)
  for (int i = 0, n_block = tiles.start(), stage = 0; tiles.more(i, n_block); n_block = tiles.next(i, n_block), ++i, stage ^= 1) {
    const int n0 = n_block * BLOCK_N;
    cp_async_wait<0>();
    if constexpr (PAGED) store_key_offsets<BLOCK_N>(s_offsets, p, cache, n_block - 1, page_ahead);  // read after the barrier
    __syncthreads();  // K/V[n_block] (and Q) landed; every warp finished with the other stage
    if (tiles.has_next(i, n_block)) {
      load_kv(tiles.next(i, n_block), stage ^ 1);
      cp_async_commit();
    }
    if constexpr (PAGED) page_ahead = page_of_key<BLOCK_N>(cache, n_block - 2, n_first, span.seqlen_k);  // stored next iteration
    if (warp_last_row < warp_first_row || n0 > warp_last_key || n0 + BLOCK_N <= warp_first_key) continue;
    const T* sK = sK_ring + stage * Tr::kSmemKV;
    const T* sV = sV_ring + stage * Tr::kSmemKV;

    float s[Tr::kMTiles][Tr::kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

#pragma unroll(Tr::kQkUnroll)
    for (int kk = 0; kk < HEAD_DIM; kk += 16) {
      u32 a[Tr::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        const int r = warp_row0 + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4(a[mt], sQ + r * Tr::kRowStride + kk + (lane / 16) * 8);
      }
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; nt += 2) {
        u32 b[4];  // b0,b1 of n-tile nt, then of nt + 1
        const int r = nt * 8 + (lane % 8) + (lane / 16) * 8;
        ldmatrix_x4(b, sK + r * Tr::kRowStride + kk + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
          mma_16816<T>(s[mt][nt], a[mt], b[0], b[1]);
          mma_16816<T>(s[mt][nt + 1], a[mt], b[2], b[3]);
        }
      }
    }
    if (SOFTCAP) softcap_scores(s, p);
    if (!band.all_visible(warp_first_row, warp_last_row, n0, n0 + BLOCK_N - 1)) mask_scores(s, band, warp_first_row, n0);
    online_softmax(s, row_max, row_sum, acc, p.exp2_scale);
    if constexpr (DROPOUT) {  // after the row sums: dropout leaves the denominators alone
      const DropoutDraws draws(p, seq, head);
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) draws.drop_rows<Tr::kNTiles, false>(s[mt], warp_first_row + mt * 16, n0, lane);
    }

#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      u32 a[Tr::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) c_tiles_to_a<T>(s[mt], kk, a[mt]);  // P as the A operand
#pragma unroll
      for (int dt = 0; dt < Tr::kDTiles; dt += 2) {
        u32 b[4];  // b0,b1 of d-tile dt, then of dt + 1
        const int r = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(b, sV + r * Tr::kRowStride + dt * 8 + (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
          mma_16816<T>(acc[mt][dt], a[mt], b[0], b[1]);
          mma_16816<T>(acc[mt][dt + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: finish the row sums across the quad, normalize (folding into the accumulator when
  // there is one: forward/accumulate.cuh), and stage the warp's rows of out in its own rows of sQ
  // (no other warp reads them), then store them in 16-byte chunks.
  T* sOut = sQ + warp_row0 * Tr::kRowStride;
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      RowTotal total = finish_row(row_max[mt][h], row_sum[mt][h], p.exp2_scale, head_view.sink);
      if constexpr (DROPOUT) total.inv *= p.dropout_scale;  // kept probabilities, scaled up
      const int r = mt * 16 + g + h * 8;
      if constexpr (!FOLD) {
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt) {
          *reinterpret_cast<u32*>(sOut + r * Tr::kRowStride + dt * 8 + 2 * t) =
              pack2<T>(acc[mt][dt][2 * h] * total.inv, acc[mt][dt][2 * h + 1] * total.inv);
        }
        const int row = warp_first_row + r;
        if (t == 0 && row < span.seqlen_q && head_view.lse != nullptr) head_view.lse[row] = total.lse;
      } else {  // the same for the whole CTA; the quad's first lane reads and writes lse
        const int row = warp_first_row + r;
        const bool in_range = row < span.seqlen_q;
        const Fold fold = fold_weights(__shfl_sync(0xffffffff, accumulated_lse(p, head_view.lse + row, in_range && t == 0), lane & ~3), total.lse);
        float* acc_row = head_view.accum + row * p.accum_strides[1];
#pragma unroll
        for (int d0 = 0; d0 < Tr::kDTiles; d0 += kFoldLoads) {
          float2 old[kFoldLoads];
          load_acc_pairs<Tr::kDTiles>(old, acc_row, d0, t, p.head_dim, in_range && fold.keep > 0.f);
#pragma unroll
          for (int dt = d0; dt < d0 + kFoldLoads && dt < Tr::kDTiles; ++dt) {
            const float w = total.inv * fold.take;
            float2 o = make_float2(acc[mt][dt][2 * h] * w, acc[mt][dt][2 * h + 1] * w);
            const int col = dt * 8 + 2 * t;
            if (in_range && col < p.head_dim) {
              o = make_float2(fmaf(fold.keep, old[dt - d0].x, o.x), fmaf(fold.keep, old[dt - d0].y, o.y));
              if (p.out == nullptr) *reinterpret_cast<float2*>(acc_row + col) = o;  // the last piece: out alone
            }
            *reinterpret_cast<u32*>(sOut + r * Tr::kRowStride + col) = pack2<T>(o.x, o.y);
          }
        }
        if (t == 0 && in_range && head_view.lse != nullptr) head_view.lse[row] = fold.lse;
      }
    }
  }
  __syncwarp();
  constexpr int kOutChunks = Tr::kWarpRows * Tr::kChunksPerRow;
  static_assert(kOutChunks % 32 == 0, "whole store rounds");
#pragma unroll
  for (int i = 0; i < kOutChunks / 32; ++i) {
    const int chunk = i * 32 + lane;
    const int r = chunk / Tr::kChunksPerRow, c = (chunk % Tr::kChunksPerRow) * 8;
    if (warp_first_row + r < span.seqlen_q && c < p.head_dim && (!FOLD || p.out != nullptr)) {
      *reinterpret_cast<uint4*>(head_view.out + (warp_first_row + r) * p.out_strides[1] + c) =
          *reinterpret_cast<const uint4*>(sOut + r * Tr::kRowStride + c);
    }
  }
}

/// \brief Attention forward: one CTA per (block of query rows, head, sequence)
/// (common/grid.cuh, common/seq_layout.cuh); query blocks run heaviest-first.
/// FOLD: fold the result into the fp32 accumulator AttnParams::accum (forward/accumulate.cuh).
/// DROPOUT: dropout on the probabilities (common/dropout.cuh). SPARSE: only the blocks of a
/// block mask (common/block_sparse.cuh; dense layout).
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool SOFTCAP, SeqLayout LAYOUT, bool FOLD = false, bool DROPOUT = false,
          bool SPARSE = false>
__global__ void __launch_bounds__(WARPS * 32) forward_kernel(const __grid_constant__ AttnParams p) {
  using Tr = ForwardTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes + (LAYOUT == SeqLayout::kPagedCache ? kPageAheadBytes<BLOCK_N> : 0)) __trap();  // launch contract
  const GridCell cell = grid_cell<SPARSE>(p);
  const int head = cell.y, seq = cta_batch(p);
  const SeqSpan span = seq_span<LAYOUT>(p, seq);
  const HeadView<T> head_view(p, seq, head, span);
  const bool covered = for_each_row_block<LAYOUT, BLOCK_M>(cell.x, span.seqlen_q, [&](int m_block) {
    forward_block<T, HEAD_DIM, BLOCK_M, BLOCK_N, WARPS, SOFTCAP, LAYOUT, FOLD, DROPOUT, SPARSE>(p, seq, head, span, head_view, m_block, smem_raw);
  });
  if (!covered && cell.x == 0)
    mark_uncovered_rows<T>(head_view.out, p.out_strides[1], head_view.lse, p.head_dim, int(gridDim.x) * BLOCK_M, span.seqlen_q);
}

}  // namespace cuattn
