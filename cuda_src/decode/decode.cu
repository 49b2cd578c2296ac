// Attention of a few new query rows per sequence over its KV cache (decoding), split over the
// keys. One CTA per (key split, KV head x block of 16 packed query rows, sequence). The query
// heads of one KV head are packed into the rows of the tile (row r of the block: new token
// r / group, query head kv_head * group + r % group), so K and V are read once for the group.
// Each of the WARPS warps (4, or 8 for contiguous caches on grids within the SMs: the host's
// choice) takes 16 keys of every 16 x WARPS-key block streamed through a cp.async ring; the
// warps' softmax states are combined through shared memory at the end. With one split the CTA
// writes out and lse; with several it writes its fp32 partial (normalized out and lse), which
// decode_combine.cu merges by lse (launched as a dependent grid on Hopper: common/dependent_launch.cuh).
#include "common/dependent_launch.cuh"
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/seq_layout.cuh"
#include "forward/online_softmax.cuh"

namespace cuattn {

constexpr int kDecodeRows = 16;    // packed query rows per CTA
constexpr int kDecodeWarps = 4;

template <int HEAD_DIM, int STAGES, int WARPS = kDecodeWarps>
struct DecodeTraits {
  static constexpr int kHeadDim = HEAD_DIM;
  static constexpr int kBlockN = 16 * WARPS;  // keys per stage, 16 per warp
  static constexpr int kThreads = WARPS * 32;
  static constexpr int kStages = STAGES;           // K/V blocks in the cp.async ring
  // Shared rows of whole 128-byte lines (head_dim a multiple of 64) are unpadded, their 16-byte
  // chunks swizzled by the row (chunk c of row r at c ^ (r % 8)): ldmatrix's 8 rows then hit 8
  // different banks, and each row's cp.async writes whole lines. Padding the rows by 16 bytes
  // instead cost 7-10% of the streaming rate (H200, benchmarks/NOTES.md). Other head dims keep
  // the padded rows.
  static constexpr bool kSwizzled = HEAD_DIM % 64 == 0;
  static constexpr int kRowStride = kSwizzled ? HEAD_DIM : HEAD_DIM + 8;  // elements
  // Offset (elements) of row r, column c (a multiple of 8) of a tile.
  __device__ static __forceinline__ int at(int r, int c) { return r * kRowStride + (kSwizzled ? ((c >> 3) ^ (r & 7)) << 3 : c); }
  static constexpr int kChunksPerRow = HEAD_DIM / 8;
  static constexpr int kSmemQ = kDecodeRows * kRowStride;
  static constexpr int kSmemKV = kBlockN * kRowStride;
  static constexpr int kSmemRows = STAGES * kBlockN * 4;  // paged: the block-table entries of blocks in flight, one buffer a slot
  static constexpr int kSmemBytes = (kSmemQ + 2 * STAGES * kSmemKV) * 2 + kSmemRows;
  static constexpr int kPartialStride = HEAD_DIM + 4;  // fp32 rows of the warps' outputs, in the ring
  static_assert(STAGES >= 2, "a ring");
  static_assert(WARPS * kDecodeRows * kPartialStride * 4 <= 2 * STAGES * kSmemKV * 2, "partials fit the ring");
  static_assert(2 * WARPS * kDecodeRows * 4 <= kSmemQ * 2, "the warps' row shifts and sums fit Q's tile");
};

// The keys the new tokens of one sequence see: token t (of seqlen_q, bottom-right aligned to the
// cache's `length` keys) sees keys [first(t), last(t)].
struct CacheBand {
  int offset, left, right, length;
  __device__ __forceinline__ int first(int t) const { return left < 0 ? 0 : max(0, t + offset - left); }
  __device__ __forceinline__ int last(int t) const { return right < 0 ? length - 1 : min(length - 1, t + offset + right); }
};

// This warp's 16 keys of the block at n0 (keys n0 + 16 w .. n0 + 16 w + 15 of warp w, the only
// warp that reads them) from K and V into the shared tiles; keys past `end` and columns past
// head_dim read as zeros (no load issued). A lane copies one 16-byte column of every
// kRowsPerRound-th row (lanes past the last whole round idle). k and v point at the sequence's
// head: in its cache row (contiguous), or at page 0 (paged: each key's page is its block-table
// entry in `rows`, copied there by copy_table_entries STAGES - 1 blocks ahead, and clamped
// into the cache here). The general row loop (last) is not unrolled: unrolled, the compiler keeps
// every row's address of a contiguous cache live across the key loop.
template <typename T, typename Tr, bool PAGED, bool RUNS>
__device__ __forceinline__ void load_kv_rows(T* sK, T* sV, const DecodeParams& p, const CacheRows<PAGED>& cache, const T* k, const T* v,
                                             int n0, int end, const int* rows) {
  static_assert(Tr::kChunksPerRow <= 32, "a row per round at least");
  constexpr int kRowsPerRound = 32 / Tr::kChunksPerRow;
  const int lane = threadIdx.x % 32, first = threadIdx.x / 32 * 16;
  const int r0 = lane / Tr::kChunksPerRow, c = lane % Tr::kChunksPerRow * 8;
  if (r0 >= kRowsPerRound) return;
  // RUNS (the host's choice: contiguous caches, and pages of a multiple of 16 positions, from
  // head_dim 96): the warp's 16 keys lie in one run of positions. Where they are all in the
  // sequence, one address per K and V advanced by a row stride: ~90 instructions a block at
  // head_dim 128 where the general loop below takes ~340 (its per-row 64-bit address math). The
  // general loop compiles as it did without this branch where RUNS is off (pages of 1: the
  // branch beside it cost them 10%: registers, rematerialized addresses); below head_dim 96 the
  // unrolled rounds cost a CTA per SM. The condition is uniform over the copying lanes.
  if (RUNS && n0 + first + 16 <= end && (!PAGED || cache.page_size % 16 == 0)) {
    const i64 at = PAGED ? cache.clamp_row(rows[first]) : 0, pos = cache.pos_of(n0 + first + r0);
    const T* k_row = k + (at * p.k_strides[0] + pos * p.k_strides[1] + c);
    const T* v_row = v + (at * p.v_strides[0] + pos * p.v_strides[1] + c);
    const i64 k_step = kRowsPerRound * p.k_strides[1], v_step = kRowsPerRound * p.v_strides[1];
    // Tr::at(row0 + d, c) for the rounds' row steps d: row0 % 8 = r0 (first is a multiple of
    // 16) and d a multiple of kRowsPerRound, a power of two above r0, so the swizzle of row0 + d
    // is row0's xor d % 8 (the compiler cannot see that for a runtime row0). The row's shared
    // address goes through a shuffle of the lane's own value, which ptxas takes for a per-lane
    // value: else it split uniform slot bases into uniform registers beside the copies' L2
    // policy and gave some copies an odd register pair for the policy, which the GPU refused
    // (an illegal instruction; NVRTC 13). The lanes past the last whole round returned above.
    constexpr int kCopyingLanes = kRowsPerRound * Tr::kChunksPerRow;
    constexpr u32 kCopying = kCopyingLanes == 32 ? 0xffffffffu : (1u << kCopyingLanes) - 1;
    const bool inside = c < p.head_dim;  // columns past head_dim read as zeros
    const int row0 = first + r0, swizzle = ((c >> 3) ^ r0) << 3;
    const u32 k_at = __shfl_sync(kCopying, smem_addr(sK + row0 * Tr::kRowStride), lane);
    const u32 v_at = k_at + u32(sV - sK) * sizeof(T);
#pragma unroll
    for (int i = 0; i < 16 / kRowsPerRound; ++i) {
      const int d = i * kRowsPerRound;
      const u32 at = (d * Tr::kRowStride + (Tr::kSwizzled ? swizzle ^ ((d & 7) << 3) : c)) * sizeof(T);
      cp_async_16_stream_at(k_at + at, k_row, inside);
      cp_async_16_stream_at(v_at + at, v_row, inside);
      k_row += k_step;
      v_row += v_step;
    }
    return;
  }
  // Paged without RUNS (pages whose size is not a multiple of 16, from head_dim 96): lanes 0-15
  // each work out one row's K and V addresses (its table entry and position) and each round's
  // lanes take their row's by shuffle, so the 64-bit address math is done once a row, not once
  // a 16-byte column of it (~16 instructions a round in the SASS where the loop below takes ~45). Below
  // head_dim 96 the unrolled rounds cost a CTA per SM in registers (d64: 105 -> 137).
  if constexpr (PAGED && !RUNS && Tr::kHeadDim >= 96) {
    constexpr int kCopyingLanes = kRowsPerRound * Tr::kChunksPerRow;
    constexpr u32 kCopying = kCopyingLanes == 32 ? 0xffffffffu : (1u << kCopyingLanes) - 1;
    static_assert(kCopyingLanes >= 16, "lanes 0-15 hold the rows' addresses");
    const int mine = first + lane % 16, j = n0 + mine;
    const i64 at = cache.clamp_row(rows[mine]), pos = cache.pos_of(j);  // rows past `end` hold 0: not copied
    const u64 k_mine = reinterpret_cast<u64>(k + (at * p.k_strides[0] + pos * p.k_strides[1]));
    const u64 v_mine = reinterpret_cast<u64>(v + (at * p.v_strides[0] + pos * p.v_strides[1]));
    const bool inside = c < p.head_dim;
    const int rows_left = end - (n0 + first + r0);  // round i copies a row where i * kRowsPerRound < rows_left
    const int row0 = first + r0, swizzle = ((c >> 3) ^ r0) << 3;
    const u32 k_at = __shfl_sync(kCopying, smem_addr(sK + row0 * Tr::kRowStride), lane);  // see RUNS above
    const u32 v_at = k_at + u32(sV - sK) * sizeof(T);
#pragma unroll
    for (int i = 0; i < 16 / kRowsPerRound; ++i) {
      const int d = i * kRowsPerRound;
      // Row r0 + d of the warp's 16 (lane r0 + d holds its addresses), column c of it.
      const u64 k_row = __shfl_sync(kCopying, k_mine, r0 + d), v_row = __shfl_sync(kCopying, v_mine, r0 + d);
      const u32 to = (d * Tr::kRowStride + (Tr::kSwizzled ? swizzle ^ ((d & 7) << 3) : c)) * sizeof(T);
      const bool valid = inside && d < rows_left;
      cp_async_16_stream_at(k_at + to, reinterpret_cast<const T*>(k_row) + c, valid);
      cp_async_16_stream_at(v_at + to, reinterpret_cast<const T*>(v_row) + c, valid);
    }
    return;
  }
#pragma unroll 1
  for (int r = first + r0; r < first + 16; r += kRowsPerRound) {
    const int j = n0 + r;
    const bool valid = j < end && c < p.head_dim;
    i64 k_at = 0, v_at = 0;
    if (valid) {
      const int at = PAGED ? cache.clamp_row(rows[r]) : 0, pos = cache.pos_of(j);
      k_at = at * p.k_strides[0] + pos * p.k_strides[1] + c;
      v_at = at * p.v_strides[0] + pos * p.v_strides[1] + c;
    }
    cp_async_16_stream(sK + Tr::at(r, c), k + k_at, valid);
    cp_async_16_stream(sV + Tr::at(r, c), v + v_at, valid);
  }
}

// Paged: the block-table entries of this warp's 16 keys of the block at n0 (lanes 0-15, one key
// each; zeros past `end`) copied into `entries` by cp.async, in the commit group issued next, so
// no warp waits on a table load (the copies of a block wait only for their own group).
template <bool PAGED>
__device__ __forceinline__ void copy_table_entries(const CacheRows<PAGED>& cache, int n0, int end, int* entries) {
  if constexpr (PAGED) {
    const int lane = threadIdx.x % 32, r = threadIdx.x / 32 * 16 + lane, j = n0 + r;
    if (lane < 16) cp_async_4(entries + r, cache.table + (j < end ? cache.page_of(j) : 0), j < end);
  }
}

// The keys one CTA reads: its rows' band over the sequence's cache, and its split's key blocks
// [b_begin, b_end), an equal share of the sequence's own range (decided on the device, so one
// launch serves any lengths).
struct DecodeSpan {
  int length;                    // keys in the cache after the append
  CacheBand band;
  int key_first, key_last;       // keys any row of the block sees
  int common_first, common_last; // keys every row sees: blocks inside skip the per-element mask
  int b_begin, b_end;
};

__device__ __forceinline__ DecodeSpan decode_span(const DecodeParams& p, int seq, int split, int row0, int rows, int group, int block_n) {
  DecodeSpan d;
  d.length = cache_length(p, seq);
  d.band = CacheBand{d.length - p.seqlen_q, p.window_left, p.window_right, d.length};
  const int token_first = row0 / group, token_last = (min(row0 + kDecodeRows, rows) - 1) / group;
  d.key_first = d.band.first(token_first), d.key_last = d.band.last(token_last);
  d.common_first = d.band.first(token_last), d.common_last = d.band.last(token_first);
  d.b_begin = d.b_end = 0;
  if (d.key_last >= d.key_first) {
    const int b_first = d.key_first / block_n, blocks = d.key_last / block_n - b_first + 1;
    const int per_split = (blocks + p.num_splits - 1) / p.num_splits;
    d.b_begin = b_first + min(split * per_split, blocks);
    d.b_end = b_first + min((split + 1) * per_split, blocks);
  }
  return d;
}

// Before the wait for the grid ahead on the stream (a dependent launch: common/dependent_launch.cuh):
// the first p.prefetch_blocks key blocks of this CTA's split, K and V, pulled into L2 while that
// grid finishes (the previous call's merge, this call's append, a caller's kernel that lets the
// next grid start early); without a dependent launch the loads that follow at once find them
// in flight. The span comes from lengths and pages read before that grid's writes are visible,
// so it may be stale: then other keys of the cache are prefetched (every address is clamped into
// it, as the loads' are), never a wrong value loaded; the loads that count come after the wait.
// A paged cache's prefetch waits for its block-table reads, so the host asks for it only under a
// dependent launch (cuattn/kernels/decode.py prefetch_blocks).
template <typename T, bool PAGED, int BLOCK_N, int THREADS>
__device__ __forceinline__ void prefetch_first_blocks(const DecodeParams& p, int seq, int kv_head, const DecodeSpan& d) {
  const CacheRows<PAGED> cache(p, seq);  // its cache row (cache_batch_idx) read before the wait too: for prefetches only
  const i64 row = PAGED ? 0 : cache.row;
  const T* k = static_cast<const T*>(p.k) + (row * p.k_strides[0] + kv_head * p.k_strides[2]);
  const T* v = static_cast<const T*>(p.v) + (row * p.v_strides[0] + kv_head * p.v_strides[2]);
  const int lines = (p.head_dim * int(sizeof(T)) + 127) / 128;  // 128-byte lines of a key's row
  const int n0 = d.b_begin * BLOCK_N, n_end = min(min(d.b_end, d.b_begin + p.prefetch_blocks) * BLOCK_N, d.length);
  for (int i = threadIdx.x; i < (n_end - n0) * lines; i += THREADS) {
    const int j = n0 + i / lines, column = i % lines * (128 / int(sizeof(T)));
    const i64 page = PAGED ? cache.clamp_row(cache.table_entry(j)) : 0;
    const i64 pos = cache.pos_of(j);
    prefetch_l2(k + page * p.k_strides[0] + pos * p.k_strides[1] + column);
    prefetch_l2(v + page * p.v_strides[0] + pos * p.v_strides[1] + column);
  }
}

template <typename T, int HEAD_DIM, int STAGES, bool PAGED, bool SOFTCAP, bool RUNS = false, int WARPS = kDecodeWarps>
__global__ void __launch_bounds__(WARPS * 32, 1) decode_kernel(const __grid_constant__ DecodeParams p) {
  static_assert(!RUNS || HEAD_DIM >= 96, "runs of copies from head_dim 96");
  using Tr = DecodeTraits<HEAD_DIM, STAGES, WARPS>;
  constexpr int kBlockN = Tr::kBlockN;
  constexpr int kDTiles = HEAD_DIM / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK_ring = sQ + Tr::kSmemQ;
  T* sV_ring = sK_ring + STAGES * Tr::kSmemKV;

  const int seq = blockIdx.z, split = blockIdx.x;
  const int kv_head = blockIdx.y % p.heads_kv, row_block = blockIdx.y / p.heads_kv;
  const int group = p.heads_q / p.heads_kv, rows = group * p.seqlen_q;
  const int row0 = row_block * kDecodeRows;
  if (row0 >= rows) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  if (row_block == 0 && p.prefetch_blocks > 0) prefetch_first_blocks<T, PAGED, kBlockN, Tr::kThreads>(p, seq, kv_head, decode_span(p, seq, split, row0, rows, group, kBlockN));

  wait_for_previous_grid();  // the append (or the caller's kernel) wrote the cache, q and maybe the index arrays
  allow_next_grid();         // decode_combine may launch now; its CTAs wait for this grid to finish
  // Nothing read before the wait is used below: lengths, pages and the cache row are read again.
  const CacheRows<PAGED> cache(p, seq);
  const i64 cache_row = PAGED ? 0 : cache.row;  // contiguous: the sequence's row, once
  const T* k_seq = static_cast<const T*>(p.k) + (cache_row * p.k_strides[0] + kv_head * p.k_strides[2]);
  const T* v_seq = static_cast<const T*>(p.v) + (cache_row * p.v_strides[0] + kv_head * p.v_strides[2]);
  const DecodeSpan span = decode_span(p, seq, split, row0, rows, group, kBlockN);
  const int length = span.length;
  const CacheBand band = span.band;
  const int key_first = span.key_first, key_last = span.key_last, common_first = span.common_first, common_last = span.common_last;
  const int b_begin = span.b_begin, b_end = span.b_end;

  const T* q = static_cast<const T*>(p.q) + seq * p.q_strides[0];
  int* s_entries = reinterpret_cast<int*>(sV_ring + STAGES * Tr::kSmemKV);  // paged: a block's table entries, by block % STAGES
  const auto entries_of = [&](int n_block) { return s_entries + n_block % STAGES * kBlockN; };
  const auto copy_entries = [&](int n_block) {
    if (PAGED && n_block < b_end) copy_table_entries<PAGED>(cache, n_block * kBlockN, length, entries_of(n_block));
  };
  const auto load_block = [&](int n_block, int slot) {
    load_kv_rows<T, Tr, PAGED, RUNS>(sK_ring + slot * Tr::kSmemKV, sV_ring + slot * Tr::kSmemKV, p, cache, k_seq, v_seq,
                                             n_block * kBlockN, length, entries_of(n_block));
  };

  float acc[1][kDTiles][4];
  float row_max[1][2], row_sum[1][2];
#pragma unroll
  for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[0][dt][e] = 0.f;
  row_max[0][0] = row_max[0][1] = neg_inf();
  row_sum[0][0] = row_sum[0][1] = 0.f;

  // The ring: blocks b_begin .. b_begin + STAGES - 2 in flight before the loop (Q with the
  // first); each iteration waits for its block and refills the slot freed one iteration ago.
  // Each warp copies and reads only its own 16 keys of every block, so after Q the warps never
  // wait for each other (a warp's barrier per block, not the CTA's). Paged: the table entries
  // of block b travel in the commit group of block b - (STAGES - 1), so they have landed when
  // the wait for that block returns, the iteration that issues block b's copies; the first
  // STAGES - 1 blocks' entries are waited for here.
  if (PAGED) {
    for (int i = 0; i < STAGES - 1; ++i) copy_entries(b_begin + i);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
  }
  if (b_end > b_begin) {
    for (int i = threadIdx.x; i < kDecodeRows * Tr::kChunksPerRow; i += Tr::kThreads) {
      const int r = i / Tr::kChunksPerRow, c = (i % Tr::kChunksPerRow) * 8, row = row0 + r;
      const bool valid = row < rows && c < p.head_dim;
      const T* src = valid ? q + (row / group) * p.q_strides[1] + (kv_head * group + row % group) * p.q_strides[2] + c : q;
      cp_async_16(sQ + Tr::at(r, c), src, valid);
    }
  }
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (b_begin + i < b_end) load_block(b_begin + i, i);
    if (PAGED) {
      __syncwarp();  // every lane read block b_begin + i - 1's entries (the slot refilled next) before
      copy_entries(b_begin + i + STAGES - 1);
    }
    cp_async_commit();
  }

  // Q as A fragments, in registers for the whole key loop where they fit (kQInRegisters).
  constexpr bool kQInRegisters = HEAD_DIM <= 160;
  u32 q_frag[kQInRegisters ? HEAD_DIM / 16 : 1][4];
  const auto q_fragment = [&](int kk, u32(&a)[4]) {
    ldmatrix_x4(a, sQ + Tr::at((lane % 8) + ((lane / 8) % 2) * 8, kk + (lane / 16) * 8));
  };
  cp_async_wait<STAGES - 2>();
  __syncthreads();  // Q (copied by every warp) landed
  if (kQInRegisters && b_end > b_begin) {
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM; kk += 16) q_fragment(kk, q_frag[kQInRegisters ? kk / 16 : 0]);
  }

  for (int n_block = b_begin, slot = 0; n_block < b_end; ++n_block, slot = slot + 1 == STAGES ? 0 : slot + 1) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();  // this warp's keys of block n_block and entries of block `ahead` landed; its lanes finished with the slots refilled next
    const int ahead = n_block + STAGES - 1;
    if (ahead < b_end) load_block(ahead, slot == 0 ? STAGES - 1 : slot - 1);
    copy_entries(ahead + STAGES - 1);  // into the slot of block ahead - 1, whose copies went an iteration ago
    cp_async_commit();
    const int n0 = n_block * kBlockN + warp * 16;  // this warp's 16 keys
    if (n0 > key_last || n0 + 16 <= key_first) continue;
    const T* sK = sK_ring + slot * Tr::kSmemKV + warp * 16 * Tr::kRowStride;
    const T* sV = sV_ring + slot * Tr::kSmemKV + warp * 16 * Tr::kRowStride;

    // S = Q K^T as two independent chains of products (even and odd 16-column steps), summed.
    float s[1][2][4] = {}, s_odd[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM; kk += 16) {
      u32 a_loaded[4], b[4];
      if (!kQInRegisters) q_fragment(kk, a_loaded);
      const u32(&a)[4] = kQInRegisters ? q_frag[kQInRegisters ? kk / 16 : 0] : a_loaded;
      ldmatrix_x4(b, sK + Tr::at((lane % 8) + (lane / 16) * 8, kk + ((lane / 8) % 2) * 8));
      float(&chain)[2][4] = (kk / 16) % 2 == 0 ? s[0] : s_odd;
      mma_16816<T>(chain[0], a, b[0], b[1]);
      mma_16816<T>(chain[1], a, b[2], b[3]);
    }
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][nt][e] += s_odd[nt][e];
    if (SOFTCAP) {
      const float pre = p.scale / p.softcap;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[0][nt][e] = p.softcap * tanhf(s[0][nt][e] * pre);
    }
    if (n0 < common_first || n0 + 15 > common_last) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int token = min(row0 + g + h * 8, rows - 1) / group;
        const int lo = band.first(token), hi = band.last(token);
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int key = n0 + nt * 8 + 2 * t4 + e;
            if (key < lo || key > hi) s[0][nt][2 * h + e] = neg_inf();
          }
      }
    }
    online_softmax(s, row_max, row_sum, acc, p.exp2_scale);

    u32 a[4];
    c_tiles_to_a<T>(s[0], 0, a);  // P (16 rows x this warp's 16 keys) as the A operand
#pragma unroll
    for (int dt = 0; dt < kDTiles; dt += 2) {
      u32 b[4];
      ldmatrix_x4_trans(b, sV + Tr::at((lane % 8) + ((lane / 8) % 2) * 8, dt * 8 + (lane / 16) * 8));
      mma_16816<T>(acc[0][dt], a, b[0], b[1]);
      mma_16816<T>(acc[0][dt + 1], a, b[2], b[3]);
    }
  }

  // Combine the warps: each row's shift and sum per warp, and its unnormalized output, in fp32
  // through the (now idle) K/V ring.
  cp_async_wait<0>();
  __syncthreads();
  float* sO = reinterpret_cast<float*>(sK_ring);
  float* s_shift = reinterpret_cast<float*>(sQ);  // WARPS x 16, then the sums
  float* s_sum = s_shift + WARPS * kDecodeRows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_sum[0][h];
    l += __shfl_xor_sync(0xffffffff, l, 1);
    l += __shfl_xor_sync(0xffffffff, l, 2);
    const int r = g + h * 8;
    if (t4 == 0) {
      s_shift[warp * kDecodeRows + r] = row_max[0][h] == neg_inf() ? neg_inf() : row_max[0][h] * p.exp2_scale;
      s_sum[warp * kDecodeRows + r] = l;
    }
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt)
#pragma unroll
      for (int e = 0; e < 2; ++e) sO[(warp * kDecodeRows + r) * Tr::kPartialStride + dt * 8 + 2 * t4 + e] = acc[0][dt][2 * h + e];
  }
  __syncthreads();

  const int rows_here = min(kDecodeRows, rows - row0);
  for (int i = threadIdx.x; i < rows_here * HEAD_DIM; i += Tr::kThreads) {
    const int r = i / HEAD_DIM, c = i % HEAD_DIM;
    float shift = neg_inf();
#pragma unroll
    for (int w = 0; w < WARPS; ++w) shift = fmaxf(shift, s_shift[w * kDecodeRows + r]);
    float l = 0.f, o = 0.f;
    if (shift != neg_inf()) {
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float wshift = s_shift[w * kDecodeRows + r];
        const float f = wshift == neg_inf() ? 0.f : exp2f(wshift - shift);
        l += f * s_sum[w * kDecodeRows + r];
        o += f * sO[(w * kDecodeRows + r) * Tr::kPartialStride + c];
      }
    }
    const int row = row0 + r, token = row / group, head = kv_head * group + row % group;
    // The sink joins the last step: here with one split, else decode_combine.
    const RowTotal total = normalize_row(shift, l, p.num_splits == 1 ? sink_of(p.sink, head) : neg_inf());
    o *= total.inv;
    const float lse = total.lse;
    if (p.num_splits == 1) {
      if (c < p.head_dim) {
        T* out = static_cast<T*>(p.out);
        out[seq * p.out_strides[0] + token * p.out_strides[1] + head * p.out_strides[2] + c] = from_float<T>(o);
      }
      if (c == 0 && p.lse != nullptr) p.lse[seq * p.lse_strides[0] + head * p.lse_strides[1] + token] = lse;
    } else {
      const i64 partial_row = ((i64(split) * p.batch + seq) * p.seqlen_q + token) * p.heads_q + head;
      if (c < p.head_dim) p.partial_out[partial_row * p.head_dim + c] = o;
      if (c == 0) p.partial_lse[((i64(split) * p.batch + seq) * p.heads_q + head) * p.seqlen_q + token] = lse;
    }
  }
}

}  // namespace cuattn
