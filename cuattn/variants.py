"""The table of kernel variants: every template instantiation cuattn can launch.

A variant is one ``__global__`` template instantiation. Its ``uri`` names it in logs, the
cache listing and the compile report; its ``expression`` is the C++ name handed to NVRTC
through ``name_expressions``. ``hot`` marks kernels whose register spills fail CI.
"""

from __future__ import annotations

import dataclasses
import numpy as np

try:  # bfloat16 as a NumPy dtype; optional at import so that validation can name it
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a runtime dependency
    BFLOAT16 = None

C_TYPES = {np.dtype(np.float16): "f16", np.dtype(np.float32): "float"}
if BFLOAT16 is not None:
    C_TYPES[BFLOAT16] = "bf16"
C_TYPE_NAMES = {"f16": "float16", "bf16": "bfloat16", "float": "float32"}


@dataclasses.dataclass(frozen=True)
class Variant:
    family: str  # translation unit in cuda_src/, without ".cu"
    expression: str  # C++ name expression of the instantiation
    uri: str
    hot: bool = False


def cxx_type(c_type: str) -> str:
    return "float" if c_type == "float" else f"cuattn::{c_type}"


def merge_variant(c_type: str, vec: int) -> Variant:
    return Variant(
        family="merge",
        expression=f"cuattn::merge_kernel<{cxx_type(c_type)}, {vec}>",
        uri=f"merge/{c_type}/vec{vec}",
        hot=True,
    )


# 16-byte accesses, or one element at a time when a pointer or stride is not aligned to that.
MERGE_VEC_WIDTHS = {"f16": (8, 1), "bf16": (8, 1), "float": (4, 1)}


def all_variants() -> list[Variant]:
    """Every variant, in a stable order; the offline compile and ``warmup --all`` use it."""
    out = []
    for c_type, vecs in MERGE_VEC_WIDTHS.items():
        for vec in vecs:
            out.append(merge_variant(c_type, vec))
    return out


def common_variants() -> list[Variant]:
    """The set ``python -m cuattn warmup`` compiles by default."""
    return [merge_variant(c, MERGE_VEC_WIDTHS[c][0]) for c in MERGE_VEC_WIDTHS]
