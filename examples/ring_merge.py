"""A ring of partial attentions: the keys are split into chunks (as context parallelism or KV
streamed from host memory would see them), each chunk gives a partial (out, lse), and
cuattn.merge combines them into exactly the attention over all keys.

    python examples/ring_merge.py
"""

import cupy
import numpy as np

import cuattn
from cuattn import requirements

requirements.require_gpu()  # cuattn's message where there is no GPU, before CuPy's first allocation

rng = np.random.default_rng(0)
q = cupy.asarray(rng.standard_normal((1, 256, 4, 64)).astype(np.float16))
k = cupy.asarray(rng.standard_normal((1, 4096, 4, 64)).astype(np.float16))
v = cupy.asarray(rng.standard_normal((1, 4096, 4, 64)).astype(np.float16))

chunks = 4
step = k.shape[1] // chunks
partials = [cuattn.attention(q, k[:, i:i + step], v[:, i:i + step], return_lse=True) for i in range(0, k.shape[1], step)]
out, lse = cuattn.merge([p[0] for p in partials], [p[1] for p in partials])

full_out, full_lse = cuattn.attention(q, k, v, return_lse=True)
print(f"{chunks} chunks merged vs one pass: max |out diff| {float(abs(out.astype(np.float32) - full_out.astype(np.float32)).max()):.2e}, "
      f"max |lse diff| {float(abs(lse - full_lse).max()):.2e}")
