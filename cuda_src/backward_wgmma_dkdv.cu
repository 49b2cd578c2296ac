// Attention backward, dK and dV, for Hopper (sm_90a): backward_dkdv.cu's scheme on warpgroup
// tensor cores. One CTA per (key block of 64 keys per warpgroup, KV head, batch) keeps K, V and
// the fp32 dK / dV accumulators on chip and streams the query blocks of every query head of the
// KV head's group (GQA sums in registers; every gradient element written once, deterministic).
// Per query block each warpgroup forms S^T = K Q^T and dP^T = V dO^T for its 64 keys, P^T from
// the saved lse, dS^T = P^T (dP^T - delta), dV += P^T dO and dK += dS^T Q.
#include "backward/head_rows.cuh"
#include "backward/score_grad.cuh"
#include "backward/wgmma_traits.cuh"
#include "common/mask.cuh"
#include "common/params.cuh"
#include "common/tile_copy.cuh"
#include "common/wgmma.cuh"

namespace cuattn {

template <typename T, int HEAD_DIM, int BLOCK_M, int WARPGROUPS, int CTAS_PER_SM, bool SOFTCAP>
__global__ void __launch_bounds__(WARPGROUPS * 128, CTAS_PER_SM) backward_wgmma_dkdv_kernel(const __grid_constant__ BackwardParams p) {
  using Tr = WgmmaBackwardTraits<HEAD_DIM, BLOCK_M, WARPGROUPS>;
  constexpr int BN = Tr::kBlockResident;  // keys per CTA
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  unsigned char* sK = smem_raw + (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
  unsigned char* sV = sK + Tr::kResidentBytes;
  unsigned char* sQ_ring = sV + Tr::kResidentBytes;
  unsigned char* sdO_ring = sQ_ring + Tr::kStages * Tr::kStreamBytes;
  float* sLse_ring = reinterpret_cast<float*>(sdO_ring + Tr::kStages * Tr::kStreamBytes);
  float* sDelta_ring = sLse_ring + Tr::kStages * BLOCK_M;

  const AttnParams& a = p.attn;
  const int n_block = blockIdx.x, kv_head = blockIdx.y, batch = blockIdx.z;
  const int n0 = n_block * BN;
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const T* k = head_rows<T>(a.k, a.k_strides, batch, kv_head);
  const T* v = head_rows<T>(a.v, a.v_strides, batch, kv_head);
  const KeyBand band(a);
  const QuerySteps<BLOCK_M> plan(a, band, n0, BN);

  const auto load_step = [&](int step, int stage) {
    const int head = plan.head(kv_head, step), m0 = plan.m0(step);
    const T* q = head_rows<T>(a.q, a.q_strides, batch, head);
    const T* dout = head_rows<T>(p.dout, p.dout_strides, batch, head);
    load_tile_sw128<Tr, BLOCK_M>(sQ_ring + stage * Tr::kStreamBytes, q, a.q_strides[1], m0, a.seqlen_q, a.head_dim);
    load_tile_sw128<Tr, BLOCK_M>(sdO_ring + stage * Tr::kStreamBytes, dout, p.dout_strides[1], m0, a.seqlen_q, a.head_dim);
    RowStats(p, batch, head).load<BLOCK_M>(sLse_ring + stage * BLOCK_M, sDelta_ring + stage * BLOCK_M, m0, a.seqlen_q);
  };

  load_tile_sw128<Tr, BN>(sK, k, a.k_strides[1], n0, a.seqlen_k, a.head_dim);
  load_tile_sw128<Tr, BN>(sV, v, a.v_strides[1], n0, a.seqlen_k, a.head_dim);
  if (plan.steps > 0) load_step(0, 0);
  cp_async_commit();

  float dk[Tr::kDTiles][4], dv[Tr::kDTiles][4];
#pragma unroll
  for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[dt][e] = dv[dt][e] = 0.f;

  const int wg_key0 = n0 + wg * 64;
  const int wg_key_last = min(wg_key0 + 63, a.seqlen_k - 1);
  const int warp_key0 = wg_key0 + warp * 16;
  const u32 k_addr = smem_addr(sK), v_addr = smem_addr(sV);

  for (int step = 0, stage = 0; step < plan.steps; ++step, stage ^= 1) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // this stage landed; every warpgroup finished with the other one
    if (step + 1 < plan.steps) {
      load_step(step + 1, stage ^ 1);
      cp_async_commit();
    }
    const int m0 = plan.m0(step);
    const int m_last = min(m0 + BLOCK_M, a.seqlen_q) - 1;
    if (wg_key_last < wg_key0 || wg_key0 > band.last_key(m_last) || wg_key_last < band.first_key(m0)) continue;
    const bool masked = !band.all_visible(m0, m_last, warp_key0, warp_key0 + 15);
    const u32 q_addr = smem_addr(sQ_ring + stage * Tr::kStreamBytes), do_addr = smem_addr(sdO_ring + stage * Tr::kStreamBytes);
    const float* sLse = sLse_ring + stage * BLOCK_M;
    const float* sDelta = sDelta_ring + stage * BLOCK_M;

    float s[Tr::kNTiles][4], dp[Tr::kNTiles][4];  // S^T and dP^T: this warp's 16 keys x BLOCK_M queries
    wgmma_fence();
    wgmma_rows_by_rows<T, BLOCK_M, HEAD_DIM>(s, k_addr, BN, wg * 64, q_addr);
    wgmma_rows_by_rows<T, BLOCK_M, HEAD_DIM>(dp, v_addr, BN, wg * 64, do_addr);
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(s);
    fence_registers(dp);

#pragma unroll
    for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * t + (e % 2);  // query m0 + col
        const bool visible = !masked || band.visible(m0 + col, warp_key0 + g + (e / 2) * 8);
        const ProbGrad pg = prob_and_grad<SOFTCAP>(s[nt][e], dp[nt][e], lse_to_exp2_shift(sLse[col]), sDelta[col], visible, a);
        s[nt][e] = pg.prob;  // P^T
        dp[nt][e] = pg.grad;  // dS^T
      }
    wgmma_fence();
    wgmma_frag_by_tile<T, BLOCK_M, HEAD_DIM>(dv, s, do_addr);  // dV += P^T dO
    wgmma_frag_by_tile<T, BLOCK_M, HEAD_DIM>(dk, dp, q_addr);  // dK += dS^T Q
    wgmma_commit();
    wgmma_wait<0>();
    fence_registers(dv);
    fence_registers(dk);
  }

  T* dk_out = head_rows<T>(p.dk, p.dk_strides, batch, kv_head);
  T* dv_out = head_rows<T>(p.dv, p.dv_strides, batch, kv_head);
  store_acc_rows<T, Tr::kDTiles>(dk, a.scale, dk_out, p.dk_strides[1], warp_key0, a.seqlen_k, a.head_dim, lane);
  store_acc_rows<T, Tr::kDTiles>(dv, 1.f, dv_out, p.dv_strides[1], warp_key0, a.seqlen_k, a.head_dim, lane);
}

}  // namespace cuattn
