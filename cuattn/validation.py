"""Argument checks shared by the public functions; each raises before any launch and names
the argument at fault."""

from __future__ import annotations

import math

import numpy as np

from cuattn.dtypes import C_TYPE_NAMES, C_TYPES

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


class _AddressView:
    """``__array_interface__`` of a device buffer's address range, for NumPy's overlap solver
    (which reads addresses and strides only, never the memory)."""

    def __init__(self, a):
        item = a.dtype.itemsize
        self.__array_interface__ = {
            "data": (a.ptr, False), "shape": a.shape, "strides": tuple(s * item for s in a.strides),
            "typestr": f"|V{item}", "version": 3,
        }


def byte_extent(a) -> tuple[int, int]:
    """The bytes ``[ptr + low, ptr + high)`` a non-empty array's elements span, as ``(low, high)``."""
    low = high = 0
    for n, s in zip(a.shape, a.strides):
        if s < 0:
            low += (n - 1) * s
        else:
            high += (n - 1) * s
    item = a.dtype.itemsize
    return low * item, (high + 1) * item


def _may_overlap(a, b) -> bool:
    if not (a.size and b.size and a.ptr and b.ptr):  # None: host memory; 0: no memory (arrays known by shape alone, as traced)
        return False
    (a_low, a_high), (b_low, b_high) = byte_extent(a), byte_extent(b)
    if a.ptr + a_high <= b.ptr + b_low or b.ptr + b_high <= a.ptr + a_low:  # apart: no solve needed
        return False
    try:
        return bool(np.shares_memory(np.asarray(_AddressView(a)), np.asarray(_AddressView(b)), max_work=10**6))
    except getattr(np, "exceptions", np).TooHardError:  # np.exceptions from NumPy 1.25
        return True


def check_writable_output(name: str, out, inputs: dict, same_as_ok: str | None = None) -> None:
    """``out`` must not overlap itself (no zero strides or interleaved dimensions) nor any
    input, except that it may be exactly the input named ``same_as_ok`` (same address, shape
    and strides: a kernel that reads those elements only before it writes them). An empty
    ``out`` is never written (its strides may be anything)."""
    if not math.prod(out.shape):
        return
    dims = sorted((abs(s), n) for s, n in zip(out.strides, out.shape) if n > 1)
    span = 1
    for stride, extent in dims:
        if stride < span:
            raise ValueError(f"{name} has overlapping elements (strides {tuple(out.strides)} for shape {tuple(out.shape)}); pass an array with distinct elements")
        span = stride * extent
    for in_name, x in inputs.items():
        if x is None or not _may_overlap(out, x):
            continue
        if in_name == same_as_ok and (x.ptr, x.shape, x.strides) == (out.ptr, out.shape, out.strides):
            continue
        raise ValueError(f"{name} overlaps {in_name} in memory; the kernel would overwrite {in_name} while reading it")


def check_bool(name: str, x) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(x).__name__} {x!r}")
    return bool(x)
