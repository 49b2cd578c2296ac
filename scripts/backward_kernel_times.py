"""Per-kernel GPU time of the dense backward (CUDA events around each launch, replay off), for an
A/B of a kernel change: PYTHONPATH=old python3 scripts/backward_kernel_times.py; then PYTHONPATH=.
"""
import os
import statistics

os.environ["CUATTN_REPLAY"] = "0"
import cupy
import numpy as np

import cuattn
from cuattn import boundary

times = {}
launch = boundary.CallContext.launch


def timed_launch(self, variant, grid, block, p):
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    launch(self, variant, grid, block, p)
    stop.record()
    times.setdefault(variant.kernel, []).append((start, stop))


boundary.CallContext.launch = timed_launch
for d, s, causal in ((64, 1024, False), (64, 4096, True), (128, 1024, False)):
    b, h = 16384 // s, 2048 // d
    q, k, v, do = (cupy.random.standard_normal((b, s, h, d), dtype=np.float32).astype(cuattn.dtypes.BFLOAT16) for _ in range(4))
    out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
    for _ in range(3):
        cuattn.attention_backward(do, q, k, v, out, lse, causal=causal)
    times.clear()
    for _ in range(30):
        cuattn.attention_backward(do, q, k, v, out, lse, causal=causal)
    cupy.cuda.Device().synchronize()
    line = " ".join(f"{f.replace('backward_', '')} {statistics.median(cupy.cuda.get_elapsed_time(a, z) for a, z in ev) * 1000:7.1f}us"
                    for f, ev in times.items())
    print(f"d{d} s{s} causal={causal}: {line}", flush=True)
