"""Dense backward TFLOP/s of the package on PYTHONPATH (default kernel path), one line per
case: an A/B probe of a kernel change (run old and new alternately on the same GPU).

    PYTHONPATH=old python3 scripts/compare_backward.py; PYTHONPATH=. python3 scripts/compare_backward.py
"""
import cupy
import numpy as np

import cuattn
from benchmarks.timing import median_ms

for d in (64, 128):
    for s, causal in ((1024, False), (4096, True), (16384, False)):
        b, h = 16384 // s, 2048 // d
        q, k, v, do = (cupy.random.standard_normal((b, s, h, d), dtype=np.float32).astype(cuattn.dtypes.BFLOAT16) for _ in range(4))
        out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        line = f"d{d} s{s} causal={causal}:"
        for deterministic in (False, True):
            ms = median_ms(lambda i: cuattn.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic))
            line += f"  {'det' if deterministic else 'default'} {flops / ms / 1e9:6.1f}"
        print(line, flush=True)
