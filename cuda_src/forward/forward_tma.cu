// Attention forward for Hopper (sm_90a) with a producer warpgroup: the tiles come in by TMA, so
// the warpgroups that compute never copy, compute addresses or, after the mbarriers' set-up,
// meet at a CTA barrier.
//
// A CTA has 64 query rows per consumer warpgroup (CONSUMERS: 2 or 3) and one producer warpgroup:
// - the consumer warpgroups run forward_wgmma.cu's loop: at key block j a warpgroup issues
//   S_j = Q K_j^T and O += P_{j-1} V_{j-1}, waits for S_j only, and runs the softmax of block j
//   while the P V product is still on the tensor cores;
// - the last warpgroup, the producer, gives its registers to the others (setmaxnreg); one of
//   its threads loads Q once, then K and V of each key block into rings of STAGES slots
//   (K_{j+1} before V_j, the order the consumers need them), one TMA box per 64 columns.
// Who waits on what (mbarriers, common/tma.cuh): slot s of the K ring has a "full" barrier (the
// producer announces the tile's bytes, the TMA unit counts them in) that consumers wait on
// before S_j, and an "empty" barrier every consumer thread arrives at once S_j has completed,
// which the producer waits on before it reloads the slot; the V ring likewise with P V. Q has a
// full barrier of its own. Consumers wait for a slot's k-th fill (k from 0) on parity k & 1;
// before that fill the producer waits on parity (k & 1) ^ 1, the slot's previous release, which
// for k = 0 a freshly initialized barrier counts as complete (no wait on the first pass).
// The consumer warpgroups issue their products in turn (named barriers kBarTurn + wg): warpgroup
// 0's products, then warpgroup 1's, ..., then warpgroup 0's next, so that one warpgroup's
// softmax runs while the tensor cores work on another's products.
// Rows and keys past the tensors are zero-filled by the TMA unit; the band mask (KeyBand) hides
// keys past seqlen_k. Dense layout only (the cache, packed, fold and dropout forms stay on
// forward_wgmma.cu). SPARSE: only the key blocks a block mask keeps (common/block_sparse.cuh),
// in the order both sides walk them; CTAs take their cells from the launch's schedule.
#include "common/block_sparse.cuh"
#include "common/grid.cuh"
#include "common/head_view.cuh"
#include "common/mask.cuh"
#include "common/named_barrier.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "forward/online_softmax.cuh"
#include "forward/staged_out.cuh"
#include "forward/values_step.cuh"

namespace cuattn {

template <int HEAD_DIM, int BLOCK_N, int STAGES, int CONSUMERS>
struct TmaForwardTraits {
  static constexpr int kBlockM = 64 * CONSUMERS;            // 64 query rows per consumer warpgroup
  static constexpr int kConsumerThreads = 128 * CONSUMERS;
  static constexpr int kThreads = kConsumerThreads + 128;   // + the producer warpgroup (one thread issues)
  // setmaxnreg: 128 x producer + kConsumerThreads x consumer registers <= 65536
  static constexpr int kProducerRegisters = CONSUMERS == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters = CONSUMERS == 2 ? 240 : 160;
  static constexpr int kNTiles = BLOCK_N / 8;
  static constexpr int kDTiles = HEAD_DIM / 8;
  static constexpr int kColumnBlocks = HEAD_DIM / kSwizzleBlockElems;  // TMA boxes per tile
  static constexpr int kQBytes = kBlockM * HEAD_DIM * 2;
  static constexpr int kKVBytes = BLOCK_N * HEAD_DIM * 2;
  static constexpr int kBarriers = 1 + 4 * STAGES;          // Q full; K full, V full, K empty, V empty per slot
  // +1024: the dynamic shared memory is realigned to the swizzle period inside the kernel.
  static constexpr int kSmemBytes = kQBytes + 2 * STAGES * kKVBytes + kSwizzleAtomBytes + kBarriers * 8;

  static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "whole column blocks (wgmma N of P V: common/wgmma.cuh)");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "wgmma N of Q K^T");
  static_assert(CONSUMERS == 2 || CONSUMERS == 3, "the register split above");
};

constexpr int kBarTurn = 4;  // + warpgroup: its turn to issue (1 + wg: the epilogue's)

template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, int CONSUMERS, bool SOFTCAP, bool SPARSE>
__device__ __forceinline__ void forward_tma_block(const TmaAttnParams& tp, int seq, int head, const SeqSpan& span, int m_block,
                                                  unsigned char* smem_raw) {
  using Tr = TmaForwardTraits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS>;
  const AttnParams& p = tp.attn;
  unsigned char* sQ = smem_raw + (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
  unsigned char* sK_ring = sQ + Tr::kQBytes;
  unsigned char* sV_ring = sK_ring + STAGES * Tr::kKVBytes;
  u64* q_full = reinterpret_cast<u64*>(sV_ring + STAGES * Tr::kKVBytes);
  u64* k_full = q_full + 1;
  u64* v_full = k_full + STAGES;
  u64* k_empty = v_full + STAGES;
  u64* v_empty = k_empty + STAGES;

  const int m0 = m_block * Tr::kBlockM;
  const int m_last = min(m0 + Tr::kBlockM, span.seqlen_q) - 1;
  const KeyBand band(p, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  const int n_first = key_first / BLOCK_N;
  const int n_last = key_last < key_first ? n_first - 1 : key_last / BLOCK_N;
  // The key blocks visited, block_at(0) .. block_at(blocks - 1): n_last, n_last - 1, ... (the
  // diagonal first), or the mask's kept ones among them, likewise last first.
  const KeyTiles<SPARSE, BLOCK_N> tiles(p, seq, head, m0, n_first, n_last);
  int blocks;
  if constexpr (SPARSE) {
    blocks = tiles.count;
  } else {
    blocks = n_last - n_first + 1;
  }
  const auto block_at = [&](int j) {
    if constexpr (SPARSE) {
      return tiles.tile(j);
    } else {
      return n_last - j;
    }
  };

  if (threadIdx.x == 0) {
    mbarrier_init(q_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(k_full + s, 1);
      mbarrier_init(v_full + s, 1);
      mbarrier_init(k_empty + s, Tr::kConsumerThreads);
      mbarrier_init(v_empty + s, Tr::kConsumerThreads);
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  if (threadIdx.x >= Tr::kConsumerThreads) {  // the producer warpgroup; one thread issues every load
    set_max_registers_dec<Tr::kProducerRegisters>();
    if (threadIdx.x == Tr::kConsumerThreads && blocks > 0) {
      const int kv_head = head / (p.heads_q / p.heads_kv);
      const auto load_tile = [&](unsigned char* dst, const TensorMap* map, u64* bar, int rows, int row0, int h) {
#pragma unroll
        for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
          tma_load_4d(dst + cb * rows * kSwizzleRowBytes, map, bar, cb * kSwizzleBlockElems, row0, h, span.k_batch);
      };
      mbarrier_arrive_expect_bytes(q_full, Tr::kQBytes);
#pragma unroll
      for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
        tma_load_4d(sQ + cb * Tr::kBlockM * kSwizzleRowBytes, &tp.q_map, q_full, cb * kSwizzleBlockElems, m0, head, seq);
      const auto load_v = [&](int j) {
        const int s = j % STAGES;
        mbarrier_wait(v_empty + s, ((j / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_bytes(v_full + s, Tr::kKVBytes);
        load_tile(sV_ring + s * Tr::kKVBytes, &tp.v_map, v_full + s, BLOCK_N, block_at(j) * BLOCK_N, kv_head);
      };
      for (int j = 0; j < blocks; ++j) {
        const int s = j % STAGES;
        mbarrier_wait(k_empty + s, ((j / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_bytes(k_full + s, Tr::kKVBytes);
        load_tile(sK_ring + s * Tr::kKVBytes, &tp.k_map, k_full + s, BLOCK_N, block_at(j) * BLOCK_N, kv_head);
        if (j > 0) load_v(j - 1);
      }
      load_v(blocks - 1);
    }
    return;  // no CTA barrier follows
  }

  set_max_registers_inc<Tr::kConsumerRegisters>();
  const HeadView<T> head_view(p, seq, head, span);
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_first_row = m0 + wg * 64 + warp * 16;
  const int warp_last_row = min(warp_first_row + 16, span.seqlen_q) - 1;

  float acc[1][Tr::kDTiles][4] = {};
  float row_max[1][2] = {{neg_inf(), neg_inf()}}, row_sum[1][2] = {{0.f, 0.f}};

  if (blocks > 0) {
    float s[1][Tr::kNTiles][4];
    u32 probs[BLOCK_N / 16][4];  // P of the block before, packed: the A operand of its P V product
    const u32 q_addr = smem_addr(sQ);
    const auto issue_scores = [&](int j) {
      wgmma_fence();
      wgmma_rows_by_rows<T, BLOCK_N, HEAD_DIM>(s[0], q_addr, Tr::kBlockM, wg * 64, smem_addr(sK_ring + (j % STAGES) * Tr::kKVBytes));
      wgmma_commit();
    };
    const auto issue_values = [&](int j) {  // O += P V of block j (P in probs)
      wgmma_fence();
      wgmma_regs_by_tile<T, BLOCK_N, HEAD_DIM>(acc[0], probs, smem_addr(sV_ring + (j % STAGES) * Tr::kKVBytes));
      wgmma_commit();
    };
    const auto probabilities = [&](int n0, float (&alpha)[1][2]) {
      fence_registers(s[0]);
      if (SOFTCAP) softcap_scores(s, p);
      if (!band.all_visible(warp_first_row, warp_last_row, n0, n0 + BLOCK_N - 1)) mask_scores(s, band, warp_first_row, n0);
      return softmax_block(s, row_max, row_sum, p.exp2_scale, [&](int, int h, float a) { alpha[0][h] = a; });
    };
    const auto take_turn = [&] { named_barrier_sync(kBarTurn + wg, 256); };
    const auto pass_turn = [&] { named_barrier_arrive(kBarTurn + (wg + 1) % CONSUMERS, 256); };
    const auto parity = [](int j) { return u32((j / STAGES) & 1); };

    if (wg == CONSUMERS - 1) pass_turn();  // warpgroup 0 goes first
    mbarrier_wait(q_full, 0);
    mbarrier_wait(k_full, 0);
    take_turn();
    issue_scores(0);
    pass_turn();
    wgmma_wait<0>();
    mbarrier_arrive(k_empty);
    float alpha[1][2];
    probabilities(block_at(0) * BLOCK_N, alpha);  // O is still zero: nothing to rescale
    pack_a_operands<T, BLOCK_N>(probs, s[0]);
    for (int j = 1; j < blocks; ++j) {
      mbarrier_wait(k_full + j % STAGES, parity(j));
      mbarrier_wait(v_full + (j - 1) % STAGES, parity(j - 1));
      take_turn();
      issue_scores(j);
      issue_values(j - 1);
      pass_turn();
      wgmma_wait<1>();  // S only: groups complete in order
      mbarrier_arrive(k_empty + j % STAGES);
      const bool rescale = probabilities(block_at(j) * BLOCK_N, alpha);
      wgmma_wait<0>();
      mbarrier_arrive(v_empty + (j - 1) % STAGES);
      rescale_and_pack<T, BLOCK_N>(acc, probs, s, rescale, alpha);
    }
    mbarrier_wait(v_full + (blocks - 1) % STAGES, parity(blocks - 1));
    issue_values(blocks - 1);
    wgmma_wait<0>();
    fence_registers(acc[0]);
    fence_registers(probs);
    if (wg == 0) take_turn();  // the last warpgroup's last pass: every arrival at a turn barrier is matched
  }

  // Epilogue: normalize, stage the rows in sQ and store them (forward/staged_out.cuh).
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowTotal total = finish_row(row_max[0][h], row_sum[0][h], p.exp2_scale, head_view.sink);
    const int r = wg * 64 + warp * 16 + g + h * 8;  // row of the CTA's tile
    stage_out_row<T, Tr::kBlockM>(sQ, acc[0], h, r, total.inv);
    if (t == 0 && m0 + r < span.seqlen_q && head_view.lse != nullptr) head_view.lse[m0 + r] = total.lse;
  }
  store_staged_rows<T, Tr::kBlockM, HEAD_DIM>(sQ, head_view.out, p.out_strides[1], m0, wg, span.seqlen_q, p.head_dim);
}

/// \brief Attention forward with TMA loads from a producer warpgroup: one CTA per (block of
/// 64 x CONSUMERS query rows, head, sequence), query blocks heaviest-first (common/grid.cuh). Dense layout.
template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, int CONSUMERS, bool SOFTCAP, bool SPARSE = false>
__global__ void __launch_bounds__(TmaForwardTraits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS>::kThreads, 1)
    forward_tma_kernel(const __grid_constant__ TmaAttnParams tp) {
  using Tr = TmaForwardTraits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  if (threadIdx.x == Tr::kConsumerThreads) {
    tma_prefetch_map(&tp.q_map);
    tma_prefetch_map(&tp.k_map);
    tma_prefetch_map(&tp.v_map);
  }
  static_assert(!SPARSE || kSparseBlock % Tr::kBlockM == 0, "a CTA's rows within one mask block");
  const GridCell cell = grid_cell<SPARSE>(tp.attn);
  const int head = cell.y, seq = cta_batch(tp.attn);
  const SeqSpan span = seq_span<SeqLayout::kDense>(tp.attn, seq);
  for_each_row_block<SeqLayout::kDense, Tr::kBlockM>(cell.x, span.seqlen_q, [&](int m_block) {
    forward_tma_block<T, HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, SOFTCAP, SPARSE>(tp, seq, head, span, m_block, smem_raw);
  });
}

}  // namespace cuattn
