"""Shared test helpers: random inputs, the accuracy criterion, poisoned allocators."""

from __future__ import annotations

import numpy as np

from cuattn.variants import BFLOAT16

DTYPES = {"float16": np.dtype(np.float16), "bfloat16": BFLOAT16, "float32": np.dtype(np.float32)}


def randn(rng, shape, dtype, scale=1.0) -> np.ndarray:
    """Fresh standard-normal values (never zeros) in the given dtype."""
    return (rng.standard_normal(shape) * scale).astype(DTYPES.get(dtype, dtype))


def max_err(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    assert not np.isnan(x).any(), "NaN in result"
    return float(np.max(np.abs(x - ref))) if x.size else 0.0


def assert_close_to_rounding(result, ref, dtype, factor=2.0, floor=1e-6):
    """Error at most ``factor`` times that of rounding the float64 reference to ``dtype``."""
    rounded = np.asarray(ref).astype(DTYPES.get(dtype, dtype)).astype(np.float64)
    bound = factor * max_err(rounded, ref) + floor * max(1.0, float(np.max(np.abs(ref))) if np.size(ref) else 1.0)
    err = max_err(result, ref)
    assert err <= bound, f"max error {err:.3e} > bound {bound:.3e}"


def poison_cupy_pool(nbytes: int = 64 << 20) -> None:
    """Leave NaN-filled blocks in CuPy's memory pool so that unwritten outputs show as NaN."""
    import cupy

    for size in (nbytes, nbytes // 16, nbytes // 256, 4096, 512):
        cupy.full(size // 4, np.nan, dtype=np.float32)
    cupy.cuda.get_current_stream().synchronize()


def poison_torch_cache(nbytes: int = 64 << 20) -> None:
    import torch

    for size in (nbytes, nbytes // 16, nbytes // 256, 4096, 512):
        torch.full((size // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def to_host(x) -> np.ndarray:
    """Any framework's array as a float64 NumPy array."""
    module = type(x).__module__
    if module.startswith("cupy"):
        x = x.get()
    elif module.startswith("torch"):
        x = x.detach().float().cpu().numpy()
    elif module.startswith(("jax", "jaxlib")):
        x = np.asarray(x)
    return np.asarray(x).astype(np.float64)
