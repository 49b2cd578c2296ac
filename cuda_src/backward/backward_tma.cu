// Attention backward in one pass for Hopper (sm_90a) with a producer warpgroup: the dK/dV loop of
// backward/wgmma_dkdv_loop.cuh with dQ summed into p.dq_accum (as backward_wgmma_fused.cu), its
// tiles loaded by TMA, so that the warpgroups that compute never copy or compute addresses.
//
// A CTA owns 128 keys of one (KV head, sequence): two consumer warpgroups of 64 keys each keep K,
// V and the fp32 dK / dV on chip, and stream the steps of BLOCK_M query rows of every query head
// of the group (QuerySteps); the last warpgroup, the producer, gives its registers to them
// (setmaxnreg). One producer warp fills a ring of STAGES slots: per step lane 0 loads Q and dO by
// TMA (one box per 64 columns), then its lanes copy the rows' lse and delta. K and V are loaded
// once, on a barrier of their own.
// Who waits on what (mbarriers, common/tma.cuh): slot s has a "full" barrier (the TMA bytes lane
// 0 announces, and each lane's arrival once it has written its lse and delta rows) that
// consumers wait on before the step's products, and an "empty" barrier every consumer thread
// arrives at once the step's products that read Q and dO have completed; the producer waits on
// it before refilling the slot. Parities as in forward/forward_tma.cu: the k-th fill of a slot is
// awaited on parity k & 1, its release before the refill on (k & 1) ^ 1.
// dQ: once dS^T is formed each warpgroup stores its rows into one of two dS^T buffers (by step
// parity), the consumers meet at one named barrier (kBarDs), and each issues its piece of the
// step's dQ = dS K over all 128 keys before dK += dS^T Q, so that the piece is staged in fp32 and
// handed to a bulk reduction into dq_accum while dK runs. A buffer is rewritten two steps later,
// after every consumer has passed the next step's barrier, which each reaches only after its dQ
// product of the step before (the one that read the buffer) has completed. (Staging the piece
// under the next step's score products, as the copying kernel does, keeps its registers live
// across them: more than the consumers' 240, so it spilled.)
// Rows past seqlen_q are zero-filled by the TMA unit and their lse and delta are 0: their P^T is 1
// but dO and delta are 0 there, so dV, dS^T and dK get nothing from them (as from the copying
// kernel's zero-filled rows); keys past seqlen_k are masked by KeyBand.
// Dense layout, without dropout (that stays on backward_wgmma_fused.cu). SPARSE: a block mask's
// kept query blocks are the steps (SparseQuerySteps), its CTAs taken in the order of the launch's
// schedule (grid_cell), one CTA per key block.
#include "backward/wgmma_dkdv_loop.cuh"
#include "common/named_barrier.cuh"
#include "common/tma.cuh"

namespace cuattn {

template <int HEAD_DIM, int BLOCK_M, int STAGES>
struct TmaBackwardTraits : WgmmaFusedTraits<HEAD_DIM, BLOCK_M, 2> {
  using Fused = WgmmaFusedTraits<HEAD_DIM, BLOCK_M, 2>;
  static constexpr int kConsumerThreads = 256;
  static constexpr int kThreads = kConsumerThreads + 128;  // + the producer warpgroup
  static constexpr int kProducerRegisters = 24;            // 128 x 24 + 256 x 240 <= 65536
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kStages = STAGES;
  static constexpr int kColumnBlocks = HEAD_DIM / kSwizzleBlockElems;  // TMA boxes per tile
  static constexpr int kBarriers = 1 + 2 * STAGES;                    // K and V; full and empty per slot
  static constexpr int kSmemBytes = 2 * Fused::kResidentBytes + 2 * STAGES * Fused::kStreamBytes + 2 * Fused::kDsBytes +
                                    2 * Fused::kDqStageBytes + 2 * STAGES * BLOCK_M * 4 + kBarriers * 8 + kSwizzleAtomBytes;
};

constexpr int kBarDs = 3;  // the consumers' dS^T is in shared memory (1 + wg: a warpgroup's dQ staging)

template <typename T, int HEAD_DIM, int BLOCK_M, int STAGES, bool SOFTCAP, bool SPARSE = false>
__global__ void __launch_bounds__(TmaBackwardTraits<HEAD_DIM, BLOCK_M, STAGES>::kThreads, 1)
    backward_tma_kernel(const __grid_constant__ TmaBackwardParams tp) {
  using Tr = TmaBackwardTraits<HEAD_DIM, BLOCK_M, STAGES>;
  constexpr int BN = Tr::kBlockResident;  // 128 keys per CTA
  constexpr int kSteps = BLOCK_M / 16;
  const BackwardParams& p = tp.bwd;
  const AttnParams& a = p.attn;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  unsigned char* sK = smem_raw + (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
  unsigned char* sV = sK + Tr::kResidentBytes;
  unsigned char* sQ_ring = sV + Tr::kResidentBytes;
  unsigned char* sdO_ring = sQ_ring + STAGES * Tr::kStreamBytes;
  unsigned char* sdS = sdO_ring + STAGES * Tr::kStreamBytes;  // two buffers
  float* sDq_stage = reinterpret_cast<float*>(sdS + 2 * Tr::kDsBytes);
  float* sLse_ring = sDq_stage + 2 * Tr::kDqStageBytes / 4;
  float* sDelta_ring = sLse_ring + STAGES * BLOCK_M;
  u64* kv_full = reinterpret_cast<u64*>(sDelta_ring + STAGES * BLOCK_M);
  u64* full = kv_full + 1;
  u64* empty = full + STAGES;

  const GridCell cell = grid_cell<SPARSE>(a);  // SPARSE: the cell the launch's schedule gives
  const int kv_head = cell.y, batch = cta_batch(a);
  const int splits = SPARSE ? 1 : p.query_splits, split = cell.x % splits;  // CTAs sharing the key block's query steps
  const int n0 = cell.x / splits * BN;
  const SeqSpan span = seq_span<SeqLayout::kDense>(a, batch);
  const KeyBand band(a, span);
  const auto plan = query_steps<SPARSE, BLOCK_M>(a, span, band, batch, kv_head, n0, BN, split, splits);

  if (threadIdx.x == 0) {
    mbarrier_init(kv_full, 1);
    for (int s = 0; s < STAGES; ++s) {
      mbarrier_init(full + s, 32);  // the producer warp's lanes, each once its lse and delta rows are written
      mbarrier_init(empty + s, Tr::kConsumerThreads);
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  if (threadIdx.x >= Tr::kConsumerThreads) {  // the producer warpgroup; its first warp loads
    set_max_registers_dec<Tr::kProducerRegisters>();
    const int lane = threadIdx.x % 32;
    if (threadIdx.x < Tr::kConsumerThreads + 32 && plan.steps > 0) {
      if (lane == 0) {
        tma_prefetch_map(&tp.q_map);
        tma_prefetch_map(&tp.dout_map);
        mbarrier_arrive_expect_bytes(kv_full, 2 * Tr::kResidentBytes);
#pragma unroll
        for (int cb = 0; cb < Tr::kColumnBlocks; ++cb) {
          tma_load_4d(sK + cb * BN * kSwizzleRowBytes, &tp.k_map, kv_full, cb * kSwizzleBlockElems, n0, kv_head, batch);
          tma_load_4d(sV + cb * BN * kSwizzleRowBytes, &tp.v_map, kv_full, cb * kSwizzleBlockElems, n0, kv_head, batch);
        }
      }
      for (int step = 0; step < plan.steps; ++step) {
        const int s = step % STAGES;
        const int head = plan.head(kv_head, step), m0 = plan.m0(step);
        mbarrier_wait(empty + s, ((step / STAGES) & 1) ^ 1);
        if (lane == 0) {  // Q and dO first: their bytes count on the barrier, the lanes' arrivals below
          mbarrier_expect_bytes(full + s, 2 * Tr::kStreamBytes);
#pragma unroll
          for (int cb = 0; cb < Tr::kColumnBlocks; ++cb) {
            const int offset = s * Tr::kStreamBytes + cb * BLOCK_M * kSwizzleRowBytes;
            tma_load_4d(sQ_ring + offset, &tp.q_map, full + s, cb * kSwizzleBlockElems, m0, head, batch);
            tma_load_4d(sdO_ring + offset, &tp.dout_map, full + s, cb * kSwizzleBlockElems, m0, head, batch);
          }
        }
        const RowStats stats(p, batch, head, span);
#pragma unroll
        for (int i = lane; i < BLOCK_M; i += 32) {
          const int row = m0 + i;
          sLse_ring[s * BLOCK_M + i] = row < span.seqlen_q ? stats.lse[row] : 0.f;
          sDelta_ring[s * BLOCK_M + i] = row < span.seqlen_q ? stats.delta[row] : 0.f;
        }
        mbarrier_arrive(full + s);  // a release: the lane's rows are visible to the consumers that wait on the phase
      }
    }
    return;  // no CTA barrier follows
  }

  set_max_registers_inc<Tr::kConsumerRegisters>();
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  float dk[Tr::kDTiles][4] = {}, dv[Tr::kDTiles][4] = {};

  const int warp_key_row = wg * 64 + warp * 16;  // in the CTA's key block
  const int warp_key0 = n0 + warp_key_row;
  const u32 k_addr = smem_addr(sK), v_addr = smem_addr(sV);

  // This warpgroup's piece of each step's dQ tile: rows 64 * row_piece.., columns col0.. .
  static_assert(Tr::kDqPieces == 2, "one dQ piece per consumer warpgroup");
  const int row_piece = wg / Tr::kDqColPieces, col0 = (wg % Tr::kDqColPieces) * Tr::kDqCols;
  float* stage_dq = sDq_stage + wg * Tr::kDqStageBytes / 4;
  const bool issuer = threadIdx.x % 128 == 0;
  float dq[Tr::kDqCols / 8][4] = {};  // the step's piece


  if (plan.steps > 0) mbarrier_wait(kv_full, 0);
  for (int step = 0; step < plan.steps; ++step) {
    const int s = step % STAGES;
    mbarrier_wait(full + s, (step / STAGES) & 1);
    const int head = plan.head(kv_head, step), m0 = plan.m0(step);
    const int m_last = min(m0 + BLOCK_M, span.seqlen_q) - 1;
    const bool masked = !band.all_visible(m0, m_last, warp_key0, warp_key0 + 15);
    const u32 q_addr = smem_addr(sQ_ring + s * Tr::kStreamBytes), do_addr = smem_addr(sdO_ring + s * Tr::kStreamBytes);

    u32 p_frag[kSteps][4], ds_frag[kSteps][4];  // P^T and dS^T as 16-bit A operands
    unsigned char* ds_buffer = sdS + (step & 1) * Tr::kDsBytes;
    const u32 ds_piece_addr = smem_addr(ds_buffer) + row_piece * BN * kSwizzleRowBytes, k_piece_addr = k_addr + col0 * BN * 2;
    // dQ = dS K (this warpgroup's piece, over the CTA's keys) goes before dK += dS^T Q, so that
    // its staging runs under dK.
    const auto issue_dq = [&] {
      store_ds_transposed<BN>(ds_buffer, ds_frag, warp_key_row, lane);
      fence_proxy_async();
      named_barrier_sync(kBarDs, Tr::kConsumerThreads);  // the step's dS^T is in shared memory
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_ss_mn<T, Tr::kDqCols>(dq, mn_major_desc(ds_piece_addr, BN, kk), mn_major_desc(k_piece_addr, BN, kk), kk > 0);
      wgmma_commit();
    };
    dkdv_step_products<T, HEAD_DIM, BLOCK_M, BN, SOFTCAP, false>(dk, dv, p_frag, ds_frag, k_addr, v_addr, q_addr, do_addr, wg,
                                                                 sLse_ring + s * BLOCK_M, sDelta_ring + s * BLOCK_M, band, masked, m0,
                                                                 warp_key0, lane, a, batch, head, [] {}, issue_dq);
    wgmma_wait<1>();  // dV and dQ (dK may still run)
    fence_registers(dq);
    reduce_dq_piece<Tr::kDqCols, Tr::kDqStageBytes>(
        dq, stage_dq, issuer, wg, lane, [&] { return dq_accum_tile(p, batch, head, span, m0 / 64 + row_piece, col0 / 64); },
        m0 + row_piece * 64 < span.seqlen_q);
    wgmma_wait<0>();
    fence_registers(p_frag);
    fence_registers(ds_frag);
    fence_registers(dv);
    fence_registers(dk);
    mbarrier_arrive(empty + s);  // Q, dO, lse and delta of the slot are read
  }
  if (issuer) bulk_wait<0>();

  if (p.sum_grads & kSumDkDv) {  // added into fp32 sums; by atomics where the query steps are split
    float* dk_sum = head_rows<float>(p.dk, p.dk_strides, batch, kv_head, span.k_row0);
    float* dv_sum = head_rows<float>(p.dv, p.dv_strides, batch, kv_head, span.k_row0);
    if (splits > 1) {
      if (plan.steps == 0) return;  // zeros: the sums hold them already
      atomic_add_acc_rows<Tr::kDTiles>(dk, a.scale, dk_sum, p.dk_strides[1], warp_key0, span.seqlen_k, a.head_dim, lane);
      atomic_add_acc_rows<Tr::kDTiles>(dv, 1.f, dv_sum, p.dv_strides[1], warp_key0, span.seqlen_k, a.head_dim, lane);
    } else {
      add_acc_rows<Tr::kDTiles>(dk, a.scale, dk_sum, p.dk_strides[1], warp_key0, span.seqlen_k, a.head_dim, lane);
      add_acc_rows<Tr::kDTiles>(dv, 1.f, dv_sum, p.dv_strides[1], warp_key0, span.seqlen_k, a.head_dim, lane);
    }
    return;
  }
  T* dk_out = head_rows<T>(p.dk, p.dk_strides, batch, kv_head, span.k_row0);
  T* dv_out = head_rows<T>(p.dv, p.dv_strides, batch, kv_head, span.k_row0);
  store_acc_rows<T, Tr::kDTiles>(dk, a.scale, dk_out, p.dk_strides[1], warp_key0, span.seqlen_k, a.head_dim, lane);
  store_acc_rows<T, Tr::kDTiles>(dv, 1.f, dv_out, p.dv_strides[1], warp_key0, span.seqlen_k, a.head_dim, lane);
}

}  // namespace cuattn
