// Tensor-core attention forward (FlashAttention-2 scheme): one CTA per (query block, head,
// batch), K/V blocks streamed through shared memory with cp.async, S = Q K^T and O += P V on
// mma.sync, online softmax in registers, lse written per row.
#include "common/head_view.cuh"
#include "common/mask.cuh"
#include "common/mma.cuh"
#include "common/params.cuh"
#include "forward/traits.cuh"

namespace cuattn {

// Copies rows [row0, row0 + ROWS) of one head of a (batch, seq, head, dim) tensor into a padded
// shared tile, zero-filling rows >= row_end and columns >= head_dim.
template <typename Tr, int ROWS, typename T>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, i64 row_stride, int row0, int row_end, int head_dim) {
  constexpr int kChunks = ROWS * Tr::kChunksPerRow;
  static_assert(kChunks % Tr::kThreads == 0, "whole copy rounds");
#pragma unroll
  for (int i = 0; i < kChunks / Tr::kThreads; ++i) {
    const int chunk = i * Tr::kThreads + threadIdx.x;
    const int r = chunk / Tr::kChunksPerRow, c = (chunk % Tr::kChunksPerRow) * 8;
    const bool valid = row0 + r < row_end && c < head_dim;
    const T* src = valid ? gmem + (row0 + r) * row_stride + c : gmem;
    cp_async_16(smem + r * Tr::kRowStride + c, src, valid);
  }
}

/// \brief Attention forward for one (query block, head, batch) = (blockIdx.x, blockIdx.y,
/// blockIdx.z); query blocks run heaviest-first. Writes out and lse.
template <typename T, int HEAD_DIM, int BLOCK_M, int BLOCK_N, int WARPS, bool SOFTCAP>
__global__ void __launch_bounds__(WARPS * 32) forward_kernel(const __grid_constant__ AttnParams p) {
  using Tr = ForwardTraits<HEAD_DIM, BLOCK_M, BLOCK_N, WARPS>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + Tr::kSmemQ;
  T* sV = sK + Tr::kSmemKV;

  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  const int m0 = m_block * BLOCK_M;
  const int m_last = min(m0 + BLOCK_M, p.seqlen_q) - 1;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const HeadView<T> head_view(p, batch, head);
  const auto [q, k, v, out, lse] = head_view;

  const KeyBand band(p);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  const int n_first = key_first / BLOCK_N;
  const int n_last = key_last < key_first ? n_first - 1 : key_last / BLOCK_N;

  float acc[Tr::kMTiles][Tr::kDTiles][4];
  float row_max[Tr::kMTiles][2], row_sum[Tr::kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int dt = 0; dt < Tr::kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][dt][e] = 0.f;
    row_max[mt][0] = row_max[mt][1] = neg_inf();
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }

  if (n_last >= n_first) {
    load_tile<Tr, BLOCK_M>(sQ, q, p.q_strides[1], m0, p.seqlen_q, p.head_dim);
    load_tile<Tr, BLOCK_N>(sK, k, p.k_strides[1], n_last * BLOCK_N, p.seqlen_k, p.head_dim);
    cp_async_commit();
  }
  const int warp_row0 = warp * Tr::kWarpRows;

  // Key blocks from last to first, so that the partially masked diagonal block comes first.
  for (int n_block = n_last; n_block >= n_first; --n_block) {
    const int n0 = n_block * BLOCK_N;
    cp_async_wait<0>();
    __syncthreads();  // K[n_block] (and Q) landed; every warp finished P V of the previous block
    load_tile<Tr, BLOCK_N>(sV, v, p.v_strides[1], n0, p.seqlen_k, p.head_dim);
    cp_async_commit();

    float s[Tr::kMTiles][Tr::kNTiles][4];
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][nt][e] = 0.f;

    // Large head dims unroll by 4 only: full unrolling lets the compiler hoist every K fragment
    // into registers at once (spills at 96 and 128).
#pragma unroll(HEAD_DIM > 64 ? 4 : HEAD_DIM / 16)
    for (int kk = 0; kk < HEAD_DIM; kk += 16) {
      u32 a[Tr::kMTiles][4];
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        const int r = warp_row0 + mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4(a[mt], sQ + r * Tr::kRowStride + kk + (lane / 16) * 8);
      }
#pragma unroll
      for (int nt = 0; nt < Tr::kNTiles; nt += 2) {
        u32 b[4];  // b0,b1 of n-tile nt, then of nt + 1
        const int r = nt * 8 + (lane % 8) + (lane / 16) * 8;
        ldmatrix_x4(b, sK + r * Tr::kRowStride + kk + ((lane / 8) % 2) * 8);
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
          mma_16816<T>(s[mt][nt], a[mt], b[0], b[1]);
          mma_16816<T>(s[mt][nt + 1], a[mt], b[2], b[3]);
        }
      }
    }
    __syncthreads();  // every warp is done reading K[n_block]
    if (n_block > n_first) {
      load_tile<Tr, BLOCK_N>(sK, k, p.k_strides[1], n0 - BLOCK_N, p.seqlen_k, p.head_dim);
    }
    cp_async_commit();  // possibly empty group, keeps the wait counts below uniform

    if (SOFTCAP) {
      const float pre = p.scale / p.softcap;
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[mt][nt][e] = p.softcap * tanhf(s[mt][nt][e] * pre);
    }
    if (!band.all_visible(m0, m_last, n0, n0 + BLOCK_N - 1)) {
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int row = m0 + warp_row0 + mt * 16 + g + (e / 2) * 8;
            const int col = n0 + nt * 8 + 2 * t + (e % 2);
            if (!band.visible(row, col)) s[mt][nt][e] = neg_inf();
          }
    }

    // Online softmax. Each thread holds rows g and g + 8 of each m-tile; a row's 4 owners are
    // the lanes of one quad. Scores stay unscaled; exp2_scale folds scale and log2(e).
    const float sc = p.exp2_scale;
#pragma unroll
    for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = row_max[mt][h];
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        // A row that has seen no key yet keeps max -inf; exponents then use 0 so no inf - inf.
        const float shift = mx == neg_inf() ? 0.f : mx * sc;
        const float alpha = row_max[mt][h] == neg_inf() ? 0.f : exp2f(row_max[mt][h] * sc - shift);
        row_max[mt][h] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < Tr::kNTiles; ++nt) {
#pragma unroll
          for (int e = 2 * h; e < 2 * h + 2; ++e) {
            s[mt][nt][e] = exp2f(fmaf(s[mt][nt][e], sc, -shift));
            sum += s[mt][nt][e];
          }
        }
        row_sum[mt][h] = row_sum[mt][h] * alpha + sum;
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt) {
          acc[mt][dt][2 * h] *= alpha;
          acc[mt][dt][2 * h + 1] *= alpha;
        }
      }
    }

    cp_async_wait<1>();
    __syncthreads();  // V[n_block] landed (K[n_block - 1] may still be in flight)

#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      u32 a[Tr::kMTiles][4];  // P as the A operand: the C tiles 2kk, 2kk+1 re-packed to 16 bits
#pragma unroll
      for (int mt = 0; mt < Tr::kMTiles; ++mt) {
        a[mt][0] = pack2<T>(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        a[mt][1] = pack2<T>(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        a[mt][2] = pack2<T>(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        a[mt][3] = pack2<T>(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dt = 0; dt < Tr::kDTiles; dt += 2) {
        u32 b[4];  // b0,b1 of d-tile dt, then of dt + 1
        const int r = kk * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
        ldmatrix_x4_trans(b, sV + r * Tr::kRowStride + dt * 8 + (lane / 16) * 8);
#pragma unroll
        for (int mt = 0; mt < Tr::kMTiles; ++mt) {
          mma_16816<T>(acc[mt][dt], a[mt], b[0], b[1]);
          mma_16816<T>(acc[mt][dt + 1], a[mt], b[2], b[3]);
        }
      }
    }
  }

  // Epilogue: finish the row sums across the quad, normalize, store out and lse.
#pragma unroll
  for (int mt = 0; mt < Tr::kMTiles; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float l = row_sum[mt][h];
      l += __shfl_xor_sync(0xffffffff, l, 1);
      l += __shfl_xor_sync(0xffffffff, l, 2);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const int row = m0 + warp_row0 + mt * 16 + g + h * 8;
      if (row < p.seqlen_q) {
        T* dst = out + row * p.out_strides[1];
#pragma unroll
        for (int dt = 0; dt < Tr::kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          if (col < p.head_dim) {
            *reinterpret_cast<u32*>(dst + col) = pack2<T>(acc[mt][dt][2 * h] * inv, acc[mt][dt][2 * h + 1] * inv);
          }
        }
        if (t == 0) {
          lse[row] = l > 0.f ? (row_max[mt][h] * p.exp2_scale + log2f(l)) * 0.69314718055994531f : neg_inf();
        }
      }
    }
  }
}

}  // namespace cuattn
