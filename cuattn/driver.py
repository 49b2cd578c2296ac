"""Entry points of the CUDA driver that CuPy does not bind, through ctypes."""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def function(name: str, argtypes: tuple):
    """The driver's ``name`` (returning a ``CUresult``) with its argument types, or None where
    the driver or the entry point cannot be had."""
    try:
        entry = getattr(ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"), name)
    except (OSError, AttributeError):
        return None
    entry.argtypes = argtypes
    entry.restype = ctypes.c_int
    return entry
