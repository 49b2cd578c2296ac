"""The launches of one rank of the ring: at each step, its query rows against the K/V shard it
then holds, cut into as few (query rows, key rows, mask) pieces as the masks allow.

A rank's rows are one or two runs of positions (:mod:`cuattn.dist.layout`), so a step is up to
four (query run, key run) blocks, each with its own band or nothing visible. Fewer, larger
launches keep the GPU full: under a causal mask the zigzag layout's own shard is one causal
launch over all its rows (local order is position order there), and every later step one
unmasked launch (all queries against the first key chunk, or the second query chunk against
all keys). A merged piece is taken only when one band on its local indices is exactly the
position mask of every block in it, and every query run and key run in it sees something.
"""

from __future__ import annotations

import dataclasses
import functools
import types

from cuattn.dist import layout as layouts


@dataclasses.dataclass(frozen=True)
class Span:
    """Rows ``[local_start, local_start + length)`` of a shard."""

    local_start: int
    length: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """One rank's work: its runs of rows, and for each step the pieces ``(query span, key span,
    mask fields)`` it computes against the shard it then holds (rank - step)."""

    runs: list
    steps: list


@functools.lru_cache(maxsize=256)
def plan(seqlen: int, world: int, rank: int, layout: str, left: int, right: int) -> Plan:
    """Rank ``rank``'s pieces under the position window ``(left, right)`` (-1: unbounded;
    causal is right = 0). Memoized: a training loop asks the same each step. A bound that
    reaches past the sequence is unbounded, as on one device (its fields stay in int32)."""
    left, right = (-1 if bound >= seqlen else bound for bound in (left, right))
    mine = layouts.runs(seqlen, world, rank, layout)
    started, steps = set(), []
    for s in range(world):
        theirs = layouts.runs(seqlen, world, (rank - s) % world, layout)
        pieces, started = _fewest_pieces(mine, theirs, left, right, started)
        steps.append(tuple(pieces))
    return Plan(tuple(mine), tuple(steps))


def covered_runs(runs: list, span: Span) -> list:
    """The runs of ``runs`` inside ``span``."""
    return [r for r in runs if span.local_start <= r.local_start < span.local_start + span.length]


def _fewest_pieces(mine: list, theirs: list, left: int, right: int, started: set) -> tuple[list, set]:
    """The step's pieces, and the query runs started (folded into) once they have run."""
    bands = {(i, j): layouts.band(q, k, left, right) for i, q in enumerate(mine) for j, k in enumerate(theirs)}
    rows, cols = tuple(range(len(mine))), tuple(range(len(theirs)))
    partitions = (
        [(rows, cols)],
        [(rows, (j,)) for j in cols],
        [((i,), cols) for i in rows],
        [((i,), (j,)) for i in rows for j in cols],  # always exact: the blocks' own bands
    )
    options = [p for p in (_pieces(part, mine, theirs, bands, started) for part in partitions) if p is not None]
    return min(options, key=lambda p: len(p[0]))


def _pieces(partition, mine, theirs, bands, started):
    """The pieces of ``partition`` (rectangles of (query run, key run) indices), or None when
    one of them cannot be a single launch."""
    pieces, started = [], set(started)
    for rows, cols in partition:
        seen = [(i, j) for i in rows for j in cols if bands[i, j] is not None]
        if not seen:
            continue
        if {i for i, _ in seen} != set(rows) or {j for _, j in seen} != set(cols):
            return None  # a run that would see nothing in this launch
        fields = _one_band(rows, cols, mine, theirs, bands)
        fresh = {mine[i].local_start not in started for i in rows}
        if fields is None or len(fresh) > 1:  # the fold starts every row of a launch alike
            return None
        started |= {mine[i].local_start for i in rows}
        pieces.append((_span(mine, rows), _span(theirs, cols), types.MappingProxyType(fields)))  # plans are shared (memoized)
    return pieces, started


def _span(runs: list, indices: tuple) -> Span:
    first, last = runs[indices[0]], runs[indices[-1]]
    return Span(first.local_start, last.local_start + last.length - first.local_start)


def _one_band(rows, cols, mine, theirs, bands) -> dict | None:
    """Mask fields on the merged piece's local indices that equal every block's own mask, or
    None. Block (i, j) sits at offsets (dq, dk) in the piece, so its diagonal j' - i' is the
    piece's j - i minus (dk - dq)."""
    q0, k0 = mine[rows[0]].local_start, theirs[cols[0]].local_start
    shift = {(i, j): (theirs[j].local_start - k0) - (mine[i].local_start - q0) for i in rows for j in cols}
    candidates = [(None, None)]
    for (i, j), fields in bands.items():
        if i in rows and j in cols and fields is not None:
            lo, hi = layouts.band_bounds(fields)
            candidates.append((None if lo is None else lo + shift[i, j], None if hi is None else hi + shift[i, j]))
    own = {(i, j): None if bands[i, j] is None else layouts.band_bounds(bands[i, j]) for i in rows for j in cols}
    for lo, hi in candidates:
        def block_bounds(i, j):
            return (None if lo is None else lo - shift[i, j]), (None if hi is None else hi - shift[i, j])

        if all(_diagonals(own[i, j], mine[i].length, theirs[j].length) == _diagonals(block_bounds(i, j), mine[i].length, theirs[j].length)
               for i in rows for j in cols):
            return layouts.band_fields(lo, hi)
    return None


def _diagonals(bounds, m: int, n: int):
    """The visible diagonals ``j - i`` of an m x n block under ``lo <= j - i <= hi`` (every
    diagonal from -(m - 1) to n - 1 has cells), or None when none is: equal results, equal masks."""
    if bounds is None:
        return None
    lo, hi = bounds
    a = -(m - 1) if lo is None else max(lo, -(m - 1))
    b = n - 1 if hi is None else min(hi, n - 1)
    return (a, b) if a <= b else None
