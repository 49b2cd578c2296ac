"""Attention on NumPy host arrays: cuattn uploads them, computes on the GPU, returns NumPy.

    python examples/numpy_attention.py
"""

import numpy as np

import cuattn
from cuattn import reference

rng = np.random.default_rng(0)
q = rng.standard_normal((2, 300, 8, 64)).astype(np.float16)
k = rng.standard_normal((2, 500, 2, 64)).astype(np.float16)  # GQA: 8 query heads share 2 K/V heads
v = rng.standard_normal((2, 500, 2, 64)).astype(np.float16)

out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
ref = reference.attention(q, k, v, causal=True)
print(f"out {type(out).__name__} {out.shape} {out.dtype}, lse {lse.shape} {lse.dtype}")
print(f"max |out - float64 reference| = {np.abs(out.astype(np.float64) - ref).max():.2e}")
