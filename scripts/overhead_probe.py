"""Host time of one cuattn.attention call on a tiny problem (the GPU work is negligible).

    PYTHONPATH=. python3 scripts/overhead_probe.py [--profile]
"""

import cProfile
import pstats
import sys
import time

import torch

import cuattn

q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
for _ in range(20):
    cuattn.attention(q, q, q)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(1000):
    cuattn.attention(q, q, q)
torch.cuda.synchronize()
print(f"host time per call: {(time.perf_counter() - start) * 1e3:.1f} us")
if "--profile" in sys.argv:
    with cProfile.Profile() as prof:
        for _ in range(1000):
            cuattn.attention(q, q, q)
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
