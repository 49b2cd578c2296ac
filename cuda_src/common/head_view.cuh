// Base pointers of one (batch, head) of the attention tensors; K/V of the query head's group.
#pragma once
#include "params.cuh"

namespace cuattn {

template <typename T>
struct HeadView {
  const T* q;
  const T* k;
  const T* v;
  T* out;
  float* lse;

  __device__ __forceinline__ HeadView(const AttnParams& p, int batch, int head) {
    const int kv_head = head / (p.heads_q / p.heads_kv);  // GQA: K/V read in place per group
    q = static_cast<const T*>(p.q) + batch * p.q_strides[0] + head * p.q_strides[2];
    k = static_cast<const T*>(p.k) + batch * p.k_strides[0] + kv_head * p.k_strides[2];
    v = static_cast<const T*>(p.v) + batch * p.v_strides[0] + kv_head * p.v_strides[2];
    out = static_cast<T*>(p.out) + batch * p.out_strides[0] + head * p.out_strides[2];
    lse = p.lse == nullptr ? nullptr : p.lse + batch * p.lse_strides[0] + head * p.lse_strides[1];  // null: not wanted
  }
};

}  // namespace cuattn
