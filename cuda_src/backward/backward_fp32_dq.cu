// Float32 attention backward, dQ, on the CUDA cores (fp32 products, fp64 dot products, no tf32):
// one CTA per 16 query rows of a (head, sequence); each warp owns 4 rows and a lane scores one key
// of every 32-key tile, then dQ row r += sum_j dS[r, j] K[j] with lanes over head-dim columns.
#include "common/dropout.cuh"
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "backward/fp32_tiles.cuh"
#include "backward/head_rows.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"

namespace cuattn {

// DROPOUT: dropout on the probabilities (common/dropout.cuh), one draw per element. SPARSE:
// only the blocks of a block mask (common/block_sparse.cuh; dense layout).
template <int HEAD_DIM, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT = false, bool SPARSE = false>
__global__ void __launch_bounds__(kF32BwdWarps * 32, 1) backward_fp32_dq_kernel(const __grid_constant__ BackwardParams p) {
  constexpr int kCols = HEAD_DIM / 32;
  constexpr int RS = HEAD_DIM + 1;
  extern __shared__ float smem_f32[];
  float* sK = smem_f32;
  float* sV = sK + kF32BwdTile * RS;

  const AttnParams& a = p.attn;
  const GridCell cell = grid_cell<SPARSE>(a);
  const int head = cell.y, batch = cta_batch(a);
  const int m0 = cell.x * kF32BwdBlock;
  const SeqSpan span = seq_span<LAYOUT>(a, batch);
  if (!grid_covers<LAYOUT, kF32BwdBlock>(span.seqlen_q) && cell.x == 0)
    mark_uncovered_rows<float>(head_rows<float>(p.dq, p.dq_strides, batch, head, span.q_row0), p.dq_strides[1], nullptr, a.head_dim, int(gridDim.x) * kF32BwdBlock, span.seqlen_q);
  if (!block_in_sequence<LAYOUT>(m0, span.seqlen_q)) return;
  const int m_last = min(m0 + kF32BwdBlock, span.seqlen_q) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int kv_head = head / (a.heads_q / a.heads_kv);
  const float* q = head_rows<float>(a.q, a.q_strides, batch, head, span.q_row0);
  const float* dout = head_rows<float>(p.dout, p.dout_strides, batch, head, span.q_row0);
  const float* k = head_rows<float>(a.k, a.k_strides, batch, kv_head, span.k_row0);
  const float* v = head_rows<float>(a.v, a.v_strides, batch, kv_head, span.k_row0);
  const RowStats stats(p, batch, head, span);
  const float* lse = stats.lse;
  const float* delta = stats.delta;

  const KeyBand band(a, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  double dq[kF32BwdRowsPerWarp][kCols];  // fp64 sums, as the forward's output
  float row_delta[kF32BwdRowsPerWarp];
  double shift[kF32BwdRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kF32BwdRowsPerWarp; ++r) {
    const int row = m0 + warp * kF32BwdRowsPerWarp + r;
    shift[r] = lse_to_exp2_shift_f64(row < span.seqlen_q ? lse[row] : neg_inf());
    row_delta[r] = row < span.seqlen_q ? delta[row] : 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) dq[r][c] = 0.0;
  }
  const float sc = a.exp2_scale;
  const DropoutDraws draws(a, batch, head);  // used with DROPOUT only

  static_assert(kSparseBlock % kF32BwdBlock == 0, "query tiles nest in mask blocks");
  const auto tiles = ascending_tiles<SPARSE, kF32BwdTile>([&] { return kept_key_blocks(a, batch, head, m0 / kSparseBlock); },
                                                         key_first / kF32BwdTile,
                                                         key_last < key_first ? key_first / kF32BwdTile - 1 : key_last / kF32BwdTile);
  for (int i = 0; i < tiles.count; ++i) {  // first key first
    const int n0 = tiles.tile(i) * kF32BwdTile;
    __syncthreads();  // previous tiles fully consumed
    load_f32_tile<HEAD_DIM>(sK, k, a.k_strides[1], n0, span.seqlen_k, a.head_dim);
    load_f32_tile<HEAD_DIM>(sV, v, a.v_strides[1], n0, span.seqlen_k, a.head_dim);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kF32BwdRowsPerWarp; ++r) {
      const int row = m0 + warp * kF32BwdRowsPerWarp + r;
      if (row >= span.seqlen_q) continue;  // warp-uniform
      double s = dot_f64(q + row * a.q_strides[1], sK + lane * RS, a.head_dim);
      float cap_grad = 1.f;
      if (SOFTCAP) s = softcap_score(float(s), a.scale, a.softcap, cap_grad);
      const float prob = band.visible(row, n0 + lane) ? exp2_minus_shift(s, sc, shift[r]) : 0.f;
      float dp = float(dot_f64(dout + row * p.dout_strides[1], sV + lane * RS, a.head_dim));
      if (DROPOUT) dp = draws.keeps(row, n0 + lane) ? dp * a.dropout_scale : 0.f;
      const float ds = prob * (dp - row_delta[r]) * cap_grad;
      for (int j = 0; j < kF32BwdTile; ++j) {
        const float ds_j = __shfl_sync(0xffffffff, ds, j);
#pragma unroll
        for (int c = 0; c < kCols; ++c) dq[r][c] = fma(double(ds_j), double(sK[j * RS + lane + 32 * c]), dq[r][c]);
      }
    }
  }

  float* dq_out = head_rows<float>(p.dq, p.dq_strides, batch, head, span.q_row0);
#pragma unroll
  for (int r = 0; r < kF32BwdRowsPerWarp; ++r) {
    const int row = m0 + warp * kF32BwdRowsPerWarp + r;
    if (row >= span.seqlen_q) continue;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      if (lane + 32 * c >= a.head_dim) continue;
      float& slot = dq_out[row * p.dq_strides[1] + lane + 32 * c];
      slot = (p.sum_grads & kSumDq) ? slot + float(dq[r][c] * a.scale) : float(dq[r][c] * a.scale);  // added into the fp32 sum
    }
  }
}

}  // namespace cuattn
