"""Per-kernel device time of block-sparse calls (torch.profiler), to separate the launch-order
kernel (sparse/block_schedule.cu) from the attention kernels. Run from a tree's root:

    PYTHONPATH=. python scripts/sparse_order_probe.py
"""

from __future__ import annotations

import collections
import sys

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

import cuattn
from benchmarks.bench_block_sparse import pattern_mask

CASES = [(16384, 32, 64, False, "random", 0.5), (16384, 32, 64, False, "random", 0.1), (16384, 16, 128, False, "local_global", 0.1)]


def kernel_times(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    totals = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            totals[e.name.split("<")[0].replace("cuattn::", "")[:28]] += e.device_time / reps
    return totals


def main():
    rng = np.random.default_rng(0)
    for seqlen, heads, d, causal, pattern, density in CASES:
        q, k, v = (torch.randn(1, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        mask = pattern_mask(pattern, rng, seqlen, heads, density, causal).to(lambda a: torch.as_tensor(a, device="cuda"))
        out, lse = cuattn.attention(q, k, v, causal=causal, block_mask=mask, return_lse=True)
        for mode, fn in (("fwd", lambda: cuattn.attention(q, k, v, causal=causal, block_mask=mask)),
                         ("bwd", lambda: cuattn.attention_backward(out, q, k, v, out, lse, causal=causal, block_mask=mask))):
            times = kernel_times(fn)
            cells = "  ".join(f"{name} {us:8.1f}" for name, us in sorted(times.items()))
            print(f"h{heads} d{d} {pattern:<12} {density:.2f} {mode}: {cells}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
