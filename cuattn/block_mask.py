"""Block-sparse attention masks: which 128 x 128 blocks of the score matrix are computed.

A :class:`BlockMask` lists, for each (batch, head), the key blocks every query block keeps and,
the same mask transposed, the query blocks every key block keeps (the backward's dK / dV walk
that way), in the compact form of FlexAttention's ``BlockMask``: counts plus ascending
indices. Skipped blocks cost nothing in the forward or the backward; inside a kept block
every element is computed, subject to ``causal`` / ``window`` as usual (the kernels mask those
per element). Block (i, j) holds query rows ``128 i .. 128 i + 127`` and keys ``128 j ..``.

The builders here run on the host (NumPy) and return masks of NumPy arrays; move one to the
device of the attention call once, e.g. ``mask.to(cupy.asarray)``,
``mask.to(lambda a: torch.as_tensor(a, device="cuda"))`` or ``mask.to(jax.numpy.asarray)``,
and reuse it.
"""

from __future__ import annotations

import dataclasses
import numbers

import numpy as np

from cuattn import params
from cuattn.kernels import sparse

BLOCK_SIZE = sparse.MASK_BLOCK  # rows and keys per mask block (cuda_src/common/block_sparse.cuh kSparseBlock)
MIN_TILE_ROWS = 16  # the fewest rows a block-sparse kernel's CTA takes (the float32 kernels)
LAYOUT = "(batch or 1, heads_q or 1, query blocks, key blocks)"


def blocks(rows: int) -> int:
    """Mask blocks covering ``rows`` rows."""
    return -(-rows // BLOCK_SIZE)


@dataclasses.dataclass(frozen=True)
class BlockMask:
    """A block mask of a ``seqlen_q`` x ``seqlen_k`` attention, for every (batch, head) or one
    shared by all (leading dims of size 1). int32 arrays of one framework and device:

    - ``kv_counts`` ``(B, H, q_blocks)``, ``kv_indices`` ``(B, H, q_blocks, k_blocks)``: query
      block i keeps key blocks ``kv_indices[b, h, i, :kv_counts[b, h, i]]``, ascending;
    - ``q_counts`` ``(B, H, k_blocks)``, ``q_indices`` ``(B, H, k_blocks, q_blocks)``: the same
      mask from the key side.

    ``B`` is the call's batch or 1, ``H`` its ``heads_q`` or 1 (a GQA group's query heads may
    keep different blocks). Build one with :func:`from_dense`, :func:`from_callable` or a
    pattern builder; :meth:`check` verifies a hand-made one on the host. The kernels clamp
    counts to the blocks of a row and visit no block past the tensors (an index past them
    reads zeros, masked), so a malformed mask on the device gives wrong results but never an
    access outside the tensors.
    """

    kv_counts: object
    kv_indices: object
    q_counts: object
    q_indices: object
    seqlen_q: int | None  # None: those of the call it is passed to (the adapters' ops)
    seqlen_k: int | None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(B, H, q_blocks, k_blocks)``."""
        return tuple(int(n) for n in self.kv_indices.shape)

    @property
    def arrays(self) -> tuple:
        return self.kv_counts, self.kv_indices, self.q_counts, self.q_indices

    def to(self, convert) -> BlockMask:
        """The mask with ``convert`` applied to each of its arrays (to move it to a device or a
        framework); the converted arrays must stay int32. A mask of NumPy integer arrays is
        checked first (:meth:`check`, as int32): once on a device, its values are not read on
        the host again."""
        arrays = {name: getattr(self, name) for name in ARRAY_FIELDS}
        if all(isinstance(a, np.ndarray) and np.issubdtype(a.dtype, np.integer) for a in arrays.values()):
            narrow = {name: a.astype(np.int32) for name, a in arrays.items()}
            for name, a in arrays.items():
                if not np.array_equal(narrow[name], a):
                    raise ValueError(f"block_mask.{name} holds values outside int32")
            dataclasses.replace(self, **narrow).check()
            arrays = narrow  # what was checked is what moves (int64 NumPy masks arrive as int32)
        return dataclasses.replace(self, **{name: convert(a) for name, a in arrays.items()})

    def to_dense(self) -> np.ndarray:
        """Host bool array ``(B, H, q_blocks, k_blocks)``: which blocks are kept."""
        return _dense(_host(self.kv_counts), _host(self.kv_indices))

    def density(self) -> float:
        """Kept blocks over all blocks (per (batch, head), averaged)."""
        counts = _host(self.kv_counts)
        total = counts.shape[-1] * self.shape[-1]
        return float(counts.sum()) / (counts.shape[0] * counts.shape[1] * total) if total else 0.0

    def check(self) -> None:
        """ValueError unless the mask is well formed: shapes agree with the lengths, counts
        within the blocks, indices ascending and in range, and both lists the same mask
        (TypeError for arrays that are not int32)."""
        check_shapes(self)
        for counts, indices, which in ((self.kv_counts, self.kv_indices, "kv"), (self.q_counts, self.q_indices, "q")):
            counts, indices = _host(counts), _host(indices)
            for name, x in ((f"{which}_counts", counts), (f"{which}_indices", indices)):
                if x.dtype != np.int32:
                    raise TypeError(f"block_mask.{name} must be int32, got {x.dtype}")
            width = indices.shape[-1]
            if counts.size and (counts.min() < 0 or counts.max() > width):
                raise ValueError(f"block_mask.{which}_counts must be in [0, {width}]")
            valid = np.arange(width) < counts[..., None]
            if valid.any() and (indices[valid].min() < 0 or indices[valid].max() >= width):
                raise ValueError(f"block_mask.{which}_indices must be block indices in [0, {width})")
            ascending = np.diff(indices, axis=-1) > 0
            if not np.all(ascending | ~valid[..., 1:]):
                raise ValueError(f"block_mask.{which}_indices must be strictly ascending within each row's count")
        if not np.array_equal(_dense(_host(self.q_counts), _host(self.q_indices)), self.to_dense().transpose(0, 1, 3, 2)):
            raise ValueError("block_mask.q_counts / q_indices must list the same mask as kv_counts / kv_indices, transposed")


ARRAY_FIELDS = ("kv_counts", "kv_indices", "q_counts", "q_indices")


def _host(x) -> np.ndarray:
    """A host copy of a mask array of any framework."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get") and type(x).__module__.startswith("cupy"):
        return x.get()
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _dense(counts: np.ndarray, indices: np.ndarray) -> np.ndarray:
    keep = np.zeros(indices.shape, dtype=bool)
    valid = np.arange(indices.shape[-1]) < counts[..., None]
    b, h, i, _ = np.nonzero(valid)
    keep[b, h, i, indices[valid]] = True
    return keep


def _from_keep(keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(counts, ascending indices padded with 0) of a bool (B, H, rows, blocks) array."""
    counts = keep.sum(axis=-1, dtype=np.int32)
    # A stable sort of "not kept" puts the kept blocks first, in ascending order.
    order = np.argsort(~keep, axis=-1, kind="stable").astype(np.int32)
    order[np.arange(keep.shape[-1]) >= counts[..., None]] = 0
    return counts, np.ascontiguousarray(order)


def from_dense(keep, seqlen_q: int, seqlen_k: int) -> BlockMask:
    """The mask keeping the blocks where ``keep`` (bool, ``(q_blocks, k_blocks)`` or
    ``(B, H, q_blocks, k_blocks)``, any array NumPy reads) is true, ``q_blocks =
    ceil(seqlen_q / 128)``."""
    seqlen_q, seqlen_k = _length("seqlen_q", seqlen_q), _length("seqlen_k", seqlen_k)
    keep = np.asarray(keep)
    if keep.dtype != bool:
        raise TypeError(f"keep must be a bool array, got {keep.dtype}")
    if keep.ndim == 2:
        keep = keep[None, None]
    expected = (blocks(seqlen_q), blocks(seqlen_k))
    if keep.ndim != 4 or keep.shape[2:] != expected:
        raise ValueError(f"keep has shape {keep.shape}; expected (q_blocks, k_blocks) = {expected} or {LAYOUT}")
    kv_counts, kv_indices = _from_keep(keep)
    q_counts, q_indices = _from_keep(keep.transpose(0, 1, 3, 2))
    return BlockMask(kv_counts, kv_indices, q_counts, q_indices, seqlen_q, seqlen_k)


def from_callable(fn, seqlen_q: int, seqlen_k: int, *, batch: int | None = None, heads: int | None = None) -> BlockMask:
    """The mask keeping block (i, j) where ``fn(i, j)`` is true, or ``fn(b, h, i, j)`` when
    ``batch`` or ``heads`` is given. ``fn`` is called once on broadcast NumPy index arrays
    (query block i, key block j; elementwise operators and ``np.where`` work); a function of
    Python ints only is called per block (there ``~`` of a comparison is the int -1 or -2,
    both true: write ``not``)."""
    nq, nk = blocks(_length("seqlen_q", seqlen_q)), blocks(_length("seqlen_k", seqlen_k))
    per_entry = batch is not None or heads is not None
    nb, nh = (1 if n is None else _count(name, n, 1) for name, n in (("batch", batch), ("heads", heads)))
    grids = np.ix_(np.arange(nb), np.arange(nh), np.arange(nq), np.arange(nk))
    args = grids if per_entry else grids[2:]
    try:
        keep = np.asarray(fn(*args))
        vectorized = keep.dtype != object and keep.ndim and np.broadcast_shapes(keep.shape, (nb, nh, nq, nk)) == (nb, nh, nq, nk)
    except Exception:  # noqa: BLE001 - not elementwise on arrays (`if`, `and`, indexing by a Python int, ...): called per block below
        vectorized = False
    if not vectorized:  # a function of Python ints (`if`, `and`): once per block
        keep = np.vectorize(lambda *ix: bool(fn(*(int(i) for i in ix))), otypes=[bool])(*args)
    keep = np.broadcast_to(np.asarray(keep).astype(bool), (nb, nh, nq, nk))
    return from_dense(keep, seqlen_q, seqlen_k)


def _diagonal_blocks(seqlen_q: int, seqlen_k: int, align: str) -> tuple[np.ndarray, np.ndarray]:
    """Per query block, the key blocks of its first and last rows' diagonal keys."""
    from cuattn.reference import diagonal_offset

    offset = diagonal_offset(seqlen_q, seqlen_k, align)
    first = np.arange(blocks(seqlen_q)) * BLOCK_SIZE
    last = np.minimum(first + BLOCK_SIZE, seqlen_q) - 1
    return np.floor_divide(first + offset, BLOCK_SIZE), np.floor_divide(last + offset, BLOCK_SIZE)


def local_global(seqlen_q: int, seqlen_k: int, *, window_blocks: int, global_blocks: int = 1, causal: bool = False,
                 align: str = "bottom_right") -> BlockMask:
    """Local attention plus global tokens (Longformer / BigBird): each query block keeps the
    key blocks within ``window_blocks`` blocks of its diagonal (``align`` as in
    :func:`cuattn.attention`), the first ``global_blocks`` key blocks (seen by every query) and,
    without ``causal``, the first ``global_blocks`` query blocks keep every key block.
    ``causal``: blocks wholly above the diagonal are dropped (pass ``causal=True`` to the
    attention call too: it masks inside the diagonal blocks)."""
    window_blocks, global_blocks = _count("window_blocks", window_blocks), _count("global_blocks", global_blocks)
    first, last = _diagonal_blocks(seqlen_q, seqlen_k, align)
    j = np.arange(blocks(seqlen_k))[None, :]
    keep = (j >= first[:, None] - window_blocks) & (j <= last[:, None] + (0 if causal else window_blocks))
    keep |= j < global_blocks
    if not causal:
        keep |= (np.arange(len(first)) < global_blocks)[:, None]
    else:
        keep &= j <= last[:, None]
    return from_dense(keep, seqlen_q, seqlen_k)


def strided(seqlen_q: int, seqlen_k: int, *, local_blocks: int, stride: int, causal: bool = False,
            align: str = "bottom_right") -> BlockMask:
    """The strided pattern of the Sparse Transformer (Child et al. 2019) in blocks: query block
    i keeps key block j when ``|d| < local_blocks`` or ``d % stride == 0``, ``d`` = the
    distance of j from i's diagonal block; ``causal`` keeps only j at or below the diagonal."""
    local_blocks, stride = _count("local_blocks", local_blocks), _count("stride", stride, minimum=1)
    first, last = _diagonal_blocks(seqlen_q, seqlen_k, align)
    j = np.arange(blocks(seqlen_k))[None, :]
    distance = first[:, None] - j
    keep = (np.abs(distance) < local_blocks) | (distance % stride == 0) | ((j >= first[:, None]) & (j <= last[:, None]))
    if causal:
        keep &= j <= last[:, None]
    return from_dense(keep, seqlen_q, seqlen_k)


def document(seq_ids_q, seq_ids_k=None, *, causal: bool = False, align: str = "bottom_right") -> BlockMask:
    """Documents packed in one sequence, from each token's document id (``(seqlen,)`` or
    ``(batch, seqlen)`` integers; ``seq_ids_k`` defaults to ``seq_ids_q``): block (i, j) is
    kept when a query of block i and a key of block j share a document (``causal``: and the
    block is not wholly above the diagonal). Block granular: tokens of different documents
    inside one kept block see each other, so the mask is exact when documents start at
    multiples of 128 tokens; for exact per-token document masking of any lengths use
    :func:`cuattn.attention_varlen`, which packs the documents without padding."""
    ids_q = np.asarray(seq_ids_q)
    ids_k = ids_q if seq_ids_k is None else np.asarray(seq_ids_k)
    for name, ids in (("seq_ids_q", ids_q), ("seq_ids_k", ids_k)):
        if ids.ndim not in (1, 2) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must be integer document ids, (seqlen,) or (batch, seqlen), got {ids.dtype} {ids.shape}")
    ids_q, ids_k = (ids if ids.ndim == 2 else ids[None] for ids in (ids_q, ids_k))
    if ids_q.shape[0] != ids_k.shape[0]:
        raise ValueError(f"seq_ids_q and seq_ids_k have batches {ids_q.shape[0]} and {ids_k.shape[0]}")
    seqlen_q, seqlen_k = ids_q.shape[1], ids_k.shape[1]
    _, inverse = np.unique(np.concatenate([ids_q.ravel(), ids_k.ravel()]), return_inverse=True)
    codes = inverse.reshape(-1)
    docs = int(codes.max()) + 1 if codes.size else 0
    keep = np.zeros((ids_q.shape[0], 1, blocks(seqlen_q), blocks(seqlen_k)), dtype=bool)
    for b in range(ids_q.shape[0]):
        in_q = _block_membership(codes[b * seqlen_q:(b + 1) * seqlen_q], docs)
        start = ids_q.size + b * seqlen_k
        in_k = _block_membership(codes[start:start + seqlen_k], docs)
        keep[b, 0] = (in_q.astype(np.float32) @ in_k.T.astype(np.float32)) > 0  # float32: BLAS (counts stay exact below 2**24)
    if causal:
        _, last = _diagonal_blocks(seqlen_q, seqlen_k, align)
        keep &= (np.arange(blocks(seqlen_k))[None, :] <= last[:, None])[None, None]
    return from_dense(keep, seqlen_q, seqlen_k)


def _block_membership(codes: np.ndarray, docs: int) -> np.ndarray:
    """Bool (blocks, docs): which documents occur in each block of tokens."""
    member = np.zeros((blocks(len(codes)), docs), dtype=bool)
    member[np.arange(len(codes)) // BLOCK_SIZE, codes] = True
    return member


def _length(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return int(n)


def _count(name: str, n, minimum: int = 0) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {n!r}")
    return int(n)


def check_shapes(mask: BlockMask, batch: int | None = None, heads_q: int | None = None) -> None:
    """ValueError unless the mask's arrays have the shapes of its lengths (and of a call's
    ``batch`` / ``heads_q``, given those)."""
    for name in ARRAY_FIELDS:
        if getattr(mask, name) is None:
            raise TypeError(f"block_mask.{name} is required (a BlockMask holds {', '.join(ARRAY_FIELDS)}), got None")
    if (mask.seqlen_q is None) != (mask.seqlen_k is None):
        raise ValueError(f"block_mask: seqlen_q and seqlen_k go together (both, or neither for the call's own), got {mask.seqlen_q} and {mask.seqlen_k}")
    lead = tuple(mask.kv_counts.shape[:2]) if getattr(mask.kv_counts, "ndim", 0) == 3 else None
    if lead is None:
        raise ValueError(f"block_mask.kv_counts must be (B, H, q_blocks), got shape {tuple(getattr(mask.kv_counts, 'shape', ()))}")
    if mask.seqlen_q is None:  # an adapter's mask of the call's lengths (cuattn/ops.py): the arrays' own block counts
        if getattr(mask.q_counts, "ndim", 0) != 3:
            raise ValueError(f"block_mask.q_counts must be (B, H, k_blocks), got shape {tuple(getattr(mask.q_counts, 'shape', ()))}")
        nq, nk = mask.kv_counts.shape[2], mask.q_counts.shape[2]
    else:
        nq, nk = blocks(mask.seqlen_q), blocks(mask.seqlen_k)
    expected = {
        "kv_counts": lead + (nq,), "kv_indices": lead + (nq, nk), "q_counts": lead + (nk,), "q_indices": lead + (nk, nq),
    }
    for name, shape in expected.items():
        got = tuple(getattr(mask, name).shape)
        if got != shape:
            raise ValueError(
                f"block_mask.{name} has shape {got}, expected {shape} for seqlen_q {mask.seqlen_q}, seqlen_k {mask.seqlen_k} "
                f"({BLOCK_SIZE}-row blocks)"
            )
    for size, call, what in ((lead[0], batch, "batch"), (lead[1], heads_q, "heads_q")):
        if call is not None and size not in (1, call):
            raise ValueError(f"block_mask has {size} entries for {what}; expected 1 or {call} ({what} of the call)")


# --- the attention calls' side -----------------------------------------------------------------

NO_BLOCK_MASK_FIELDS = {
    "kv_block_counts": 0, "kv_block_indices": 0, "q_block_counts": 0, "q_block_indices": 0,
    "kv_block_strides": (0, 0), "q_block_strides": (0, 0), "block_schedule": 0, "block_schedule_stride": 0,
}


def array_arguments(mask) -> dict:
    """The mask's arrays as named array arguments of a call (imported with q, k and v: one
    framework and device), none without a mask; TypeError for what is not a BlockMask."""
    if mask is None:
        return {}
    if not isinstance(mask, BlockMask):
        raise TypeError(f"block_mask must be a cuattn.block_mask.BlockMask, got {type(mask).__name__}")
    return {f"block_mask.{name}": getattr(mask, name) for name in ARRAY_FIELDS}


def replay_key(mask) -> tuple:
    """What of a mask a replayed plan depends on beyond its arrays' shapes: its lengths."""
    return () if mask is None else (mask.seqlen_q, mask.seqlen_k)


def check_call(mask: BlockMask | None, arrays: dict, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, dropout, sink_tokens: int) -> None:
    """Checks a call's block mask against the call (``arrays``: the call's imported arrays, the
    mask's under their :func:`array_arguments` names), before anything is uploaded."""
    if mask is None:
        return
    check_lengths(mask, seqlen_q, seqlen_k)
    if dropout is not None:
        raise ValueError("block_mask is not supported with dropout")
    if sink_tokens:
        raise ValueError("block_mask is not supported with sink_tokens")
    views = {name: arrays[f"block_mask.{name}"] for name in ARRAY_FIELDS}
    check_shapes(BlockMask(**views, seqlen_q=seqlen_q, seqlen_k=seqlen_k), batch, heads_q)
    for name, x in views.items():
        if np.dtype(x.dtype) != np.int32:
            raise TypeError(f"block_mask.{name} must be int32, got {x.dtype}")
        if x.size == 0:  # no layout to check (its strides may be anything)
            continue
        contiguous = 1
        for size, stride in zip(reversed(x.shape), reversed(x.strides)):
            if size > 1 and stride != contiguous:
                raise ValueError(f"block_mask.{name} must be C-contiguous (strides {tuple(x.strides)} in elements)")
            contiguous *= size
    if all(x.ptr is None and isinstance(x.native, np.ndarray) for x in views.values()):  # host arrays: their values too
        BlockMask(**{name: x.native for name, x in views.items()}, seqlen_q=seqlen_q, seqlen_k=seqlen_k).check()


def check_lengths(mask: BlockMask, seqlen_q: int, seqlen_k: int) -> None:
    """ValueError unless ``mask`` was built for a call of these lengths (a mask of the call's
    lengths, seqlen None, passes)."""
    if mask.seqlen_q is not None and (mask.seqlen_q, mask.seqlen_k) != (seqlen_q, seqlen_k):
        raise ValueError(
            f"block_mask was built for seqlen_q {mask.seqlen_q}, seqlen_k {mask.seqlen_k}; the call has {seqlen_q} and {seqlen_k}"
        )


def kernel_fields(mask: BlockMask | None, arrays: dict) -> dict:
    """The AttnParams fields of a checked call's block mask (its arrays staged on the device)."""
    if mask is None:
        return NO_BLOCK_MASK_FIELDS
    views = {name: arrays[f"block_mask.{name}"] for name in ARRAY_FIELDS}
    fields = {"block_schedule": 0, "block_schedule_stride": 0}  # set per launch (order_launch)
    for which, counts in (("kv", views["kv_counts"]), ("q", views["q_counts"])):
        rows = counts.shape[2]
        fields[f"{which}_block_counts"] = counts.ptr
        fields[f"{which}_block_indices"] = views[f"{which}_indices"].ptr
        # (batch, head) strides in rows; 0 where one mask serves every entry
        fields[f"{which}_block_strides"] = (counts.shape[1] * rows if counts.shape[0] > 1 else 0, rows if counts.shape[1] > 1 else 0)
    return fields


def schedule_buffer(ctx, attn: np.void, side: str, batch: int):
    """The array that will order a block-sparse launch's CTAs (:func:`order_launch`) along
    ``side`` ("q": query blocks, "k": key blocks), allocated before the call's first launch (a
    traced JAX call records allocations up to there). Sized by a bound that does not depend on
    the kernel chosen: every tile holds at least MIN_TILE_ROWS rows, and the dK / dV kernels
    split a KV head's columns over at most two CTAs."""
    heads = int(attn["heads_q"]) if side == "q" else 2 * int(attn["heads_kv"])
    cells = heads * -(-int(attn["seqlen_q" if side == "q" else "seqlen_k"]) // MIN_TILE_ROWS)
    entries = batch if attn["kv_block_strides" if side == "q" else "q_block_strides"][0] else 1  # per sequence, or one for all
    return ctx.empty((entries, cells), np.int32)


def order_launch(ctx, schedule, variant, grid: tuple, attn: np.void) -> None:
    """Orders the CTAs of a block-sparse launch of ``variant`` over ``grid`` (x, y, z): fills
    ``schedule`` (:func:`schedule_buffer`), cells of at least twice the average weight first
    (cuda_src/sparse/block_schedule.cu), and points ``attn`` at it. Inside the call's device
    and stream, before the launch."""
    side, reversed_x = sparse.GRID_WALKS[variant.kernel]
    tiles, ys = int(grid[0]), int(grid[1])
    entries, bound = schedule.shape
    if ys * tiles > bound:
        raise RuntimeError(f"{variant.uri}: {ys} x {tiles} cells exceed the schedule's bound {bound}")
    blocks_q, blocks_k = blocks(int(attn["seqlen_q"])), blocks(int(attn["seqlen_k"]))
    counts, strides = (attn["kv_block_counts"], attn["kv_block_strides"]) if side == "q" else (attn["q_block_counts"], attn["q_block_strides"])
    group = 1 if side == "q" else int(attn["heads_q"]) // int(attn["heads_kv"])
    fill = params.pack(
        params.BLOCK_SCHEDULE_PARAMS, counts=counts, schedule=schedule.ptr, count_strides=tuple(strides), entries=entries, ys=ys,
        y_per_head=variant.column_splits, group=group, tiles=tiles, tile_rows=variant.block_m,
        mask_rows=blocks_q if side == "q" else blocks_k, reversed=int(reversed_x),
    )
    ctx.launch(sparse.schedule_variant(), (entries, 1, 1), (sparse.THREADS, 1, 1), fill)
    # The first entries x ys x tiles elements, packed.
    attn["block_schedule"], attn["block_schedule_stride"] = schedule.ptr, ys * tiles if entries > 1 else 0
