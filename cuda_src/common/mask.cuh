// Which keys a query row sees: the causal / sliding-window band of AttnParams, and the range of
// key blocks a block of query rows must visit.
#pragma once
#include "params.cuh"
#include "seq_layout.cuh"

namespace cuattn {

struct KeyBand {
  int offset;  // diagonal_offset: key column of query row 0
  int left;    // -1: unbounded
  int right;   // -1: unbounded
  int seqlen_k;

  // The band of one sequence (common/seq_layout.cuh): positions within the sequence.
  __device__ __forceinline__ KeyBand(const AttnParams& p, const SeqSpan& span)
      : offset(span.diagonal_offset), left(p.window_left), right(p.window_right), seqlen_k(span.seqlen_k) {}

  __device__ __forceinline__ bool visible(int row, int col) const {
    return col < seqlen_k && (left < 0 || col >= row + offset - left) && (right < 0 || col <= row + offset + right);
  }
  // First and last key any row of [row_first, row_last] sees (last < first: none).
  __device__ __forceinline__ int first_key(int row_first) const {
    return left < 0 ? 0 : max(0, row_first + offset - left);
  }
  __device__ __forceinline__ int last_key(int row_last) const {
    return right < 0 ? seqlen_k - 1 : min(seqlen_k - 1, row_last + offset + right);
  }
  // First and last query row that sees any key of [key_first, key_last] (last < first: none).
  __device__ __forceinline__ int first_row(int key_first) const {
    return right < 0 ? 0 : max(0, key_first - offset - right);
  }
  __device__ __forceinline__ int last_row(int key_last, int seqlen_q) const {
    return left < 0 ? seqlen_q - 1 : min(seqlen_q - 1, key_last - offset + left);
  }
  // Whether keys [col_first, col_last] are visible to every row of [row_first, row_last]: such
  // blocks skip the per-element mask.
  __device__ __forceinline__ bool all_visible(int row_first, int row_last, int col_first, int col_last) const {
    return col_last < seqlen_k && (left < 0 || col_first >= row_last + offset - left) &&
           (right < 0 || col_last <= row_first + offset + right);
  }
};

}  // namespace cuattn
