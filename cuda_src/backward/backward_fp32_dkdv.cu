// Float32 attention backward, dK and dV, on the CUDA cores (fp32 products, fp64 dot products,
// no tf32): one CTA per 16 keys of a (KV head, sequence) streams the visible 32-query tiles of every
// query head of the group, so that GQA sums stay in registers (deterministic). Each warp owns 4
// keys; a lane takes one query of every tile, then dV row += sum_i P[i] dO[i] and
// dK row += sum_i dS[i] Q[i] with lanes over head-dim columns.
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
__global__ void __launch_bounds__(kF32BwdWarps * 32, 1) backward_fp32_dkdv_kernel(const __grid_constant__ BackwardParams p) {
  constexpr int kCols = HEAD_DIM / 32;
  constexpr int RS = HEAD_DIM + 1;
  extern __shared__ float smem_f32[];
  float* sQ = smem_f32;
  float* sdO = sQ + kF32BwdTile * RS;

  const AttnParams& a = p.attn;
  const GridCell cell = grid_cell<SPARSE>(a);
  const int kv_head = cell.y, batch = cta_batch(a);
  const int n0 = cell.x * kF32BwdBlock;
  const SeqSpan span = seq_span<LAYOUT>(a, batch);
  if (!grid_covers<LAYOUT, kF32BwdBlock>(span.seqlen_k) && cell.x == 0) mark_uncovered_key_grads<float>(p, batch, kv_head, span, int(gridDim.x) * kF32BwdBlock);
  if (!block_in_sequence<LAYOUT>(n0, span.seqlen_k)) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = a.heads_q / a.heads_kv;
  const float* k = head_rows<float>(a.k, a.k_strides, batch, kv_head, span.k_row0);
  const float* v = head_rows<float>(a.v, a.v_strides, batch, kv_head, span.k_row0);

  const KeyBand band(a, span);
  const int row_first = band.first_row(n0);
  const int row_last = band.last_row(min(n0 + kF32BwdBlock, span.seqlen_k) - 1, span.seqlen_q);
  double dk[kF32BwdRowsPerWarp][kCols], dv[kF32BwdRowsPerWarp][kCols];  // fp64 sums, as the forward's output
#pragma unroll
  for (int r = 0; r < kF32BwdRowsPerWarp; ++r)
#pragma unroll
    for (int c = 0; c < kCols; ++c) dk[r][c] = dv[r][c] = 0.0;
  const float sc = a.exp2_scale;

  for (int h = 0; h < group; ++h) {
    const int head = kv_head * group + h;
    const float* q = head_rows<float>(a.q, a.q_strides, batch, head, span.q_row0);
    const float* dout = head_rows<float>(p.dout, p.dout_strides, batch, head, span.q_row0);
    const RowStats stats(p, batch, head, span);
    const float* lse = stats.lse;
    const float* delta = stats.delta;
    const DropoutDraws draws(a, batch, head);
    const int m_first = row_first / kF32BwdTile, m_last = row_last < row_first ? m_first - 1 : row_last / kF32BwdTile;
    const auto tiles = ascending_tiles<SPARSE, kF32BwdTile>([&] { return kept_query_blocks(a, batch, head, n0 / kSparseBlock); }, m_first, m_last);
    for (int i = 0; i < tiles.count; ++i) {  // first query first
      const int m0 = tiles.tile(i) * kF32BwdTile;
      __syncthreads();  // previous tiles fully consumed
      load_f32_tile<HEAD_DIM>(sQ, q, a.q_strides[1], m0, span.seqlen_q, a.head_dim);
      load_f32_tile<HEAD_DIM>(sdO, dout, p.dout_strides[1], m0, span.seqlen_q, a.head_dim);
      __syncthreads();
      const int row = m0 + lane;  // this lane's query
      const double shift = lse_to_exp2_shift_f64(row < span.seqlen_q ? lse[row] : neg_inf());
      const float row_delta = row < span.seqlen_q ? delta[row] : 0.f;
#pragma unroll
      for (int r = 0; r < kF32BwdRowsPerWarp; ++r) {
        const int key = n0 + warp * kF32BwdRowsPerWarp + r;
        if (key >= span.seqlen_k) continue;  // warp-uniform
        double s = dot_f64(sQ + lane * RS, k + key * a.k_strides[1], a.head_dim);
        float cap_grad = 1.f;
        if (SOFTCAP) s = softcap_score(float(s), a.scale, a.softcap, cap_grad);
        const float prob = band.visible(row, key) ? exp2_minus_shift(s, sc, shift) : 0.f;
        float dp = float(dot_f64(sdO + lane * RS, v + key * a.v_strides[1], a.head_dim));
        float kept_prob = prob;  // dV takes the kept probabilities, dS the kept dP
        if (DROPOUT) {
          const bool keep = draws.keeps(row, key);
          kept_prob = keep ? prob : 0.f;
          dp = keep ? dp * a.dropout_scale : 0.f;
        }
        const float ds = prob * (dp - row_delta) * cap_grad;
        for (int i = 0; i < kF32BwdTile; ++i) {
          const float p_i = __shfl_sync(0xffffffff, kept_prob, i), ds_i = __shfl_sync(0xffffffff, ds, i);
#pragma unroll
          for (int c = 0; c < kCols; ++c) {
            dv[r][c] = fma(double(p_i), double(sdO[i * RS + lane + 32 * c]), dv[r][c]);
            dk[r][c] = fma(double(ds_i), double(sQ[i * RS + lane + 32 * c]), dk[r][c]);
          }
        }
      }
    }
  }

  float* dk_out = head_rows<float>(p.dk, p.dk_strides, batch, kv_head, span.k_row0);
  float* dv_out = head_rows<float>(p.dv, p.dv_strides, batch, kv_head, span.k_row0);
#pragma unroll
  for (int r = 0; r < kF32BwdRowsPerWarp; ++r) {
    const int key = n0 + warp * kF32BwdRowsPerWarp + r;
    if (key >= span.seqlen_k) continue;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      if (col < a.head_dim) {
        const float dk_value = float(dk[r][c] * a.scale), dv_value = float(dv[r][c] * (DROPOUT ? a.dropout_scale : 1.f));
        float& dk_slot = dk_out[key * p.dk_strides[1] + col];
        float& dv_slot = dv_out[key * p.dv_strides[1] + col];
        const bool sum = p.sum_grads & kSumDkDv;  // added into the fp32 sums
        dk_slot = sum ? dk_slot + dk_value : dk_value;
        dv_slot = sum ? dv_slot + dv_value : dv_value;
      }
    }
  }
}

}  // namespace cuattn
