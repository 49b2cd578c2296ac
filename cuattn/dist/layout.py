"""How a sequence is dealt to the ranks of a ring, and the mask between two ranks' pieces.

A rank's rows (of q, and of k and v alike) are one or two *runs* of token positions: rows
``[local_start, local_start + length)`` of its shard hold positions ``first + stride * i``.

- ``"contiguous"``: rank r holds positions ``[r S/W, (r + 1) S/W)``.
- ``"zigzag"``: the sequence cut into 2W chunks, rank r holds chunks r and 2W-1-r, so that
  under a causal mask every rank does the same work.
- ``"stripe"``: rank r holds positions r, r + W, r + 2W, ...

Masks are functions of positions (causal: key <= query; window: query - left <= key <=
query + right), so the mask between a run of queries and a run of keys is the kernels' band
(``diagonal_offset``, ``window_left``, ``window_right``) on local row and column indices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

LAYOUTS = ("contiguous", "zigzag", "stripe")


@dataclasses.dataclass(frozen=True)
class Run:
    local_start: int
    length: int
    first: int  # position of the run's first row
    stride: int  # positions between consecutive rows


def check_layout(layout: str, seqlen: int, world: int) -> None:
    if not isinstance(layout, str):
        raise TypeError(f"layout must be a string, one of {', '.join(LAYOUTS)}, got {type(layout).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if isinstance(seqlen, (bool, np.bool_)) or not isinstance(seqlen, (int, np.integer)) or seqlen < 0:
        raise TypeError(f"seqlen must be a non-negative int, got {type(seqlen).__name__} {seqlen!r}")
    parts = 2 * world if layout == "zigzag" else world
    if seqlen % parts:
        raise ValueError(f"the {layout} layout needs the sequence length ({seqlen}) to be a multiple of {parts} ({world} ranks)")


def check_rank(world, rank) -> None:
    """ValueError unless ``world`` >= 1 ranks and 0 <= ``rank`` < ``world`` (ints)."""
    for name, n in (("world", world), ("rank", rank)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(n).__name__} {n!r}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world) with world >= 1, got rank {rank} of world {world}")


def runs(seqlen: int, world: int, rank: int, layout: str) -> list[Run]:
    """The runs of rank ``rank``'s rows, in local order."""
    check_rank(world, rank)
    check_layout(layout, seqlen, world)
    if layout == "contiguous":
        n = seqlen // world
        return [Run(0, n, rank * n, 1)]
    if layout == "stripe":
        return [Run(0, seqlen // world, rank, world)]
    c = seqlen // (2 * world)
    return [Run(0, c, rank * c, 1), Run(c, c, (2 * world - 1 - rank) * c, 1)]


def positions(seqlen: int, world: int, rank: int, layout: str) -> np.ndarray:
    """Token positions of rank ``rank``'s rows, in local order (for position embeddings)."""
    return np.concatenate([r.first + r.stride * np.arange(r.length) for r in runs(seqlen, world, rank, layout)])


def shard(x, world: int, rank: int, layout: str, axis: int = 1):
    """Rank ``rank``'s rows of a full sequence ``x`` (any array with a sequence axis; NumPy,
    CuPy, torch or JAX), as a new array."""
    index = positions(x.shape[axis], world, rank, layout)
    if type(x).__module__.startswith("torch"):
        import torch

        return x.index_select(axis, torch.as_tensor(index, device=x.device))
    xp = _namespace(x)
    return xp.take(x, xp.asarray(index), axis=axis)


def _namespace(x):
    """The array module whose ``take`` / ``concatenate`` / ``asarray`` serve ``x`` (not torch)."""
    if isinstance(x, np.ndarray):
        return np
    module = type(x).__module__.split(".")[0]
    if module in ("jax", "jaxlib"):
        import jax.numpy

        return jax.numpy
    return __import__(module)


def unshard(shards, layout: str, axis: int = 1):
    """The full sequence from every rank's rows (the inverse of :func:`shard`)."""
    world = len(shards)
    if not world:
        raise ValueError("shards must hold every rank's rows, got none")
    lengths = {s.shape[axis] for s in shards}
    if len(lengths) != 1:
        raise ValueError(f"every rank's shard holds as many rows; got {[s.shape[axis] for s in shards]} along axis {axis}")
    seqlen = world * lengths.pop()
    order = np.argsort(np.concatenate([positions(seqlen, world, r, layout) for r in range(world)]))
    if type(shards[0]).__module__.startswith("torch"):
        import torch

        full = torch.cat(list(shards), dim=axis)
        return full.index_select(axis, torch.as_tensor(order, device=full.device))
    xp = _namespace(shards[0])
    return xp.take(xp.concatenate(list(shards), axis=axis), xp.asarray(order), axis=axis)


def band(q: Run, k: Run, left: int, right: int) -> dict | None:
    """The kernels' mask fields for queries ``q`` against keys ``k`` under the position window
    ``(left, right)`` (-1: unbounded; causal is right = 0), or None when no query of the run
    sees a key of the other."""
    if q.stride != k.stride:
        raise ValueError("runs of different strides")
    w, d = q.stride, q.first - k.first
    # key j visible to query i:  j >= i + ceil((d - left) / w)  and  j <= i + floor((d + right) / w)
    lo = None if left < 0 else -((left - d) // w)
    hi = None if right < 0 else (d + right) // w
    if lo is not None and hi is not None and hi < lo:
        return None
    fields = band_fields(lo, hi)
    win_left, offset, win_right = fields["window_left"], fields["diagonal_offset"], fields["window_right"]
    first = 0 if win_left < 0 else max(0, offset - win_left)
    last = k.length - 1 if win_right < 0 else min(k.length - 1, q.length - 1 + offset + win_right)
    if q.length == 0 or k.length == 0 or last < first:
        return None
    return fields


def band_fields(lo: int | None, hi: int | None) -> dict:
    """The kernels' mask fields that show key j to query i when ``lo <= j - i <= hi`` (None:
    unbounded)."""
    if hi is not None:
        return {"diagonal_offset": hi, "window_left": -1 if lo is None else hi - lo, "window_right": 0}
    if lo is not None:
        return {"diagonal_offset": lo, "window_left": 0, "window_right": -1}
    return {"diagonal_offset": 0, "window_left": -1, "window_right": -1}


def band_bounds(fields: dict) -> tuple[int | None, int | None]:
    """The ``(lo, hi)`` of ``lo <= j - i <= hi`` that mask fields show (inverse of :func:`band_fields`)."""
    offset, left, right = fields["diagonal_offset"], fields["window_left"], fields["window_right"]
    return (None if left < 0 else offset - left), (None if right < 0 else offset + right)
