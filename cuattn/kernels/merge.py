"""Launch plan of the merge family (cuda_src/merge/): combining partial attention results from
their (out, lse) (merge.cu), and summing partial gradients in fp32 (sum_partials.cu)."""

from __future__ import annotations

import functools

from cuattn.dtypes import cxx_type
from cuattn.kernels.variant import Variant

FAMILY = "merge"
THREADS = 256  # merge_kernel's __launch_bounds__
# 16-byte accesses, or one element at a time when a pointer or stride is not aligned to that.
VEC_WIDTHS = {"f16": (8, 1), "bf16": (8, 1), "float": (4, 1)}


# Compile-time bounds on the number of partials (the kernel keeps every partial's weight of a
# row in registers); a launch takes the smallest that holds its partials. The element-wise
# fallback (vec 1) has only the largest.
CAPS = (2, 4, 8, 16)
# Rows a lane group takes at a time, by cap: two rows keep more bytes in flight at two
# partials; at more partials the registers of a second row cost more than they bring
# (scripts/merge_probe.py, docs/bench/merge/probe.csv).
ROWS_PER_LANE = {2: 2, 4: 1, 8: 1, 16: 1}


def cap_for(partials: int, vec: int) -> int:
    return next(c for c in CAPS if c >= partials) if vec > 1 else CAPS[-1]


def rows_per_lane(cap: int, vec: int) -> int:
    return ROWS_PER_LANE[cap] if vec > 1 else 1


@functools.cache
def variant(c_type: str, vec: int, cap: int = CAPS[-1], out_type: str | None = None) -> Variant:
    """Partials of ``c_type`` merged into an ``out_type`` result (default ``c_type``; float for
    the groups of a merge of more than CAPS[-1] partials, whose results are merged again)."""
    out_type = out_type or c_type
    rows = rows_per_lane(cap, vec)
    return Variant(
        family=FAMILY, kernel="merge",
        expression=f"cuattn::merge_kernel<{cxx_type(c_type)}, {cxx_type(out_type)}, {vec}, {cap}, {rows}>",
        uri=f"merge/{c_type}/vec{vec}/cap{cap}" + ("" if rows == 1 else f"/rows{rows}") + ("" if out_type == c_type else f"/to_{out_type}"),
        hot=True,
        threads=THREADS,
        contract=(("cuattn::kMergeThreads", THREADS),),
    )


BLOCKS_PER_SM = 16  # grid cap: fewer, longer-lived blocks (86-94% of copy at 2 partials, H100)


def grid(rows: int, head_dim: int, vec: int, rows_per_lane: int = 1, sms: int = 132) -> tuple[int, int, int]:
    """Blocks to cover every row once, at most BLOCKS_PER_SM per SM (the kernel strides)."""
    group = 1
    while group < 32 and group * vec < head_dim:
        group *= 2
    rows_per_block = (THREADS // 32) * (32 // group) * rows_per_lane
    blocks = -(-rows // rows_per_block)
    return (max(1, min(blocks, BLOCKS_PER_SM * sms)), 1, 1)


def variants(arch: str | None = None) -> list[Variant]:
    merges = [
        variant(c_type, vec, cap) for c_type, vecs in VEC_WIDTHS.items() for vec in vecs
        for cap in sorted({cap_for(n, vec) for n in range(1, CAPS[-1] + 1)})
    ]
    # A merge of more than CAPS[-1] partials: its groups (16-bit partials into float) and the
    # merge of their results (float into the 16-bit type) take the largest cap.
    groups = [
        variant(a, vec, CAPS[-1], b) for c in ("f16", "bf16") for a, b in ((c, "float"), ("float", c)) for vec in VEC_WIDTHS[a]
    ]
    return merges + groups + [sum_variant(c) for c in VEC_WIDTHS] + [sum_variant("float", c) for c in ("f16", "bf16")]


def common_variants() -> list[Variant]:
    return [variant(c, VEC_WIDTHS[c][0], cap) for c in VEC_WIDTHS for cap in CAPS]


SUM_THREADS = 256  # sum_partials_kernel's __launch_bounds__
SUM_VEC = 8  # elements per thread per step


@functools.cache
def sum_variant(c_type: str, out_type: str | None = None) -> Variant:
    """Pieces of ``c_type`` summed in fp32; the total written as ``out_type`` (default the
    pieces' type)."""
    out_type = out_type or c_type
    return Variant(
        family=FAMILY, kernel="sum_partials",
        expression=f"cuattn::sum_partials_kernel<{cxx_type(c_type)}, {cxx_type(out_type)}>",
        uri=f"merge/sum_partials/{c_type}" + ("" if out_type == c_type else f"_to_{out_type}"),
        threads=SUM_THREADS,
        contract=(("cuattn::kSumThreads", SUM_THREADS),),
    )


def sum_grid(count: int, sms: int = 132) -> tuple[int, int, int]:
    """Up to 8 blocks per SM; the kernel strides past them."""
    return (max(1, min(-(-count // (SUM_THREADS * SUM_VEC)), 8 * sms)), 1, 1)
