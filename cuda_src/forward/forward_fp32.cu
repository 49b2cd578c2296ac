// Float32 attention forward on the CUDA cores: fp32 products and sums throughout (no tf32).
// The slower exact path for float32 inputs.
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "common/dropout.cuh"
#include "common/dtypes.cuh"
#include "common/fp64_exponent.cuh"
#include "common/head_view.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "forward/accumulate.cuh"

namespace cuattn {

constexpr int kF32RowsPerWarp = 4;
constexpr int kF32Warps = 4;
constexpr int kF32BlockM = kF32RowsPerWarp * kF32Warps;
constexpr int kF32BlockN = 32;

/// \brief fp32 attention forward for 16 query rows of one (sequence, head); each warp owns 4
/// rows, a lane scores one key of each 32-key tile and owns head-dim columns lane, lane + 32,
/// ... of the output. K tiles go through shared memory; Q (read by all lanes of a warp at once)
/// and V (read across lanes, contiguous) come through L1.
template <int HEAD_DIM, bool SOFTCAP, bool DROPOUT, bool SPARSE>
__device__ __forceinline__ void forward_fp32_block(const AttnParams& p, int seq, int head, const SeqSpan& span, const HeadView<float>& head_view, int m_block,
                                                   float (&sK)[kF32BlockN][HEAD_DIM + 1]) {
  constexpr int kCols = HEAD_DIM / 32;
  const int m0 = m_block * kF32BlockM;
  const int m_last = min(m0 + kF32BlockM, span.seqlen_q) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const auto [q, k, v, out, lse, sink, accum] = head_view;

  const KeyBand band(p, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  static_assert(kSparseBlock % kF32BlockM == 0, "query tiles nest in mask blocks");
  const auto tiles = ascending_tiles<SPARSE, kF32BlockN>([&] { return kept_key_blocks(p, seq, head, m0 / kSparseBlock); },
                                                        key_first / kF32BlockN,
                                                        key_last < key_first ? key_first / kF32BlockN - 1 : key_last / kF32BlockN);
  // The output and the denominator accumulate in fp64: over tens of thousands of keys an fp32
  // running sum loses more than the inputs' precision.
  double acc[kF32RowsPerWarp][kCols], row_sum[kF32RowsPerWarp];
  float row_max[kF32RowsPerWarp];
#pragma unroll
  for (int r = 0; r < kF32RowsPerWarp; ++r) {
    row_max[r] = neg_inf();
    row_sum[r] = 0.0;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.0;
  }
  const float sc = p.exp2_scale;
  const DropoutDraws draws(p, seq, head);  // used with DROPOUT only

  for (int i = 0; i < tiles.count; ++i) {  // first key first
    const int n0 = tiles.tile(i) * kF32BlockN;
    __syncthreads();  // previous tile fully consumed
    for (int i = threadIdx.x; i < kF32BlockN * HEAD_DIM; i += blockDim.x) {
      const int r = i / HEAD_DIM, c = i % HEAD_DIM;
      sK[r][c] = (n0 + r < span.seqlen_k && c < p.head_dim) ? k[(n0 + r) * p.k_strides[1] + c] : 0.f;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kF32RowsPerWarp; ++r) {
      const int row = m0 + warp * kF32RowsPerWarp + r;
      const float* q_row = q + min(row, span.seqlen_q - 1) * p.q_strides[1];
      // The dot product accumulates in fp64: an fp32 running sum of large scores (|q.k| in the
      // hundreds) errs enough to move the softmax beyond the naive fp32 (blocked GEMM) result.
      double dot = 0.0;
#pragma unroll 8
      for (int c = 0; c < p.head_dim; ++c) dot = fma(double(q_row[c]), double(sK[lane][c]), dot);
      float s = float(dot);
      if (SOFTCAP) {
        s = p.softcap * tanhf(s * (p.scale / p.softcap));
        dot = s;
      }
      const bool visible = band.visible(row, n0 + lane);
      if (!visible) s = neg_inf();
      float mx = s;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
      mx = fmaxf(mx, row_max[r]);
      const float shift = exp2_shift(mx, sc);
      const double alpha = row_max[r] == neg_inf() ? 0.0 : exp2(double(exp2_shift(row_max[r], sc)) - double(shift));
      row_max[r] = mx;
      const float prob = visible ? exp2_minus_shift(dot, sc, shift) : 0.f;
      float sum = prob;
#pragma unroll
      for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
      row_sum[r] = row_sum[r] * alpha + double(sum);
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= alpha;
      const float kept_prob = DROPOUT && !draws.keeps(row, n0 + lane) ? 0.f : prob;  // the sums keep prob
      for (int j = 0; j < kF32BlockN && n0 + j < span.seqlen_k; ++j) {
        const float pj = __shfl_sync(0xffffffff, kept_prob, j);
        const float* v_row = v + (n0 + j) * p.v_strides[1];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          if (lane + 32 * c < p.head_dim) acc[r][c] = fma(double(pj), double(v_row[lane + 32 * c]), acc[r][c]);
        }
      }
    }
  }

  const bool folds = accum != nullptr;  // forward/accumulate.cuh
#pragma unroll
  for (int r = 0; r < kF32RowsPerWarp; ++r) {
    const int row = m0 + warp * kF32RowsPerWarp + r;
    if (row >= span.seqlen_q) continue;
    RowTotalF64 total = normalize_row_f64(exp2_shift(row_max[r], sc), row_sum[r], sink);
    if (DROPOUT) total.inv *= p.dropout_scale;  // kept probabilities, scaled up
    Fold fold = {0.f, 1.f, total.lse};
    if (folds)  // the same for the whole CTA; lane 0 reads and writes lse
      fold = fold_weights(__shfl_sync(0xffffffff, accumulated_lse(p, lse + row, lane == 0), 0), total.lse);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int col = lane + 32 * c;
      if (col >= p.head_dim) continue;
      float o = float(acc[r][c] * total.inv) * fold.take;
      if (folds) {
        float* slot = accum + row * p.accum_strides[1] + col;
        if (fold.keep > 0.f) o = fmaf(fold.keep, *slot, o);
        if (p.out == nullptr) *slot = o;  // the last piece writes out alone
      }
      if (p.out != nullptr) out[row * p.out_strides[1] + col] = o;
    }
    if (lane == 0 && lse != nullptr) lse[row] = fold.lse;
  }
}

/// \brief fp32 attention forward: one CTA per (16 query rows, head, sequence)
/// (common/grid.cuh, common/seq_layout.cuh).
template <int HEAD_DIM, bool SOFTCAP, SeqLayout LAYOUT, bool DROPOUT = false, bool SPARSE = false>
__global__ void __launch_bounds__(kF32Warps * 32, 1) forward_fp32_kernel(const __grid_constant__ AttnParams p) {
  __shared__ float sK[kF32BlockN][HEAD_DIM + 1];  // +1: lanes reading different keys hit different banks
  const GridCell cell = grid_cell<SPARSE>(p);
  const int head = cell.y, seq = cta_batch(p);
  const SeqSpan span = seq_span<LAYOUT>(p, seq);
  const HeadView<float> head_view(p, seq, head, span);
  const bool covered = for_each_row_block<LAYOUT, kF32BlockM>(cell.x, span.seqlen_q, [&](int m_block) {
    forward_fp32_block<HEAD_DIM, SOFTCAP, DROPOUT, SPARSE>(p, seq, head, span, head_view, m_block, sK);
  });
  if (!covered && cell.x == 0)
    mark_uncovered_rows<float>(head_view.out, p.out_strides[1], head_view.lse, p.head_dim, int(gridDim.x) * kF32BlockM, span.seqlen_q);
}

}  // namespace cuattn
