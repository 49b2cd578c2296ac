"""Kernel by kernel, where the simulated ring's time goes against the same pieces as plain calls
(W = 2, causal zigzag, d128, GQA 32:8, bf16, one GPU): torch.profiler's CUDA activity (it sees
CuPy's launches too), summed by kernel name over ``--rounds`` calls after a warm-up.

    PYTHONPATH=<tree>:. python scripts/ring_kernel_profile.py [--tokens-per-rank 8192] [--rounds 5]
"""

import argparse
import collections
import os
import sys

import cupy
import torch
from torch.profiler import ProfilerActivity, profile

import cuattn
import cuattn.dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ring_pieces_probe import case  # noqa: E402


def kernel_table(fn, rounds: int):
    """{kernel name: (launches per call, us per call)}, and the summed kernel time per call."""
    fn()
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            fn()
        cupy.cuda.Device().synchronize()
    acc = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.split("(")[0].split("<")[0][:60]
            if "<" in e.name:  # the template's first arguments tell the variants apart
                name += "<" + e.name.split("<", 1)[1][:50]
            acc[name][0] += 1
            acc[name][1] += e.device_time
    table = {n: (c / rounds, t / rounds) for n, (c, t) in acc.items()}
    return table, sum(t for _, t in table.values())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens-per-rank", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    (q, k, v, dout, out, lse), (qs, ks, vs, ds, outs, lses), pieces, piece_outs = case(args.tokens_per_rank)
    cases = {
        "single_fwd": lambda: cuattn.attention(q, k, v, causal=True, return_lse=True),
        "ring_fwd": lambda: cuattn.dist.ring_attention_simulated(qs, ks, vs, layout="zigzag", causal=True, return_lse=True),
        "pieces_fwd": lambda: [cuattn.attention(pq, pk, pv, causal=c, return_lse=True) for pq, pk, pv, _, c in pieces],
        "single_bwd": lambda: cuattn.attention_backward(dout, q, k, v, out, lse, causal=True),
        "ring_bwd": lambda: cuattn.dist.ring_attention_backward_simulated(ds, qs, ks, vs, outs, lses, layout="zigzag", causal=True),
        "pieces_bwd": lambda: [cuattn.attention_backward(pd, pq, pk, pv, o, lz, causal=c)
                               for (pq, pk, pv, pd, c), (o, lz) in zip(pieces, piece_outs)],
    }
    for name, fn in cases.items():
        table, total = kernel_table(fn, args.rounds)
        print(f"== {name} tokens/rank {args.tokens_per_rank}: kernels {total / 1000:.3f} ms per call")
        for kname, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            print(f"  {us:9.1f} us  x{count:4.1f}  {kname}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
