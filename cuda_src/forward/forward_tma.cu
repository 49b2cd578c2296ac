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
// SEVERAL (chosen by the host on short sequences): a CTA computes two or more row blocks of one
// (head, sequence) in turn (CtaRowBlocks below). The rings and their parities run on across its
// tiles, so the producer loads the next tile's first K block and Q while the consumers finish a
// tile and store its rows; Q's full barrier then has an empty one beside it, which the consumers
// release after their last S product where out is staged in a tile of its own (kOwnOutTile),
// else after the staged rows are stored. The registers are split once, before the first tile.
// Without SEVERAL the CTA runs its one row block as a whole (TmaRole::kWholeCta): the same code
// with the cross-tile state folded away, which keeps the key loop as lean as it was.
// Rows and keys past the tensors are zero-filled by the TMA unit; the band mask (KeyBand) hides
// keys past seqlen_k. LAYOUT: dense, or a KV cache (chunked prefill): contiguous (kCache: K and V
// mapped over the whole cache, each sequence's own row and length read on the device) or paged
// by one TMA box per page or part of one (kPagedCache: produce_paged), or, for pages too small for
// boxes and page sizes they cannot take, by copies (PAGE_COPY: produce_paged_copies; the host picks). There the rows of the last key
// block past the sequence are in the tensor, so the consumer warpgroups zero those V rows
// together before their P V products (zero_values_past), as P = 0 times stale cache contents
// may be NaN.
// The packed and dropout forms and other page sizes stay on forward_wgmma.cu. SPARSE: only the
// key blocks a block mask keeps (common/block_sparse.cuh), in the order both sides walk them;
// CTAs take their cells from the launch's schedule. FOLD: the result folded into an fp32
// accumulator (forward/accumulate.cuh; ring steps and streamed K/V), one row block per CTA.
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

template <int HEAD_DIM, int BLOCK_N, int STAGES, int CONSUMERS, bool SEVERAL = false>
struct TmaForwardTraits {
  static constexpr int kBlockM = 64 * CONSUMERS;            // 64 query rows per consumer warpgroup
  static constexpr int kConsumerThreads = 128 * CONSUMERS;
  static constexpr int kThreads = kConsumerThreads + 128;   // + the producer warpgroup (one thread issues)
  // setmaxnreg: 128 x producer + kConsumerThreads x consumer registers <= 65536
  static constexpr int kProducerRegisters = CONSUMERS == 2 ? 24 : 32;
  static constexpr int kConsumerRegisters = CONSUMERS == 2 ? 240 : 160;
  static constexpr int kStages = STAGES;
  static constexpr int kNTiles = BLOCK_N / 8;
  static constexpr int kDTiles = HEAD_DIM / 8;
  static constexpr int kColumnBlocks = HEAD_DIM / kSwizzleBlockElems;  // TMA boxes per tile
  static constexpr int kQBytes = kBlockM * HEAD_DIM * 2;
  static constexpr int kKVBytes = BLOCK_N * HEAD_DIM * 2;
  static constexpr int kRingBytes = 2 * STAGES * kKVBytes;
  static constexpr int kBarriers = 2 + 4 * STAGES;          // Q full, Q empty; K full, V full, K empty, V empty per slot
  // +1024: the dynamic shared memory is realigned to the swizzle period inside the kernel.
  static constexpr int kBaseBytes = kQBytes + kRingBytes + kSwizzleAtomBytes + kBarriers * 8;
  // Whether a CTA takes several row blocks in turn (CtaRowBlocks); its form costs 1-4% where it
  // takes one (the host picks), and with three consumers every other live value slows the loop.
  static constexpr bool kSeveralTiles = SEVERAL;
  // out is staged in a tile of its own where one fits (232448: sm_90's opt-in limit), so that the
  // next tile's Q can load while the consumers store; else in Q's tile.
  static constexpr bool kOwnOutTile = kSeveralTiles && kBaseBytes + kQBytes <= 232448;
  static constexpr int kSmemBytes = kBaseBytes + (kOwnOutTile ? kQBytes : 0);
  // From the swizzle-aligned base: Q's tile, out's (where it has its own), the K ring, the V ring,
  // then the barriers: Q full, K full and V full per slot, K empty and V empty per slot, Q empty.
  static constexpr int kKRingOffset = (kOwnOutTile ? 2 : 1) * kQBytes;
  static constexpr int kBarrierOffset = kKRingOffset + kRingBytes;

  static_assert(HEAD_DIM % 64 == 0 && HEAD_DIM <= 256, "whole column blocks (wgmma N of P V: common/wgmma.cuh)");
  static_assert(BLOCK_N == 64 || BLOCK_N == 128, "wgmma N of Q K^T");
  static_assert(CONSUMERS == 2 || CONSUMERS == 3, "the register split above");
  static_assert(!SEVERAL || CONSUMERS == 2, "several tiles per CTA with two consumer warpgroups");
};

constexpr int kBarTurn = 4;       // + warpgroup: its turn to issue (1 + wg: the epilogue's)
constexpr int kBarConsumers = 7;  // every consumer thread
static_assert(kBarTurn + 3 <= kBarConsumers, "named barriers: 1 + wg, kBarTurn + wg for up to 3 consumer warpgroups, then kBarConsumers");

// Where a CTA's rings stand: K / V blocks passed through them so far, and Q's fills.
struct TmaPipe {
  int blocks = 0, tiles = 0;
};

__device__ __forceinline__ unsigned char* swizzle_aligned(unsigned char* smem_raw) {
  return smem_raw + (kSwizzleAtomBytes - smem_addr(smem_raw) % kSwizzleAtomBytes) % kSwizzleAtomBytes;
}

// Q's tile, out's (Q's own where it has none of its own), the K and V rings, and their barriers:
// the layout of TmaForwardTraits from the swizzle-aligned base of the dynamic shared memory.
struct TmaTiles {
  unsigned char *q, *out, *k_ring, *v_ring;
  u64 *q_full, *k_full, *v_full, *k_empty, *v_empty, *q_empty;
};

template <typename Tr>
__device__ __forceinline__ TmaTiles tma_tiles(unsigned char* smem_raw) {
  unsigned char* q = swizzle_aligned(smem_raw);
  u64* q_full = reinterpret_cast<u64*>(q + Tr::kBarrierOffset);
  u64* k_full = q_full + 1;
  return {q, Tr::kOwnOutTile ? q + Tr::kQBytes : q, q + Tr::kKRingOffset, q + Tr::kKRingOffset + Tr::kStages * Tr::kKVBytes,
          q_full, k_full, k_full + Tr::kStages, k_full + 2 * Tr::kStages, k_full + 3 * Tr::kStages, k_full + 4 * Tr::kStages};
}

// Thread 0 initializes the barriers, then a CTA barrier: the full ones count the producer's one
// arrival (and the TMA bytes), the empty ones every consumer thread's.
// With PAGE_COPY the K / V full barriers count an arrival of each producer thread instead (once
// its copies have landed: produce_paged_copies).
template <typename Tr, bool PAGE_COPY = false>
__device__ __forceinline__ void init_tma_forward_barriers(const TmaTiles& t) {
  if (threadIdx.x == 0) {
    mbarrier_init(t.q_full, 1);
    for (int s = 0; s < Tr::kStages; ++s) {
      mbarrier_init(t.k_full + s, PAGE_COPY ? 128 : 1);
      mbarrier_init(t.v_full + s, PAGE_COPY ? 128 : 1);
      mbarrier_init(t.k_empty + s, Tr::kConsumerThreads);
      mbarrier_init(t.v_empty + s, Tr::kConsumerThreads);
    }
    mbarrier_init(t.q_empty, Tr::kConsumerThreads);
    mbarrier_init_fence();
  }
  __syncthreads();
}

// Who runs forward_tma_tile: the whole CTA on its only tile (it initializes the barriers and
// splits the registers between the warpgroups), or, on each of several tiles, one side of a CTA
// that did both before its first.
enum class TmaRole { kWholeCta, kProducer, kConsumers };

// Rows [first_row, BLOCK_N) of a V tile (128-byte-swizzled column blocks) set to zero by the
// consumer warpgroups together, each thread a share of the chunks, visible to every consumer's
// products (async proxy) once this returns. The consumers are threads [0, CONSUMER_THREADS):
// the whole-CTA role, which the cache layouts take.
template <int HEAD_DIM, int BLOCK_N, int CONSUMER_THREADS>
__device__ __forceinline__ void zero_values_past(unsigned char* tile, int first_row) {
  constexpr int kChunksPerRow = HEAD_DIM / 8;  // 16-byte chunks; a row of a column block is 8 of them
  for (int i = threadIdx.x; i < (BLOCK_N - first_row) * kChunksPerRow; i += CONSUMER_THREADS) {
    const int r = first_row + i / kChunksPerRow, c = i % kChunksPerRow;
    *reinterpret_cast<uint4*>(tile + (c / 8) * BLOCK_N * kSwizzleRowBytes + r * kSwizzleRowBytes + (c % 8) * 16) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier_sync(kBarConsumers, CONSUMER_THREADS);
}

// The producer's loads over a paged KV cache, by its first warp: a key block is BLOCK_N / box
// boxes of `box` = min(page size, BLOCK_N) rows (the host maps K and V as (pages, page size,
// heads, head_dim) with that box: page sizes that are multiples of 8 and divide BLOCK_N or are
// multiples of it), lane i looking up the page of box i in the block table (a block ahead) and
// issuing it; V_j reuses the pages looked up for K_j. Lane 0 loads Q and
// announces each slot's bytes before the lanes issue. Keys past the capacity (a last block that
// reaches past it) load the capacity's last page again: past the sequence, never used.
template <typename Tr, int BLOCK_N, int STAGES, typename BlockAt>
__device__ __forceinline__ void produce_paged(const TmaAttnParams& tp, int seq, int head, int m0, int blocks, const BlockAt& block_at,
                                              const TmaTiles& tiles) {
  const AttnParams& p = tp.attn;
  unsigned char *sQ = tiles.q, *sK_ring = tiles.k_ring, *sV_ring = tiles.v_ring;
  u64 *q_full = tiles.q_full, *k_full = tiles.k_full, *v_full = tiles.v_full, *k_empty = tiles.k_empty, *v_empty = tiles.v_empty;
  const int lane = threadIdx.x % 32, kv_head = head / (p.heads_q / p.heads_kv);
  const CacheRows<true> cache(p, seq);
  const int box = min(cache.page_size, BLOCK_N), boxes = BLOCK_N / box;
  // Block j's table entry is read one block ahead and clamped only where its loads are issued,
  // so the read's latency passes under the wait for a free slot.
  const auto key_at = [&](int j) { return min(block_at(j) * BLOCK_N + lane * box, p.capacity - 1); };  // this lane's box's first key
  const auto entry_of = [&](int j) { return lane < boxes && j < blocks ? cache.table_entry(key_at(j)) : 0; };
  const auto pos_at = [&](int j) { return cache.pos_of(key_at(j)) / box * box; };
  const auto load = [&](unsigned char* ring, const TensorMap* map, u64* full, u64* empty, int j, int pg, int ps) {
    const int s = j % STAGES;
    if (lane == 0) {
      mbarrier_wait(empty + s, ((j / STAGES) & 1) ^ 1);
      mbarrier_arrive_expect_bytes(full + s, Tr::kKVBytes);
    }
    __syncwarp();
    if (lane < boxes) {
#pragma unroll
      for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
        tma_load_4d(ring + s * Tr::kKVBytes + (cb * BLOCK_N + lane * box) * kSwizzleRowBytes, map, full + s, cb * kSwizzleBlockElems, ps,
                    kv_head, pg);
    }
  };
  int next_entry = entry_of(0);
  if (lane == 0) {
    mbarrier_arrive_expect_bytes(q_full, Tr::kQBytes);
#pragma unroll
    for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
      tma_load_4d(sQ + cb * Tr::kBlockM * kSwizzleRowBytes, &tp.q_map, q_full, cb * kSwizzleBlockElems, m0, head, seq);
  }
  int page = 0, pos = 0;  // this lane's box of the block whose K was loaded last
  for (int j = 0; j < blocks; ++j) {  // K_j, then V_{j-1} from the pages of K_{j-1}
    const int v_page = page, v_pos = pos;
    page = cache.clamp_row(next_entry);
    pos = pos_at(j);
    next_entry = entry_of(j + 1);
    load(sK_ring, &tp.k_map, k_full, k_empty, j, page, pos);
    if (j > 0) load(sV_ring, &tp.v_map, v_full, v_empty, j - 1, v_page, v_pos);
  }
  if (blocks > 0) load(sV_ring, &tp.v_map, v_full, v_empty, blocks - 1, page, pos);
}

// The producer's loads over a paged KV cache of any page size, by copies (PAGE_COPY): small pages
// make TMA boxes too small for the TMA unit to keep up (NOTES). The whole producer warpgroup
// copies, warp w the rows [w, w + 1) * BLOCK_N / 4 of every K and V block: lane i looks up the
// page of its warp's row i (a block ahead, as produce_paged does) and holds the row's address;
// each copy instruction takes 4 rows, one 64-bit shuffle of the address per row, 8 lanes a row's 128
// bytes of a column block (one whole line), written in the 128-byte swizzle the TMA unit would.
// The products read the copies through the async proxy, so each thread, once a block's copies
// have landed (cp.async groups: waited for one block behind, after the next block's are issued),
// fences the async proxy and then arrives on the slot's full barrier, which counts the 128
// threads (fenced by the consumers after their wait instead, the proxy fence cost them 3%).
// Columns past head_dim are zero-filled; keys past the capacity copy its last key again (past
// the sequence: never used). Q still comes by TMA, from the warpgroup's first thread.
template <typename Tr, int HEAD_DIM, int BLOCK_N, int STAGES, typename BlockAt>
__device__ __forceinline__ void produce_paged_copies(const TmaAttnParams& tp, int seq, int head, int m0, int blocks, const BlockAt& block_at,
                                                     const TmaTiles& tiles) {
  const AttnParams& p = tp.attn;
  constexpr int kRowsPerWarp = BLOCK_N / 4;
  static_assert(kRowsPerWarp <= 32 && kRowsPerWarp % 8 == 0, "a row per lane; whole swizzle periods per warp");
  // A block's barrier is arrived on only after the next block's slot is waited for: with one slot
  // that wait would need the consumers to finish a block not yet announced.
  static_assert(STAGES >= 2, "copies announced a block behind");
  const int pt = threadIdx.x - Tr::kConsumerThreads, lane = pt % 32, warp_row0 = pt / 32 * kRowsPerWarp;
  const int kv_head = head / (p.heads_q / p.heads_kv);
  const CacheRows<true> cache(p, seq);
  const auto key_at = [&](int j) { return min(block_at(j) * BLOCK_N + warp_row0 + lane % kRowsPerWarp, p.capacity - 1); };
  const auto entry_of = [&](int j) { return j < blocks ? cache.table_entry(key_at(j)) : 0; };
  // A copy instruction covers 4 rows, 8 lanes a row's 128 bytes of a column block: this lane's
  // chunk lc of rows 4 s + rg of the warp's share, whose swizzle is (4 s + rg) % 8 = rg ^ 4 (s & 1)
  // (warp_row0 is a multiple of 8).
  const u32 lc = u32(lane) % 8, rg = u32(lane) / 8;
  const u32 row_dst = (u32(warp_row0) + rg) * kSwizzleRowBytes;
  const u32 swizzled[2] = {row_dst + ((lc ^ rg) << 4), row_dst + ((lc ^ rg ^ 4) << 4)};
  u64* pending = nullptr;  // the full barrier of the copies committed last, not yet arrived on
  const auto announce = [&](int groups_in_flight) {  // pending's copies landed: fenced for the products, arrived
    if (groups_in_flight == 0) {
      cp_async_wait<0>();
    } else {
      cp_async_wait<1>();
    }
    fence_proxy_async();
    mbarrier_arrive(pending);
  };
  // Block j's rows into its slot of `ring`; row_offset: this lane's row, in elements from the
  // head's first. The slot's barrier is arrived on once the next block's copies are issued.
  const auto load = [&](unsigned char* ring, const void* base, i64 head_stride, u64* full, u64* empty, int j, i64 row_offset) {
    const int s = j % STAGES;
    mbarrier_wait(empty + s, ((j / STAGES) & 1) ^ 1);
    const u32 slot = smem_addr(ring + s * Tr::kKVBytes);
    const u64 row = reinterpret_cast<u64>(static_cast<const u16*>(base) + kv_head * head_stride + row_offset);
#pragma unroll
    for (int set = 0; set < kRowsPerWarp / 4; ++set) {
      const u16* row_src = reinterpret_cast<const u16*>(__shfl_sync(0xffffffff, row, int(4 * set + rg))) + lc * 8;
      const u32 dst = slot + swizzled[set & 1] + set * 4 * kSwizzleRowBytes;
#pragma unroll
      for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
        cp_async_16_or_zeros_at(dst + cb * BLOCK_N * kSwizzleRowBytes, row_src + cb * kSwizzleBlockElems,
                                cb * kSwizzleBlockElems + int(lc) * 8 < p.head_dim);
    }
    cp_async_commit();
    if (pending != nullptr) announce(1);
    pending = full + s;
  };
  if (pt == 0) {
    mbarrier_arrive_expect_bytes(tiles.q_full, Tr::kQBytes);
#pragma unroll
    for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
      tma_load_4d(tiles.q + cb * Tr::kBlockM * kSwizzleRowBytes, &tp.q_map, tiles.q_full, cb * kSwizzleBlockElems, m0, head, seq);
  }
  int next_entry = entry_of(0);
  i64 v_offset = 0;  // this lane's row of the block whose K was loaded last, in V
  for (int j = 0; j < blocks; ++j) {  // K_j, then V_{j-1}
    const i64 page = cache.clamp_row(next_entry), pos = cache.pos_of(key_at(j));
    next_entry = entry_of(j + 1);
    load(tiles.k_ring, p.k, p.k_strides[2], tiles.k_full, tiles.k_empty, j, page * p.k_strides[0] + pos * p.k_strides[1]);
    if (j > 0) load(tiles.v_ring, p.v, p.v_strides[2], tiles.v_full, tiles.v_empty, j - 1, v_offset);
    v_offset = page * p.v_strides[0] + pos * p.v_strides[1];
  }
  if (blocks > 0) load(tiles.v_ring, p.v, p.v_strides[2], tiles.v_full, tiles.v_empty, blocks - 1, v_offset);
  if (pending != nullptr) announce(0);
}

// One row block of a CTA: the producer thread's loads, or the consumers' products, softmax and
// stores.
template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, int CONSUMERS, bool SOFTCAP, bool SPARSE, TmaRole ROLE,
          SeqLayout LAYOUT = SeqLayout::kDense, bool FOLD = false, bool PAGE_COPY = false>
__device__ __forceinline__ void forward_tma_tile(const TmaAttnParams& tp, int seq, int head, const SeqSpan& span, int m_block,
                                                 unsigned char* smem_raw, TmaPipe& pipe) {
  using Tr = TmaForwardTraits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, ROLE != TmaRole::kWholeCta>;
  // The producer's copies (PAGE_COPY) need more than 24 registers: with two consumer warpgroups
  // 128 x 40 + 256 x 232 = 64512, the 168 x 384 the launch gives the CTA (three: 128 x 32 +
  // 384 x 160 = 65536 either way).
  constexpr int kProducerRegisters = PAGE_COPY && CONSUMERS == 2 ? 40 : Tr::kProducerRegisters;
  constexpr int kConsumerRegisters = PAGE_COPY && CONSUMERS == 2 ? 232 : Tr::kConsumerRegisters;
  static_assert(128 * kProducerRegisters + Tr::kConsumerThreads * kConsumerRegisters <= 65536 / Tr::kThreads / 8 * 8 * Tr::kThreads,
                "registers the consumers' setmaxnreg.inc can take: what the launch gives the CTA");
  const AttnParams& p = tp.attn;
  const TmaTiles buf = tma_tiles<Tr>(smem_raw);
  unsigned char *sQ = buf.q, *sOut = buf.out, *sK_ring = buf.k_ring, *sV_ring = buf.v_ring;
  u64 *q_full = buf.q_full, *k_full = buf.k_full, *v_full = buf.v_full, *k_empty = buf.k_empty, *v_empty = buf.v_empty, *q_empty = buf.q_empty;

  const int m0 = m_block * Tr::kBlockM;
  const int m_last = min(m0 + Tr::kBlockM, span.seqlen_q) - 1;
  const KeyBand band(p, span);
  const int key_first = band.first_key(m0), key_last = band.last_key(m_last);
  const int n_first = key_first / BLOCK_N;
  const int n_last = key_last < key_first ? n_first - 1 : key_last / BLOCK_N;
  // The key blocks visited, block_at(0) .. block_at(blocks - 1): n_last, n_last - 1, ... (the
  // diagonal first), or the mask's kept ones among them, likewise last first.
  const KeyTiles<SPARSE, BLOCK_N, Tr::kBlockM> tiles(p, seq, head, m0, n_first, n_last);
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
  // Ring position i = done + j of the tile's block j; with several tiles every tile loads Q (so
  // that out staged in Q's tile never meets a later tile's Q), with one only a tile with keys.
  const int done = Tr::kSeveralTiles ? pipe.blocks : 0;
  const bool loads_q = Tr::kSeveralTiles || blocks > 0;
  const u32 q_parity = Tr::kSeveralTiles ? u32(pipe.tiles & 1) : 0;
  const auto advance = [&] {
    if (Tr::kSeveralTiles) {
      pipe.blocks += max(blocks, 0);
      ++pipe.tiles;
    }
  };

  if (ROLE == TmaRole::kWholeCta) init_tma_forward_barriers<Tr, PAGE_COPY>(buf);

  if (ROLE == TmaRole::kProducer || (ROLE == TmaRole::kWholeCta && threadIdx.x >= Tr::kConsumerThreads)) {
    // The producer warpgroup: one thread issues the TMA loads (a warp over paged caches); with
    // PAGE_COPY every thread copies rows.
    if (ROLE == TmaRole::kWholeCta) set_max_registers_dec<kProducerRegisters>();
    if constexpr (PAGE_COPY) {
      if (loads_q) produce_paged_copies<Tr, HEAD_DIM, BLOCK_N, STAGES>(tp, seq, head, m0, blocks, block_at, buf);
    } else if constexpr (LAYOUT == SeqLayout::kPagedCache) {
      if (threadIdx.x / 32 == Tr::kConsumerThreads / 32 && loads_q) {
        produce_paged<Tr, BLOCK_N, STAGES>(tp, seq, head, m0, blocks, block_at, buf);
      }
    } else if (threadIdx.x == Tr::kConsumerThreads && loads_q) {
      const int kv_head = head / (p.heads_q / p.heads_kv);
      const auto load_tile = [&](unsigned char* dst, const TensorMap* map, u64* bar, int rows, int row0, int h) {
#pragma unroll
        for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
          tma_load_4d(dst + cb * rows * kSwizzleRowBytes, map, bar, cb * kSwizzleBlockElems, row0, h, span.k_batch);
      };
      const auto load_k = [&](int j) {
        const int i = done + j, s = i % STAGES;
        mbarrier_wait(k_empty + s, ((i / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_bytes(k_full + s, Tr::kKVBytes);
        load_tile(sK_ring + s * Tr::kKVBytes, &tp.k_map, k_full + s, BLOCK_N, block_at(j) * BLOCK_N, kv_head);
      };
      const auto load_v = [&](int j) {
        const int i = done + j, s = i % STAGES;
        mbarrier_wait(v_empty + s, ((i / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_bytes(v_full + s, Tr::kKVBytes);
        load_tile(sV_ring + s * Tr::kKVBytes, &tp.v_map, v_full + s, BLOCK_N, block_at(j) * BLOCK_N, kv_head);
      };
      // K of the first block before Q: its slot frees while the consumers finish the tile before.
      if (Tr::kSeveralTiles && blocks > 0) load_k(0);
      if (Tr::kSeveralTiles) mbarrier_wait(q_empty, q_parity ^ 1);
      mbarrier_arrive_expect_bytes(q_full, Tr::kQBytes);
#pragma unroll
      for (int cb = 0; cb < Tr::kColumnBlocks; ++cb)
        tma_load_4d(sQ + cb * Tr::kBlockM * kSwizzleRowBytes, &tp.q_map, q_full, cb * kSwizzleBlockElems, m0, head, seq);
      for (int j = Tr::kSeveralTiles ? 1 : 0; j < blocks; ++j) {
        load_k(j);
        if (j > 0) load_v(j - 1);
      }
      if (blocks > 0) load_v(blocks - 1);
    }
    advance();
    return;  // no CTA barrier follows
  }

  if (ROLE == TmaRole::kWholeCta) set_max_registers_inc<kConsumerRegisters>();
  const HeadView<T> head_view(p, seq, head, span);
  const int wg = threadIdx.x / 128, warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warp_first_row = m0 + wg * 64 + warp * 16;
  const int warp_last_row = min(warp_first_row + 16, span.seqlen_q) - 1;

  float acc[1][Tr::kDTiles][4] = {};
  float row_max[1][2] = {{neg_inf(), neg_inf()}}, row_sum[1][2] = {{0.f, 0.f}};
  if (Tr::kSeveralTiles) mbarrier_wait(q_full, q_parity);

  if (blocks > 0) {
    float s[1][Tr::kNTiles][4];
    u32 probs[BLOCK_N / 16][4];  // P of the block before, packed: the A operand of its P V product
    const u32 q_addr = smem_addr(sQ);
    const auto slot = [&](int j) { return (done + j) % STAGES; };
    const auto parity = [&](int j) { return u32(((done + j) / STAGES) & 1); };
    const auto issue_scores = [&](int j) {
      wgmma_fence();
      wgmma_rows_by_rows<T, BLOCK_N, HEAD_DIM>(s[0], q_addr, Tr::kBlockM, wg * 64, smem_addr(sK_ring + slot(j) * Tr::kKVBytes));
      wgmma_commit();
    };
    const auto issue_values = [&](int j) {  // O += P V of block j (P in probs)
      wgmma_fence();
      wgmma_regs_by_tile<T, BLOCK_N, HEAD_DIM>(acc[0], probs, smem_addr(sV_ring + slot(j) * Tr::kKVBytes));
      wgmma_commit();
    };
    const auto probabilities = [&](int n0, float (&alpha)[1][2]) {
      fence_registers(s[0]);
      if (SOFTCAP) softcap_scores(s, p);
      if (!band.all_visible(warp_first_row, warp_last_row, n0, n0 + BLOCK_N - 1)) mask_scores(s, band, warp_first_row, n0);
      return softmax_block(s, row_max, row_sum, p.exp2_scale, [&](int, int h, float a) { alpha[0][h] = a; });
    };
    const auto wait_keys = [&](int j) {  // K of block j in, and usable
      mbarrier_wait(k_full + slot(j), parity(j));
    };
    const auto wait_values = [&](int j) {  // V of block j in, and usable
      mbarrier_wait(v_full + slot(j), parity(j));
      if constexpr (LAYOUT != SeqLayout::kDense) {  // only the first block visited reaches past the sequence
        const int past = span.seqlen_k - block_at(0) * BLOCK_N;
        if (j == 0 && past < BLOCK_N) zero_values_past<HEAD_DIM, BLOCK_N, Tr::kConsumerThreads>(sV_ring + slot(0) * Tr::kKVBytes, past);
      }
    };
    const auto take_turn = [&] { named_barrier_sync(kBarTurn + wg, 256); };
    const auto pass_turn = [&] { named_barrier_arrive(kBarTurn + (wg + 1) % CONSUMERS, 256); };

    if (wg == CONSUMERS - 1) pass_turn();  // warpgroup 0 goes first
    if (!Tr::kSeveralTiles) mbarrier_wait(q_full, 0);
    wait_keys(0);
    take_turn();
    issue_scores(0);
    pass_turn();
    wgmma_wait<0>();
    mbarrier_arrive(k_empty + slot(0));
    float alpha[1][2];
    probabilities(block_at(0) * BLOCK_N, alpha);  // O is still zero: nothing to rescale
    pack_a_operands<T, BLOCK_N>(probs, s[0]);
    for (int j = 1; j < blocks; ++j) {
      wait_keys(j);
      wait_values(j - 1);
      take_turn();
      issue_scores(j);
      issue_values(j - 1);
      pass_turn();
      wgmma_wait<1>();  // S only: groups complete in order
      mbarrier_arrive(k_empty + slot(j));
      const bool rescale = probabilities(block_at(j) * BLOCK_N, alpha);
      wgmma_wait<0>();
      mbarrier_arrive(v_empty + slot(j - 1));
      rescale_and_pack<T, BLOCK_N>(acc, probs, s, rescale, alpha);
    }
    wait_values(blocks - 1);
    issue_values(blocks - 1);
    wgmma_wait<0>();
    fence_registers(acc[0]);
    fence_registers(probs);
    if (Tr::kSeveralTiles) mbarrier_arrive(v_empty + slot(blocks - 1));
    if (wg == 0) take_turn();  // the last warpgroup's last pass: every arrival at a turn barrier is matched
  }
  if (Tr::kSeveralTiles && Tr::kOwnOutTile) mbarrier_arrive(q_empty);  // Q is read by the S products alone

  // Epilogue: normalize, stage the rows and store them (forward/staged_out.cuh). The barrier
  // keeps a warpgroup's staging from overtaking its own stores of the tile before.
  if (Tr::kSeveralTiles && pipe.tiles > 0) named_barrier_sync(1 + wg, 128);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const RowTotal total = finish_row(row_max[0][h], row_sum[0][h], p.exp2_scale, head_view.sink);
    const int r = wg * 64 + warp * 16 + g + h * 8;  // row of the CTA's tile
    if constexpr (FOLD) {
      fold_out_row<T, Tr::kBlockM>(sOut, acc[0], h, r, total.inv, total.lse, p, head_view.lse, head_view.accum, m0 + r, m0 + r < span.seqlen_q);
    } else {
      stage_out_row<T, Tr::kBlockM>(sOut, acc[0], h, r, total.inv);
      if (t == 0 && m0 + r < span.seqlen_q && head_view.lse != nullptr) head_view.lse[m0 + r] = total.lse;
    }
  }
  if (!FOLD || p.out != nullptr) {  // a folding launch writes out only for a row's last piece
    store_staged_rows<T, Tr::kBlockM, HEAD_DIM>(sOut, head_view.out, p.out_strides[1], m0, wg, span.seqlen_q, p.head_dim);
  }
  if (Tr::kSeveralTiles && !Tr::kOwnOutTile) {  // out was staged in Q's tile, which the next Q's TMA overwrites
    fence_proxy_async();
    mbarrier_arrive(q_empty);
  }
  advance();
}

// The row blocks of a CTA, r = 0, 1, ...: the (head, sequence)'s row blocks are cut among
// gridDim.x CTAs in rounds, CTA x taking block x of even rounds and block gridDim.x - 1 - x of odd
// ones (counted from the last, heaviest under a causal mask), so that under a causal mask each
// pair of rounds gives every CTA about the same work; -1 past the blocks (round 0 never is).
template <int BLOCK_M>
struct CtaRowBlocks {
  int x, ctas, row_blocks, rounds;
  __device__ CtaRowBlocks(int x_, int seqlen_q) : x(x_), ctas(int(gridDim.x)), row_blocks((seqlen_q + BLOCK_M - 1) / BLOCK_M) {
    rounds = (row_blocks + ctas - 1) / ctas;
  }
  __device__ int at(int r) const {
    const int index = r * ctas + (r % 2 == 0 ? x : ctas - 1 - x);
    return index < row_blocks ? row_blocks - 1 - index : -1;
  }
  // tile(m_block) for each of the CTA's row blocks, in turn. (A member template taking a plain
  // lambda: NVRTC 12.x and 13.0-13.1 refuse generic lambdas in device code.)
  template <class Tile>
  __device__ __forceinline__ void for_each(Tile&& tile) const {
    for (int r = 0; r < rounds; ++r) {
      const int m_block = at(r);
      if (m_block >= 0) tile(m_block);
    }
  }
};

/// \brief Attention forward with TMA loads from a producer warpgroup: CTAs of (head, sequence)
/// on grid (y, z), each taking one block of 64 x CONSUMERS query rows, or with kSeveralTiles
/// one or more in turn (CtaRowBlocks), heaviest first. Dense layout or a contiguous KV cache.
template <typename T, int HEAD_DIM, int BLOCK_N, int STAGES, int CONSUMERS, bool SOFTCAP, bool SPARSE = false, bool SEVERAL = false,
          SeqLayout LAYOUT = SeqLayout::kDense, bool FOLD = false, bool PAGE_COPY = false>
__global__ void __launch_bounds__(TmaForwardTraits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, SEVERAL>::kThreads, 1)
    forward_tma_kernel(const __grid_constant__ TmaAttnParams tp) {
  using Tr = TmaForwardTraits<HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, SEVERAL>;
  static_assert(!(SEVERAL && SPARSE), "a block-sparse launch's schedule gives each CTA one row block");
  static_assert(LAYOUT == SeqLayout::kDense || ((LAYOUT == SeqLayout::kCache || LAYOUT == SeqLayout::kPagedCache) && !SEVERAL && !SPARSE),
                "the cache forms take one row block");
  static_assert(!FOLD || (LAYOUT == SeqLayout::kDense && !SEVERAL && !SPARSE), "the accumulating form: dense, one row block per CTA");
  static_assert(!PAGE_COPY || LAYOUT == SeqLayout::kPagedCache, "copies: paged caches");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  if (dynamic_smem_bytes() < Tr::kSmemBytes) __trap();  // launch contract
  if (threadIdx.x == Tr::kConsumerThreads) {
    tma_prefetch_map(&tp.q_map);
    if (!PAGE_COPY) {
      tma_prefetch_map(&tp.k_map);
      tma_prefetch_map(&tp.v_map);
    }
  }
  static_assert(!SPARSE || kSparseBlock % Tr::kBlockM == 0, "a CTA's rows within one mask block");
  const GridCell cell = grid_cell<SPARSE>(tp.attn);
  const int head = cell.y, seq = cta_batch(tp.attn);
  const SeqSpan span = seq_span<LAYOUT>(tp.attn, seq);
  TmaPipe pipe;
  if constexpr (Tr::kSeveralTiles) {
    // The registers are split once, outside the loop over tiles (ptxas spills when setmaxnreg
    // sits in a loop).
    init_tma_forward_barriers<Tr>(tma_tiles<Tr>(smem_raw));
    const CtaRowBlocks<Tr::kBlockM> row_blocks(cell.x, span.seqlen_q);
    if (threadIdx.x >= Tr::kConsumerThreads) {
      set_max_registers_dec<Tr::kProducerRegisters>();
      if (threadIdx.x == Tr::kConsumerThreads) {
        row_blocks.for_each([&](int m_block) {
          forward_tma_tile<T, HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, SOFTCAP, SPARSE, TmaRole::kProducer>(tp, seq, head, span, m_block, smem_raw,
                                                                                                        pipe);
        });
      }
    } else {
      set_max_registers_inc<Tr::kConsumerRegisters>();
      row_blocks.for_each([&](int m_block) {
        forward_tma_tile<T, HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, SOFTCAP, SPARSE, TmaRole::kConsumers>(tp, seq, head, span, m_block, smem_raw,
                                                                                                       pipe);
      });
    }
  } else {
    forward_tma_tile<T, HEAD_DIM, BLOCK_N, STAGES, CONSUMERS, SOFTCAP, SPARSE, TmaRole::kWholeCta, LAYOUT, FOLD, PAGE_COPY>(
        tp, seq, head, span, int(gridDim.x) - 1 - cell.x, smem_raw, pipe);
  }
}

}  // namespace cuattn
