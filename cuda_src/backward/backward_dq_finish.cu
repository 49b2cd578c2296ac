// The last pass of the fused backward (backward_wgmma_fused.cu): dq = scale * dq_accum, from the
// fp32 accumulator's tiles (backward/dq_accum.cuh) into dq's layout and dtype (or added into an
// fp32 dq: BackwardParams::sum_grads).
#include "backward/head_rows.cuh"
#include "common/params.cuh"
#include "common/vector_io.cuh"

namespace cuattn {

constexpr int kFinishWarps = 8;

/// \brief A group of kRowLanes lanes per query row (GroupQueryRow: dense or packed rows);
/// HEAD_DIM is the head-dim bucket (head_dim <= HEAD_DIM). A packed row of a sequence whose keys
/// outnumber the fused kernel's grid (p.attn.seqlen_k: max_seqlen_k, common/seq_layout.cuh) misses
/// some keys' terms: it is set to NaN so that the bad bound shows.
template <typename T, int HEAD_DIM, SeqLayout LAYOUT>
__global__ void __launch_bounds__(kFinishWarps * 32) backward_dq_finish_kernel(const __grid_constant__ BackwardParams p) {
  static_assert(sizeof(T) == 2, "the fused backward serves float16 / bfloat16 (8-byte dq stores)");
  constexpr int kVec = 4;  // two of the accumulator's float pairs (head_dim is a multiple of 8)
  const AttnParams& a = p.attn;
  const GroupQueryRow<kFinishWarps, LAYOUT> r(a);
  if (!r.valid) return;
  SeqSpan span;
  int seq = r.batch, row_in_seq = r.row;
  float factor = a.scale;
  if constexpr (LAYOUT == SeqLayout::kDense) {
    span = seq_span<LAYOUT>(a, seq);
  } else {
    seq = packed_sequence_of_row(a, r.row, span);
    if (seq < 0) return;  // offsets that leave the row outside every sequence
    row_in_seq = r.row - span.q_row0;
    if (span.seqlen_k > a.seqlen_k) factor = __int_as_float(0x7fc00000);
  }
  const i64 dq_offset = r.batch * p.dq_strides[0] + r.row * p.dq_strides[1] + r.head * p.dq_strides[2];
  constexpr int kSteps = (HEAD_DIM + kRowLanes * kVec - 1) / (kRowLanes * kVec);
  float x[kSteps][kVec];  // every load issued before the first store
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int c = (i * kRowLanes + r.lane()) * kVec;
    if (c < a.head_dim) load_floats<float, kVec>(r.dq_accum_quad(p, seq, span, row_in_seq, c), x[i]);
  }
#pragma unroll
  for (int i = 0; i < kSteps; ++i) {
    const int c = (i * kRowLanes + r.lane()) * kVec;
    if (c >= a.head_dim) continue;
#pragma unroll
    for (int e = 0; e < kVec; ++e) x[i][e] *= factor;
    if (LAYOUT == SeqLayout::kDense && (p.sum_grads & kSumDq)) {  // added into the fp32 sum (BackwardParams::sum_grads)
      float* sum = static_cast<float*>(p.dq) + dq_offset + c;
      float old[kVec];
      load_floats<float, kVec>(sum, old);
#pragma unroll
      for (int e = 0; e < kVec; ++e) x[i][e] += old[e];
      store_floats<float, kVec>(sum, x[i]);
    } else {
      store_floats<T, kVec>(static_cast<T*>(p.dq) + dq_offset + c, x[i]);
    }
  }
}

}  // namespace cuattn
