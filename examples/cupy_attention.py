"""Attention forward and backward on CuPy arrays, with the results staying on the GPU.

    python examples/cupy_attention.py
"""

import cupy
import ml_dtypes
import numpy as np

import cuattn
from cuattn import requirements

requirements.require_gpu()  # cuattn's message where there is no GPU, before CuPy's first allocation

bf16 = np.dtype(ml_dtypes.bfloat16)
q, k, v, dout = (cupy.random.standard_normal((4, 1024, 16, 128), dtype=np.float32).astype(bf16) for _ in range(4))

out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
dq, dk, dv = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True)
print(f"out {out.shape} {out.dtype}; lse {lse.shape}; dq {dq.shape} {dq.dtype}")

start, stop = cupy.cuda.Event(), cupy.cuda.Event()
start.record()
for _ in range(20):
    cuattn.attention(q, k, v, causal=True)
stop.record()
stop.synchronize()
ms = cupy.cuda.get_elapsed_time(start, stop) / 20
flops = 4 * 4 * 16 * 1024 * 1024 * 128 / 2
print(f"causal forward: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s")
