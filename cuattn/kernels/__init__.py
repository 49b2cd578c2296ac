"""The kernel families and the one registry of their variants.

Each family is a folder of ``cuda_src/`` and a module here (its launch plan) that owns the
family's tile shapes, shared-memory sizes, grids and variant selection, and lists its
variants. Enumeration (offline compile, ``warmup``, CI) goes through :data:`FAMILIES` only.
"""

from __future__ import annotations

from cuattn.kernels import backward, decode, forward, merge, packed, sparse
from cuattn.kernels.variant import Variant

FAMILIES = (merge, forward, backward, packed, decode, sparse)


def all_variants(arch: str | None = None) -> list[Variant]:
    """Every variant, in a stable order; the offline compile and ``warmup --all`` use it. With
    ``arch``, tiles that depend on the target's shared memory are chosen for it."""
    return [v for family in FAMILIES for v in family.variants(arch)]


def common_variants() -> list[Variant]:
    """The set ``python -m cuattn warmup`` compiles by default."""
    return [v for family in FAMILIES for v in family.common_variants()]
