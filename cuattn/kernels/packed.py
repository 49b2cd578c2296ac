"""Launch plan of the packed-sequence family (cuda_src/packed/): the device-side check of a
varlen call's ``cu_seqlens`` offsets."""

from __future__ import annotations

import functools

from cuattn.kernels.variant import Variant

FAMILY = "packed"
THREADS = 256
MAX_BLOCKS = 1024  # the kernel strides over the offsets past this
# What a report word's code says: code = 1 + 4 * which (0 query, 1 key offsets) + rule.
RULES = ("kFirstNotZero", "kDecreasing", "kLastNotTotal", "kLongerThanBound")


@functools.cache
def check_variant() -> Variant:
    return Variant(
        family=FAMILY, kernel="check_offsets",
        expression=f"cuattn::check_offsets_kernel<{THREADS}>",
        uri="packed/check_offsets",
        threads=THREADS,
        contract=tuple((f"cuattn::{rule}", i) for i, rule in enumerate(RULES)),
    )


def check_grid(batch: int) -> tuple[int, int, int]:
    """One thread per offset entry (batch + 1 of them), grid-strided past MAX_BLOCKS CTAs."""
    return (max(1, min(MAX_BLOCKS, -(-(batch + 1) // THREADS))), 1, 1)


def variants(arch: str | None = None) -> list[Variant]:
    return [check_variant()]


def common_variants() -> list[Variant]:
    return []
