// Base pointers of one (sequence, head) of the attention tensors; K/V of the query head's group.
#pragma once
#include "params.cuh"
#include "seq_layout.cuh"
#include "sink.cuh"

namespace cuattn {

template <typename T>
struct HeadView {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  float* lse;
  float sink;    // the head's sink logit, -inf without sinks (common/sink.cuh)
  float* accum;  // null, or the head's rows of the fp32 accumulator (forward/accumulate.cuh)

  // Rows of sequence `seq` (common/seq_layout.cuh) for query head `head`.
  __device__ __forceinline__ HeadView(const AttnParams& p, int seq, int head, const SeqSpan& span) {
    const int kv_head = head / (p.heads_q / p.heads_kv);  // GQA: K/V read in place per group
    q = static_cast<const T*>(p.q) + seq * p.q_strides[0] + span.q_row0 * p.q_strides[1] + head * p.q_strides[2];
    k = static_cast<const T*>(p.k) + span.k_batch * p.k_strides[0] + span.k_row0 * p.k_strides[1] + kv_head * p.k_strides[2];
    v = static_cast<const T*>(p.v) + span.k_batch * p.v_strides[0] + span.k_row0 * p.v_strides[1] + kv_head * p.v_strides[2];
    out = static_cast<T*>(p.out) + seq * p.out_strides[0] + span.q_row0 * p.out_strides[1] + head * p.out_strides[2];
    // lse rows have stride 1; null: not wanted
    lse = p.lse == nullptr ? nullptr : p.lse + seq * p.lse_strides[0] + head * p.lse_strides[1] + span.q_row0;
    sink = sink_of(p.sink, head);
    accum = p.accum == nullptr ? nullptr : p.accum + seq * p.accum_strides[0] + span.q_row0 * p.accum_strides[1] + head * p.accum_strides[2];
  }
};

}  // namespace cuattn
