"""Host time of one decode step (batch 1, 1k cached tokens, bf16, GQA 32:8, d128), back-to-back
calls synchronized at the end, for the ways of calling it, beside SDPA; then a cProfile of the
torch-tensor call's Python (what a replayed step spends its host time on).

    PYTHONPATH=. python scripts/decode_host_probe.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuattn


def wall(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    import cupy

    q = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1024, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((1,), 1024, dtype=torch.int32, device="cuda")
    dst = torch.empty_like(q)
    views = [x.transpose(1, 2) for x in (q, k, v)]
    cq, ck, cv, cl, cd = (cupy.from_dlpack(x) for x in (q, k, v, lengths, dst))
    calls = {
        "torch tensors": lambda: cuattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths),
        "torch tensors, out=": lambda: cuattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths, out=dst),
        "cupy arrays": lambda: cuattn.attention_with_kvcache(cq, ck, cv, cache_seqlens=cl),
        "cupy arrays, out=": lambda: cuattn.attention_with_kvcache(cq, ck, cv, cache_seqlens=cl, out=cd),
        "SDPA (enable_gqa)": lambda: sdpa(*views, enable_gqa=True),
        "bare torch launch (q * 2)": lambda: q * 2,
    }
    with torch.no_grad():
        for name, fn in calls.items():
            print(f"{name:<28} {wall(fn):6.1f} us per call", flush=True)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(3000):
            calls["torch tensors"]()
        profile.disable()
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
