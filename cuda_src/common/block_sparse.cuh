// Block-sparse attention (kernels compiled with SPARSE; dense layout): the score matrix of each
// (batch, head) is cut into kSparseBlock x kSparseBlock blocks and only the blocks its mask keeps
// are visited, the others cost nothing. The mask lists, per query block, its kept key blocks in
// ascending order (kv_block_counts / kv_block_indices, which the forward and dQ kernels follow)
// and, per key block, its kept query blocks (q_block_counts / q_block_indices, for dK / dV): the
// same mask twice, as FlexAttention's BlockMask. Kept blocks are masked per element by the
// causal / window band as usual. Counts are clamped to the blocks that exist and indices into
// them, so a malformed mask changes results but moves no access outside the tensors.
#pragma once
#include "params.cuh"

namespace cuattn {

constexpr int kSparseBlock = 128;

__device__ __forceinline__ int sparse_blocks(int rows) { return (rows + kSparseBlock - 1) / kSparseBlock; }

// Block indices past the last block address rows past the sequence, which the loads zero-fill
// and the masks hide (a malformed mask wastes work there); this bound keeps row numbers in int.
constexpr int kMaxBlockIndex = (1 << 30) / kSparseBlock;

// One row of a block list: the kept blocks of one query block (or key block), ascending.
struct BlockList {
  const int* indices;
  int count;

  __device__ __forceinline__ BlockList(const int* counts, const int* all_indices, const i64 (&strides)[2], int batch, int head, int row,
                                       int blocks) {
    const i64 entry = batch * strides[0] + head * strides[1] + row;
    indices = all_indices + entry * blocks;
    count = min(max(counts[entry], 0), blocks);
  }
  __device__ __forceinline__ int block(int i) const { return min(max(indices[i], 0), kMaxBlockIndex); }
};

// The key blocks query block `q_block` of (batch, head) keeps.
__device__ __forceinline__ BlockList kept_key_blocks(const AttnParams& p, int batch, int head, int q_block) {
  return BlockList(p.kv_block_counts, p.kv_block_indices, p.kv_block_strides, batch, head, q_block, sparse_blocks(p.seqlen_k));
}
// The query blocks key block `k_block` keeps for query head `head` of (batch).
__device__ __forceinline__ BlockList kept_query_blocks(const AttnParams& p, int batch, int head, int k_block) {
  return BlockList(p.q_block_counts, p.q_block_indices, p.q_block_strides, batch, head, k_block, sparse_blocks(p.seqlen_q));
}

// The tiles of TILE rows inside the blocks of a list that lie in tiles [first, last], in order
// from the last: tile(0) is the highest.
template <int TILE>
struct ListTiles {
  static_assert(kSparseBlock % TILE == 0, "tiles nest in mask blocks");
  static constexpr int kSub = kSparseBlock / TILE;
  BlockList list;
  int count, top, skip;  // tile(i) is the (i + skip)-th tile from the top of list entry `top` down

  __device__ __forceinline__ ListTiles(const BlockList& blocks, int n_first, int n_last) : list(blocks), count(0), top(-1), skip(0) {
    if (n_last < n_first) return;
    int lo = 0, hi = list.count - 1;
    while (lo <= hi && list.block(lo) < n_first / kSub) ++lo;
    while (hi >= lo && list.block(hi) > n_last / kSub) --hi;
    if (lo > hi) return;
    top = hi;
    skip = max(0, list.block(hi) * kSub + kSub - 1 - n_last);
    count = (hi - lo + 1) * kSub - skip - max(0, n_first - list.block(lo) * kSub);
  }
  __device__ __forceinline__ int tile(int i) const {
    const int j = i + skip;
    return list.block(top - j / kSub) * kSub + (kSub - 1 - j % kSub);
  }
};

// The key tiles of TILE keys that a block of query rows visits, last first (the partially
// masked diagonal comes first), as a cursor: the i-th visited tile n, from start(), while
// more(i, n), then next(i, n). Dense: every tile of [n_first, n_last] (the cursor is the tile
// itself: the dense loops compile as a plain countdown). SPARSE: the tiles of the kept key
// blocks of the rows' query block (rows m0 .. within one block) that lie in [n_first, n_last].
// ROWS: the caller's query tile, whose rows must lie in one mask block.
template <bool SPARSE, int TILE, int ROWS>
struct KeyTiles;

template <int TILE, int ROWS>
struct KeyTiles<false, TILE, ROWS> {
  int first, last;
  __device__ __forceinline__ KeyTiles(const AttnParams&, int, int, int, int n_first, int n_last) : first(n_first), last(n_last) {}
  __device__ __forceinline__ bool any() const { return last >= first; }
  __device__ __forceinline__ int start() const { return last; }
  __device__ __forceinline__ bool more(int, int n) const { return n >= first; }
  __device__ __forceinline__ bool has_next(int, int n) const { return n > first; }
  __device__ __forceinline__ int next(int, int n) const { return n - 1; }
};

template <int TILE, int ROWS>
struct KeyTiles<true, TILE, ROWS> : ListTiles<TILE> {
  static_assert(kSparseBlock % ROWS == 0, "query tiles nest in mask blocks");
  using ListTiles<TILE>::count;
  using ListTiles<TILE>::tile;
  __device__ __forceinline__ KeyTiles(const AttnParams& p, int batch, int head, int m0, int n_first, int n_last)
      : ListTiles<TILE>(kept_key_blocks(p, batch, head, m0 / kSparseBlock), n_first, n_last) {}
  // Indices are read only for tiles that exist: an empty list (no key blocks at all) has no
  // entry to read, and the loops ask for next() before more() stops them.
  __device__ __forceinline__ bool any() const { return count > 0; }
  __device__ __forceinline__ int start() const { return count > 0 ? tile(0) : 0; }
  __device__ __forceinline__ bool more(int i, int) const { return i < count; }
  __device__ __forceinline__ bool has_next(int i, int) const { return i + 1 < count; }
  __device__ __forceinline__ int next(int i, int) const { return i + 1 < count ? tile(i + 1) : 0; }
};

// Tiles in ascending order, tile(i) for i < count (the float32 kernels): every tile of
// [first, last], or (SPARSE) those of the block list `list()` returns that lie there.
struct AscendingRange {
  int first, count;
  __device__ __forceinline__ int tile(int i) const { return first + i; }
};
template <int TILE>
struct AscendingList : ListTiles<TILE> {
  using ListTiles<TILE>::ListTiles;
  __device__ __forceinline__ int tile(int i) const { return ListTiles<TILE>::tile(this->count - 1 - i); }
};
template <bool SPARSE, int TILE, typename ListFn>
__device__ __forceinline__ auto ascending_tiles(const ListFn& list, int first, int last) {
  if constexpr (SPARSE) {
    return AscendingList<TILE>(list(), first, last);
  } else {
    return AscendingRange{first, max(0, last - first + 1)};
  }
}

// The (query head, query block) steps of BLOCK_M rows that a key block streams under a block
// mask: for each query head of the KV head's group, the tiles of its kept query blocks. The
// interface of QuerySteps (backward/head_rows.cuh) without its split and band trimming: tiles
// the causal / window band hides are loaded, and their scores masked, like any other.
template <int BLOCK_M>
struct SparseQuerySteps {
  static_assert(kSparseBlock % BLOCK_M == 0, "query tiles nest in mask blocks");
  static constexpr int kSub = kSparseBlock / BLOCK_M;
  const AttnParams& a;
  int batch, head0, k_block, group, steps;  // head0: the group's first query head

  __device__ __forceinline__ SparseQuerySteps(const AttnParams& attn, int batch_, int kv_head, int n0)
      : a(attn), batch(batch_), k_block(n0 / kSparseBlock), group(attn.heads_q / attn.heads_kv), steps(0) {
    head0 = kv_head * group;
    for (int h = 0; h < group; ++h) steps += list(head0 + h).count * kSub;
  }
  __device__ __forceinline__ BlockList list(int head) const { return kept_query_blocks(a, batch, head, k_block); }
  // The query head of `step` and the step's index within that head's tiles.
  __device__ __forceinline__ int head(int, int step, int* index = nullptr) const {
    int head = head0;
    for (int tiles = list(head).count * kSub; step >= tiles && head + 1 < head0 + group; tiles = list(head).count * kSub) {
      step -= tiles;
      ++head;
    }
    if (index != nullptr) *index = step;
    return head;
  }
  __device__ __forceinline__ int m0(int step) const {
    int index;
    const BlockList blocks = list(head(0, step, &index));
    return blocks.block(index / kSub) * kSparseBlock + index % kSub * BLOCK_M;
  }
};

}  // namespace cuattn
