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


@functools.cache
def variant(c_type: str, vec: int) -> Variant:
    return Variant(
        family=FAMILY, kernel="merge",
        expression=f"cuattn::merge_kernel<{cxx_type(c_type)}, {vec}>",
        uri=f"merge/{c_type}/vec{vec}",
        hot=True,
        threads=THREADS,
        contract=(("cuattn::kMergeThreads", THREADS),),
    )


def grid(rows: int, head_dim: int, vec: int) -> tuple[int, int, int]:
    """One pass: enough blocks to cover every row once (the kernel grid-strides past 2^31 rows)."""
    group = 1
    while group < 32 and group * vec < head_dim:
        group *= 2
    rows_per_block = (THREADS // 32) * (32 // group)
    blocks = -(-rows // rows_per_block)
    return (max(1, min(blocks, 2**31 - 1)), 1, 1)


def variants(arch: str | None = None) -> list[Variant]:
    return [variant(c_type, vec) for c_type, vecs in VEC_WIDTHS.items() for vec in vecs] + [sum_variant(c) for c in VEC_WIDTHS] + [sum_variant("float", c) for c in ("f16", "bf16")]


def common_variants() -> list[Variant]:
    return [variant(c, VEC_WIDTHS[c][0]) for c in VEC_WIDTHS]


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
