"""The element types cuattn's kernels take: NumPy dtypes and their names in ``cuda_src``."""

from __future__ import annotations

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


def cxx_type(c_type: str) -> str:
    return "float" if c_type == "float" else f"cuattn::{c_type}"
