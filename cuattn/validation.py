"""Argument checks shared by the public functions; each raises before any launch and names
the argument at fault."""

from __future__ import annotations

import numpy as np

from cuattn.variants import C_TYPE_NAMES, C_TYPES

ALL_DTYPES = ("float16", "bfloat16", "float32")


def dtype_name(dtype) -> str:
    dtype = np.dtype(dtype)
    return C_TYPE_NAMES.get(C_TYPES.get(dtype, ""), str(dtype))


def check_dtype(name: str, a, allowed=ALL_DTYPES) -> str:
    """Returns the kernel's C type name for the array's dtype."""
    if np.dtype(a.dtype) not in C_TYPES or dtype_name(a.dtype) not in allowed:
        raise TypeError(f"{name} has dtype {a.dtype}; supported: {', '.join(allowed)}")
    return C_TYPES[np.dtype(a.dtype)]


def check_rank(name: str, a, ndim: int, layout: str) -> None:
    if a.ndim != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {layout}, got shape {tuple(a.shape)}")


def check_unit_last_stride(name: str, a) -> None:
    if a.size and a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension (got strides {tuple(a.strides)} in elements); "
            "make it contiguous in that dimension first"
        )


def check_shape(name: str, a, expected: tuple, layout: str) -> None:
    if tuple(a.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(a.shape)}, expected {tuple(expected)} {layout}")


def check_same_dtype(name: str, a, ref_name: str, ref) -> None:
    if np.dtype(a.dtype) != np.dtype(ref.dtype):
        raise TypeError(f"{name} has dtype {a.dtype} but {ref_name} has dtype {ref.dtype}")


def check_float32(name: str, a) -> None:
    if np.dtype(a.dtype) != np.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")


def aligned(ptrs, strides, itemsize: int, vec: int, inner: int) -> bool:
    """Whether every pointer, stride and the inner extent allow vec-wide (16-byte) accesses."""
    return (
        inner % vec == 0
        and all(p % (itemsize * vec) == 0 for p in ptrs)
        and all(s % vec == 0 for s in strides)
    )
