// Where a sequence's rows live: the one place where (sequence, row) becomes a row of q, k, v,
// out and lse. Dense tensors are (batch, seqlen, heads, head_dim), a sequence placed by the
// batch stride; packed ones are (total, heads, head_dim), sequence b holding rows
// cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (passed as batch stride 0). The cache layouts
// (attention_with_kvcache) have dense queries and take the keys of sequence b from its KV
// cache: the first cache_seqlens[b] + seqlen_new positions of a cache row (kCache) or of its
// pages (kPagedCache, through the block table: CacheRows), queries bottom-right aligned. A
// kernel takes the layout as a template parameter and reads every length, first row and mask
// diagonal from the span.
#pragma once
#include "dtypes.cuh"
#include "params.cuh"

namespace cuattn {

enum class SeqLayout { kDense, kPacked, kCache, kPagedCache };

// Whether q, out and lse are (batch, seqlen_q, ...) with every sequence seqlen_q rows long.
__host__ __device__ constexpr bool dense_queries(SeqLayout layout) { return layout != SeqLayout::kPacked; }

struct SeqSpan {
  int seqlen_q;
  int seqlen_k;
  int q_row0;           // first row of the sequence in q / out / lse (0 when dense)
  int k_row0;           // first row in k / v
  int diagonal_offset;  // key position of query row 0's diagonal (AttnParams)
  int k_batch;          // index of k / v's batch stride: the sequence, its cache row, or 0 (pages)
};

// Keys a sequence's cache holds after the append: cache_seqlens[seq] + seqlen_new, clamped to
// the capacity (the length first: no int overflow). Params: DecodeParams or AttnParams.
template <typename Params>
__device__ __forceinline__ int cache_length(const Params& p, int seq) {
  const int cached = min(max(p.cache_seqlens[seq], 0), p.capacity);
  return cached + min(p.seqlen_new, p.capacity - cached);
}

// Where key j of a sequence's KV cache lives (attention_with_kvcache): a position of a
// contiguous cache row, or of a page of a paged cache through the block table, for any page
// size (powers of two by shift and mask). Lengths, table entries and cache rows are clamped into
// the arrays: bad device values move no access outside them. Params: DecodeParams or AttnParams.
template <bool PAGED>
struct CacheRows {
  const int* table;  // this sequence's block-table row (paged)
  int row;           // the sequence's cache row (contiguous)
  int page_size;
  int page_shift;    // log2(page_size) for a power of two, else -1
  int last_row;

  template <typename Params>
  __device__ __forceinline__ CacheRows(const Params& p, int seq) {
    page_size = p.page_size;
    page_shift = (page_size & (page_size - 1)) == 0 ? __popc(page_size - 1) : -1;
    last_row = p.cache_rows - 1;
    table = PAGED ? p.block_table + seq * p.block_table_stride : nullptr;
    row = PAGED || p.cache_batch_idx == nullptr ? seq : min(max(p.cache_batch_idx[seq], 0), last_row);
  }
  __device__ __forceinline__ int page_of(int j) const { return page_shift >= 0 ? j >> page_shift : j / page_size; }
  // Paged, in two steps so that a kernel can keep the load in flight and clamp at the use: the
  // block table's entry for key j (0 <= j < capacity), then that entry clamped into the cache
  // (the page: the index of strides[0]; contiguous caches use `row`).
  __device__ __forceinline__ int table_entry(int j) const { return table[page_of(j)]; }
  __device__ __forceinline__ int clamp_row(int entry) const { return min(max(entry, 0), last_row); }
  // The position of key j within that row or page: the index of strides[1].
  __device__ __forceinline__ int pos_of(int j) const {
    if constexpr (PAGED) {
      return page_shift >= 0 ? j & (page_size - 1) : j - page_of(j) * page_size;
    } else {
      return j;
    }
  }
};

// A sequence's pair of packed offsets is read clamped into [0, total], its end no lower than
// its start (sequences may still overlap one another): bad device-side cu_seqlens cannot move
// an access outside the arrays.
__device__ __forceinline__ void packed_rows(const int* cu_seqlens, int seq, int total, int& first, int& length) {
  first = min(max(cu_seqlens[seq], 0), total);
  length = min(max(cu_seqlens[seq + 1], first), total) - first;
}

template <SeqLayout LAYOUT>
__device__ __forceinline__ SeqSpan seq_span(const AttnParams& p, int seq) {
  if constexpr (LAYOUT == SeqLayout::kDense) {
    return {p.seqlen_q, p.seqlen_k, 0, 0, p.diagonal_offset, seq};
  } else if constexpr (LAYOUT == SeqLayout::kPacked) {
    SeqSpan s;
    packed_rows(p.cu_seqlens_q, seq, p.total_q, s.q_row0, s.seqlen_q);
    packed_rows(p.cu_seqlens_k, seq, p.total_k, s.k_row0, s.seqlen_k);
    s.diagonal_offset = p.bottom_right ? s.seqlen_k - s.seqlen_q : 0;
    s.k_batch = seq;  // batch stride 0
    return s;
  } else {
    const int length = cache_length(p, seq);
    const int k_batch = LAYOUT == SeqLayout::kCache ? CacheRows<false>(p, seq).row : 0;  // paged: page 0, pages added per key
    return {p.seqlen_q, length, 0, 0, length - p.seqlen_q, k_batch};
  }
}

// The packed sequence holding query row `row` of the packed tensors (binary search of the
// clamped offsets), its span in `span`; -1 when no sequence holds it (offsets that do not cover
// every row).
__device__ __forceinline__ int packed_sequence_of_row(const AttnParams& p, int row, SeqSpan& span) {
  int lo = 0, hi = p.batch - 1;  // the last sequence whose first row is <= row
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (min(max(p.cu_seqlens_q[mid], 0), p.total_q) <= row) lo = mid; else hi = mid - 1;
  }
  span = seq_span<SeqLayout::kPacked>(p, lo);
  return row >= span.q_row0 && row < span.q_row0 + span.seqlen_q ? lo : -1;
}

// Whether a CTA whose block starts at row `first_row` of a sequence of `length` rows has work:
// a packed grid is sized from a bound on the lengths, so blocks past a shorter sequence exit.
template <SeqLayout LAYOUT>
__device__ __forceinline__ bool block_in_sequence(int first_row, int length) {
  return dense_queries(LAYOUT) || first_row < length;
}

// Whether `grid_blocks` blocks of BLOCK_ROWS rows (by default the grid's x extent) reach every
// row of a sequence of `length`; always for dense grids. Rows past the grid are marked
// (mark_uncovered_rows) by the CTA of the first block.
template <SeqLayout LAYOUT, int BLOCK_ROWS>
__device__ __forceinline__ bool grid_covers(int length, int grid_blocks) {
  return dense_queries(LAYOUT) || length <= grid_blocks * BLOCK_ROWS;
}

template <SeqLayout LAYOUT, int BLOCK_ROWS>
__device__ __forceinline__ bool grid_covers(int length) {
  return grid_covers<LAYOUT, BLOCK_ROWS>(length, int(gridDim.x));
}

// Runs body(m_block) for the block of BLOCK_ROWS query rows of grid column `x` (this CTA's
// blockIdx.x, or its common/grid.cuh grid_cell), the grid's last (heaviest under a causal mask)
// first; one block per CTA. A packed grid is sized from a bound on the
// lengths (max_seqlen_q, the caller's word): blocks past it return false from here, and the
// caller marks those rows (mark_uncovered_rows) instead of leaving them unwritten.
template <SeqLayout LAYOUT, int BLOCK_ROWS, typename Body>
__device__ __forceinline__ bool for_each_row_block(int x, int seqlen_q, Body&& body) {
  const int m_block = int(gridDim.x) - 1 - x;
  if constexpr (dense_queries(LAYOUT)) {
    body(m_block);
    return true;
  } else {
    if (m_block * BLOCK_ROWS < seqlen_q) body(m_block);
    return grid_covers<LAYOUT, BLOCK_ROWS>(seqlen_q);
  }
}

// Rows [row_first, seqlen_q) of one (sequence, head) that no CTA computed (max_seqlen_q was
// below the sequence's length): NaN in out and lse, so that the error shows. Run by one CTA.
template <typename T>
__device__ __forceinline__ void mark_uncovered_rows(T* out, i64 row_stride, float* lse, int head_dim, int row_first, int seqlen_q) {
  const float nan = __int_as_float(0x7fc00000);
  for (i64 i = threadIdx.x; i < i64(seqlen_q - row_first) * head_dim; i += blockDim.x) {
    const int row = row_first + int(i / head_dim);
    out[row * row_stride + i % head_dim] = from_float<T>(nan);
    if (i % head_dim == 0 && lse != nullptr) lse[row] = nan;
  }
}

}  // namespace cuattn
