// Appends k_new / v_new to the KV cache in place: row t of sequence b goes to position
// cache_seqlens[b] + t of its cache (contiguous row, or the page the block table names, crossing
// pages as needed). Positions past the capacity, pages outside the cache and cache rows
// (cache_batch_idx) outside it are skipped, never written: a bad device value cannot write
// outside the cache (CacheRows clamps, which serves reads only); within it, the rows and pages
// the index arrays name are written, whichever sequence's they are. One warp per
// (sequence, new row, KV head), 16-byte chunks.
#include "common/dependent_launch.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"

namespace cuattn {

constexpr int kAppendWarps = 8;

template <typename T, bool PAGED>
__global__ void __launch_bounds__(kAppendWarps * 32) append_kv_kernel(const __grid_constant__ DecodeParams p) {
  wait_for_previous_grid();  // a dependent launch (cuattn/launch.py): the caller's kernels wrote k_new, v_new
  allow_next_grid();         // the attention kernel may launch; it waits for this grid
  const i64 row = i64(blockIdx.x) * kAppendWarps + threadIdx.x / 32;  // (seq, t, head)
  if (row >= i64(p.batch) * p.seqlen_new * p.heads_kv) return;
  const int head = int(row % p.heads_kv), t = int(row / p.heads_kv % p.seqlen_new), seq = int(row / p.heads_kv / p.seqlen_new);
  const int cached = min(max(p.cache_seqlens[seq], 0), p.capacity);  // clamped first: no int overflow
  if (t >= p.capacity - cached || p.cache_rows == 0) return;
  const int pos = cached + t;
  const CacheRows<PAGED> cache(p, seq);
  // The row (page) written, unclamped: out of the cache, nothing is written.
  const int at = PAGED ? cache.table[cache.page_of(pos)] : p.cache_batch_idx != nullptr ? p.cache_batch_idx[seq] : seq;
  if (at < 0 || at >= p.cache_rows) return;
  const int in_row = cache.pos_of(pos);
  const T* k_src = static_cast<const T*>(p.k_new) + seq * p.k_new_strides[0] + t * p.k_new_strides[1] + head * p.k_new_strides[2];
  const T* v_src = static_cast<const T*>(p.v_new) + seq * p.v_new_strides[0] + t * p.v_new_strides[1] + head * p.v_new_strides[2];
  T* k_dst = const_cast<T*>(static_cast<const T*>(p.k)) + at * p.k_strides[0] + in_row * p.k_strides[1] + head * p.k_strides[2];
  T* v_dst = const_cast<T*>(static_cast<const T*>(p.v)) + at * p.v_strides[0] + in_row * p.v_strides[1] + head * p.v_strides[2];
  for (int c = (threadIdx.x % 32) * 8; c < p.head_dim; c += 32 * 8) {
    *reinterpret_cast<uint4*>(k_dst + c) = *reinterpret_cast<const uint4*>(k_src + c);
    *reinterpret_cast<uint4*>(v_dst + c) = *reinterpret_cast<const uint4*>(v_src + c);
  }
}

}  // namespace cuattn
