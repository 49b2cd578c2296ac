// What the backward kernels share around their products: one (sequence, head)'s rows of each
// tensor, the saved per-row statistics, and the (query head, query block) steps that a key
// block streams.
#pragma once
#include "../common/block_sparse.cuh"
#include "../common/mask.cuh"
#include "../common/mma.cuh"
#include "../common/params.cuh"
#include "../common/seq_layout.cuh"
#include "dq_accum.cuh"
#include "score_grad.cuh"

namespace cuattn {

// Row row0 of one (batch, head) of a (batch, seq, head, dim) tensor, read-only or written; row0
// is a sequence's first row (SeqSpan) in a packed tensor (batch stride 0), 0 in a dense one.
template <typename T>
__device__ __forceinline__ const T* head_rows(const void* base, const i64 (&strides)[3], int batch, int head, int row0) {
  return static_cast<const T*>(base) + batch * strides[0] + row0 * strides[1] + head * strides[2];
}
template <typename T>
__device__ __forceinline__ T* head_rows(void* base, const i64 (&strides)[3], int batch, int head, int row0) {
  return static_cast<T*>(base) + batch * strides[0] + row0 * strides[1] + head * strides[2];
}

// Key rows [key_first, seqlen_k) of one (sequence, KV head) that the grid does not reach (its
// bound on the key lengths was too small, common/seq_layout.cuh): NaN in dK and dV, all columns.
template <typename T>
__device__ __forceinline__ void mark_uncovered_key_grads(const BackwardParams& p, int seq, int kv_head, const SeqSpan& span, int key_first) {
  const int dim = p.attn.head_dim;
  mark_uncovered_rows<T>(head_rows<T>(p.dk, p.dk_strides, seq, kv_head, span.k_row0), p.dk_strides[1], nullptr, dim, key_first, span.seqlen_k);
  mark_uncovered_rows<T>(head_rows<T>(p.dv, p.dv_strides, seq, kv_head, span.k_row0), p.dv_strides[1], nullptr, dim, key_first, span.seqlen_k);
}

// The query row of the calling lane group in the row kernels (backward_prep, backward_dq_finish):
// groups of kRowLanes lanes, one row each, rows in (batch, row, head) order, WARPS_PER_CTA warps
// per CTA. Several rows per warp keep more loads in flight than a warp per row (a d64 row is
// only 128 bytes of a 16-bit tensor). Past the last row, valid is false and the row is clamped to
// it, so that whole warps still run their shuffles.
constexpr int kRowLanes = 8;

// Dense rows are (batch, row, head); packed ones (row of the packed tensor, head), batch 0 (the
// rows' strides then address the packed tensors, whose batch stride is 0).
template <int WARPS_PER_CTA, SeqLayout LAYOUT>
struct GroupQueryRow {
  static constexpr int kRowsPerCta = WARPS_PER_CTA * 32 / kRowLanes;
  int batch, row, head;
  bool valid;

  __device__ __forceinline__ explicit GroupQueryRow(const AttnParams& a) {
    const int seqlen = LAYOUT == SeqLayout::kDense ? a.seqlen_q : a.total_q;
    const i64 rows = i64(LAYOUT == SeqLayout::kDense ? a.batch : 1) * seqlen * a.heads_q;
    i64 index = i64(blockIdx.x) * kRowsPerCta + threadIdx.x / kRowLanes;
    valid = index < rows;
    index = valid ? index : rows - 1;
    head = index % a.heads_q;
    row = (index / a.heads_q) % seqlen;
    batch = index / (i64(a.heads_q) * seqlen);
  }
  __device__ __forceinline__ static int lane() { return threadIdx.x % kRowLanes; }
  // The 4 floats at columns col.. col + 3 (col a multiple of 4) of row `row_in_seq` of sequence
  // `seq` in the fused backward's dQ accumulator (backward/dq_accum.cuh): two float2 slots that
  // the row swizzle keeps adjacent.
  __device__ __forceinline__ float* dq_accum_quad(const BackwardParams& p, int seq, const SeqSpan& span, int row_in_seq, int col) const {
    return dq_accum_tile(p, seq, head, span, row_in_seq / kDqTileRows, col / 64) + dq_tile_offset(row_in_seq % kDqTileRows, col % 64);
  }
};

// The forward's lse and the backward's delta of one (sequence, query head), indexed by the
// sequence's query row.
struct RowStats {
  const float* lse;
  const float* delta;

  __device__ __forceinline__ RowStats(const BackwardParams& p, int seq, int head, const SeqSpan& span)
      : lse(p.attn.lse + seq * p.attn.lse_strides[0] + head * p.attn.lse_strides[1] + span.q_row0),
        delta(p.delta + seq * p.delta_strides[0] + head * p.delta_strides[1] + span.q_row0) {}

  // Copies rows m0..m0 + ROWS - 1 (zeros past seqlen_q) into shared vectors: thread i < ROWS
  // copies row m0 + i; without DELTA, lse alone.
  template <int ROWS, bool DELTA = true>
  __device__ __forceinline__ void load(float* sLse, float* sDelta, int m0, int seqlen_q) const {
    if (threadIdx.x < ROWS) {
      const int row = m0 + threadIdx.x;
      const bool valid = row < seqlen_q;
      cp_async_4(sLse + threadIdx.x, valid ? lse + row : lse, valid);
      if constexpr (DELTA) cp_async_4(sDelta + threadIdx.x, valid ? delta + row : delta, valid);
    }
  }

  // The exp2 shift of one row; past seqlen_q +inf (probabilities 0).
  __device__ __forceinline__ float shift(int r, int seqlen_q) const { return r < seqlen_q ? lse_to_exp2_shift(lse[r]) : -neg_inf(); }

  // The exp2 shift and delta of one row (delta 0 past seqlen_q).
  __device__ __forceinline__ void row(int r, int seqlen_q, float& row_shift, float& row_delta) const {
    row_shift = shift(r, seqlen_q);
    row_delta = r < seqlen_q ? delta[r] : 0.f;
  }
};

// The steps a key block [n0, n0 + keys) streams: every query head of the KV head's group times
// every block of BLOCK_M query rows that sees one of its keys; split `split` of `splits` takes
// an even share of them, in order (BackwardParams::query_splits).
template <int BLOCK_M>
struct QuerySteps {
  int group, m_first, m_count, first, steps;

  __device__ __forceinline__ QuerySteps(const AttnParams& a, const SeqSpan& span, const KeyBand& band, int n0, int keys, int split,
                                        int splits) {
    const int row_first = band.first_row(n0);
    const int row_last = band.last_row(min(n0 + keys, span.seqlen_k) - 1, span.seqlen_q);
    group = a.heads_q / a.heads_kv;
    m_first = row_first / BLOCK_M;
    m_count = row_last < row_first ? 0 : row_last / BLOCK_M - m_first + 1;
    const int all = group * m_count;
    first = int(i64(all) * split / splits);
    steps = int(i64(all) * (split + 1) / splits) - first;
  }
  __device__ __forceinline__ int head(int kv_head, int step) const { return kv_head * group + (first + step) / m_count; }
  __device__ __forceinline__ int m0(int step) const { return (m_first + (first + step) % m_count) * BLOCK_M; }
};

// The steps of key block [n0, n0 + keys) of (batch, kv_head): QuerySteps, or under a block mask
// (SPARSE, one split) SparseQuerySteps (common/block_sparse.cuh).
template <bool SPARSE, int BLOCK_M>
__device__ __forceinline__ auto query_steps(const AttnParams& a, const SeqSpan& span, const KeyBand& band, int batch, int kv_head, int n0, int keys,
                                            int split, int splits) {
  if constexpr (SPARSE) {
    return SparseQuerySteps<BLOCK_M>(a, batch, kv_head, n0);
  } else {
    return QuerySteps<BLOCK_M>(a, span, band, n0, keys, split, splits);
  }
}

}  // namespace cuattn
