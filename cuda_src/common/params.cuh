// Kernel parameter structs, passed by value as `const __grid_constant__`. Strides are in
// elements. Plain C++ (no device code): cuattn/params.py mirrors each struct field for field and
// CI checks every offset with the host compiler (tests/test_compile.py); edit both together.
#pragma once
#include "int_types.cuh"

namespace cuattn {

constexpr int kMaxMergePartials = 16;

// Merge of N partial attention results over disjoint key sets.
struct MergeParams {
  const void* outs[kMaxMergePartials];      // each (batch, seqlen, heads, head_dim)
  const float* lses[kMaxMergePartials];     // each (batch, heads, seqlen)
  i64 out_strides[kMaxMergePartials][3];    // batch, row, head
  i64 lse_strides[kMaxMergePartials][3];    // batch, head, row
  void* dst_out;                            // may alias outs[0] (in-place merge_)
  float* dst_lse;                           // may alias lses[0]
  i64 dst_out_strides[3];
  i64 dst_lse_strides[3];
  int num_partials;
  int batch;
  int seqlen;
  int heads;
  int head_dim;
};

// A sum of partial gradients in fp32 (merge/sum_partials.cu): sum <- (fresh ? 0 : sum) + piece,
// or, when out is set, out <- sum + piece rounded to the output type (sum is not written). A
// null piece adds nothing. Each array is `outer` runs of `inner` contiguous elements, run i at
// i * its stride (a slice of rows of a contiguous (batch, seqlen, heads, head_dim) array);
// inner and the strides multiples of 8, addresses 16-byte aligned.
struct SumParams {
  const void* piece;
  float* sum;
  void* out;
  i64 outer;
  i64 inner;
  i64 piece_stride;
  i64 sum_stride;
  i64 out_stride;
  i64 out_row_stride;  // out's rows of row_elems elements each (its heads contiguous) may lie apart
  i64 row_elems;
  int fresh;
};

// Attention over (batch, seqlen, heads, head_dim) tensors. Query row i sees key j when
// i + diagonal_offset - window_left <= j <= i + diagonal_offset + window_right, a bound of -1
// meaning unbounded on that side; causal is window_right = 0. diagonal_offset is
// seqlen_k - seqlen_q for bottom-right alignment and 0 for top-left.
struct AttnParams {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;                               // (batch, heads_q, seqlen_q), row stride 1
  const float* sink;                        // null, or (heads_q,) logits in every row's softmax denominator, no value
  i64 q_strides[3];                         // batch, row, head
  i64 k_strides[3];
  i64 v_strides[3];
  i64 out_strides[3];
  i64 lse_strides[2];                       // batch, head
  int batch;
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  int head_dim;
  int window_left;
  int window_right;
  int diagonal_offset;
  float scale;                              // applied to q.k before softcap
  float softcap;                            // 0: none; else softcap * tanh(s / softcap)
  float exp2_scale;                         // log2(e) * (softcap ? 1 : scale), for exp2f
  int batch_offset;                         // batch index of blockIdx.z == 0 (common/grid.cuh)
  // Packed sequences (common/seq_layout.cuh; unused by dense kernels): sequence b holds rows
  // cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1 of q (likewise k), of total_q (total_k) rows.
  const int* cu_seqlens_q;
  const int* cu_seqlens_k;
  int total_q;
  int total_k;
  int bottom_right;                         // per-sequence diagonal: seqlen_k - seqlen_q (1) or 0 (0)
  // KV cache (SeqLayout::kCache / kPagedCache: chunked prefill of attention_with_kvcache; unused
  // otherwise), as in DecodeParams: sequence b's keys are the first cache_seqlens[b] + seqlen_new
  // positions (clamped to capacity) of its cache row, or of its pages through the block table.
  const int* cache_seqlens;
  const int* block_table;
  const int* cache_batch_idx;
  i64 block_table_stride;
  int capacity;
  int cache_rows;
  int page_size;
  int seqlen_new;
  // Partial results folded into an fp32 accumulator (forward kernels, dense layout; schedules
  // that visit a row's keys in pieces: cuattn/chunked.py). Null: out and lse are written as
  // usual. Set: the kernel merges its partial (out, lse) into (accum, lse) by the exact LSE rule
  // (forward/accumulate.cuh), reading lse unless accum_fresh. When out is not null (the last
  // piece) it writes the merged result there in its dtype instead of into accum (lse still),
  // so that it is rounded once.
  float* accum;                             // (batch, seqlen_q, heads_q, head_dim) fp32
  i64 accum_strides[3];                     // batch, row, head
  int accum_fresh;                          // 1: the accumulator holds nothing yet
  // Dropout on the probabilities (common/dropout.cuh; kernels compiled with it): an element is
  // kept when its 8-bit draw >= dropout_threshold, and scaled by dropout_scale.
  const u64* dropout_seed_ptr;              // null: dropout_seed; else the seed, read on the device
  u64 dropout_seed;
  u32 dropout_threshold;                    // 0..255, compared with 8-bit draws
  float dropout_scale;                      // 256 / (256 - dropout_threshold)
  // Block-sparse attention (common/block_sparse.cuh; kernels compiled with it): the kept blocks
  // of kSparseBlock queries x kSparseBlock keys, listed both ways, ascending, the first count
  // entries of each row valid.
  const int* kv_block_counts;               // (mask batch, mask heads, query blocks)
  const int* kv_block_indices;              // (mask batch, mask heads, query blocks, key blocks)
  const int* q_block_counts;                // (mask batch, mask heads, key blocks)
  const int* q_block_indices;               // (mask batch, mask heads, key blocks, query blocks)
  i64 kv_block_strides[2];                  // batch, head, in rows of kv_block_counts (0: shared)
  i64 q_block_strides[2];                   // batch, head, in rows of q_block_counts (0: shared)
  // The order of a block-sparse launch's CTAs (sparse/block_schedule.cu; set per launch): null,
  // or per sequence the grid cell (y * gridDim.x + x) whose work the CTA numbered
  // blockIdx.y * gridDim.x + blockIdx.x does, the cells of the heaviest mask rows first.
  const int* block_schedule;
  i64 block_schedule_stride;                // per sequence, in cells (0: one order for every sequence)
};

// Backward of AttnParams' attention: dout, gradients, and delta = rowsum(dout * out) - dlse per
// query row, which backward_prep writes and the gradient kernels read.
struct BackwardParams {
  AttnParams attn;                          // q, k, v, out, lse, shapes, mask, scales
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* delta;                             // like lse: delta_strides, row stride 1
  float* dq_accum;                          // null, or unscaled fp32 dQ summed by atomics (backward_wgmma_fused)
                                            // in 64 x 64 tiles: backward/dq_accum.cuh
  const float* dlse;                        // null: no gradient flows into lse
  float* dsink;                             // (heads_q,) when attn.sink is set (backward/sink_grad.cu)
  i64 dout_strides[3];                      // batch, row, head
  i64 dq_strides[3];
  i64 dk_strides[3];
  i64 dv_strides[3];
  i64 dlse_strides[2];                      // batch, head; row stride 1
  i64 delta_strides[2];                     // batch, head; row stride 1
  i64 dq_accum_tile_strides[2];             // batch, head, in row blocks (backward/dq_accum.cuh)
  int dq_accum_cols;                        // the head-dim bucket of the dQ accumulator
  int sum_grads;                            // bits: 1 dq, 2 dk and dv are fp32 sums the kernels add into (dense
                                            //   layout; schedules over pieces of keys: cuattn/chunked.py, cuattn/dist/ring.py)
  int query_splits;                         // CTAs per key block of the dK / dV kernels, each streaming a part of its
                                            //   query steps (head_rows.cuh QuerySteps); above 1 (dense, 16-bit types)
                                            //   each part adds into its own fp32 sums, split_stride elements apart
  i64 split_stride;
};

// The order of a block-sparse launch (sparse/block_schedule.cu): the cells y * tiles + x of a
// grid of tiles x ys CTAs, the heaviest first. Cell (x, y) does mask row (x, or tiles - 1 - x
// when reversed) * tile_rows / kSparseBlock of mask heads (y / y_per_head) * group .. + group - 1;
// its weight is the sum of their counts.
struct BlockScheduleParams {
  const int* counts;                        // (mask batch, mask heads, mask rows) kept blocks per row
  int* schedule;                            // (entries, ys * tiles) grid cells, AttnParams::block_schedule
  i64 count_strides[2];                     // batch, head, in mask rows (0: shared)
  int entries;                              // orders written: the batch, or 1 when the mask is shared
  int ys;                                   // gridDim.y of the launch ordered
  int y_per_head;                           // grid rows per head (dK / dV column splits)
  int group;                                // mask heads summed per head (GQA group for dK / dV, else 1)
  int tiles;                                // gridDim.x of the launch ordered
  int tile_rows;                            // rows of a tile (a divisor of kSparseBlock)
  int mask_rows;                            // mask rows (blocks) along the tiles
  int reversed;                             // 1: tile x is row block tiles - 1 - x (heaviest-first grids)
};

// Decoding against a KV cache (decode/decode.cu): the new query rows of each sequence attend
// to the first cache_seqlens[b] + seqlen_new keys of its cache (the appended rows included),
// bottom-right aligned. The cache is contiguous
// (batch_cache, capacity, heads_kv, head_dim), sequence b in row cache_batch_idx[b] (or b), or
// paged (num_pages, page_size, heads_kv, head_dim) through block_table (batch, max_pages):
// common/seq_layout.cuh CacheRows. Device-side lengths, pages and batch rows are clamped for
// reads; appends skip positions past the capacity, pages outside the cache and batch rows
// outside it.
struct DecodeParams {
  const void* q;                            // (batch, seqlen_q, heads_q, head_dim)
  const void* k;
  const void* v;
  void* out;                                // like q
  float* lse;                               // (batch, heads_q, seqlen_q), row stride 1; may be null
  const float* sink;                        // null, or (heads_q,) as AttnParams::sink (joined by the last step)
  float* partial_out;                       // (splits, batch, seqlen_q, heads_q, head_dim) fp32, contiguous
  float* partial_lse;                       // (splits, batch, heads_q, seqlen_q), contiguous
  const int* cache_seqlens;                 // (batch,)
  const int* block_table;                   // null: contiguous cache
  const int* cache_batch_idx;               // null: sequence b uses cache row b
  const void* k_new;                        // (batch, seqlen_new, heads_kv, head_dim) appended first
  const void* v_new;                        //   at positions cache_seqlens[b] + t (decode/append_kv.cu)
  i64 q_strides[3];                         // batch, row, head
  i64 k_strides[3];                         // cache row (or page), position (in page), head
  i64 v_strides[3];
  i64 out_strides[3];
  i64 lse_strides[2];                       // batch, head
  i64 k_new_strides[3];                     // batch, row, head
  i64 v_new_strides[3];
  i64 block_table_stride;                   // between sequences' rows of block_table
  int batch;
  int seqlen_q;
  int seqlen_new;                           // rows of k_new / v_new (0: nothing appended)
  int heads_q;
  int heads_kv;
  int head_dim;
  int capacity;                             // keys a sequence's cache holds: max_seqlen or max_pages * page_size
  int cache_rows;                           // batch_cache (contiguous) or num_pages (paged)
  int page_size;                            // 1 for a contiguous cache
  int num_splits;                           // CTAs per (row block, KV head, sequence) on x
  int window_left;                          // -1: unbounded
  int window_right;                         // -1: unbounded; causal is 0
  int prefetch_blocks;                      // key blocks a CTA pulls into L2 before its wait (decode.cu)
  float scale;
  float softcap;                            // 0: none
  float exp2_scale;
};

// A CUtensorMap: the TMA unit's descriptor of a tensor and of the box one load copies, encoded
// by the driver on the host (cuattn/tensor_map.py); opaque here.
struct alignas(64) TensorMap {
  u64 words[16];
};

// The Hopper TMA forward (forward/forward_tma.cu): the attention parameters and the tensor maps of
// q, k and v, each 4-D (head_dim, seqlen, heads, batch) with a box of 64 columns.
struct TmaAttnParams {
  AttnParams attn;
  TensorMap q_map;
  TensorMap k_map;
  TensorMap v_map;
};

// The TMA backward's parameters (backward/backward_tma.cu): the maps of q, k, v and dout.
struct TmaBackwardParams {
  BackwardParams bwd;
  TensorMap q_map;
  TensorMap k_map;
  TensorMap v_map;
  TensorMap dout_map;
};

// The packed-sequence offsets of a varlen call, checked on the device (packed/check_offsets.cu):
// the first bad entry is reported into a word of pinned host memory.
struct OffsetCheckParams {
  const int* cu_seqlens[2];                 // query, key offsets: (batch + 1,)
  u64* report;                              // 0, or (code << 32) | entry of the first bad entry
  int batch;
  int totals[2];                            // the last entry each must have
  int bounds[2];                            // the longest sequence each grid covers (max_seqlen_*)
};

}  // namespace cuattn
