"""Merge kernel shapes side by side: rows per lane (1, 2, 4) at each partial-count cap, on the
bench_merge cases; GB/s and share of the device copy, kernel time from a graph replay.

    PYTHONPATH=. python scripts/merge_probe.py [--csv results/merge_probe.csv]
"""

from __future__ import annotations

import argparse

import numpy as np

import cuattn
from benchmarks.bench_merge import graph_ms
from benchmarks.timing import copy_bandwidth_gbs, environment, write_csv
from cuattn import replay
from cuattn.kernels import merge as plan

CASES = [
    ("bfloat16", 2, (8, 4096, 16, 128)),
    ("bfloat16", 2, (8, 4096, 32, 64)),
    ("bfloat16", 2, (4, 4096, 8, 256)),
    ("bfloat16", 4, (8, 4096, 16, 128)),
    ("float16", 8, (4, 4096, 16, 128)),
    ("bfloat16", 16, (1, 4096, 16, 128)),
    ("float32", 2, (4, 4096, 16, 128)),
]


_ONE_PASS = plan.grid


def _capped_grid(blocks_per_sm):
    """The one-pass grid, or at most blocks_per_sm blocks per SM (the kernel strides)."""
    def grid(rows, head_dim, vec, rows_per_lane=1, sms=132):
        plan.BLOCKS_PER_SM = blocks_per_sm or 2**31
        return _ONE_PASS(rows, head_dim, vec, rows_per_lane, sms)
    return grid


def main() -> None:
    import cupy

    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default="results/merge_probe.csv")
    args = parser.parse_args()
    env, copy = environment(), copy_bandwidth_gbs()
    rng = cupy.random.default_rng(0)
    rows = []
    for dtype, n, (b, s, h, d) in CASES:
        np_dtype = cuattn.dtypes.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
        outs = rng.standard_normal((n, b, s, h, d), dtype=np.float32).astype(np_dtype)
        lses = rng.standard_normal((n, b, h, s), dtype=np.float32)
        cap = plan.cap_for(n, 8)
        reference = None
        for per_lane, blocks_per_sm in [(r, None) for r in (1, 2, 4)] + [(r, c) for r in (1, 2) for c in (4, 8, 16)]:
            plan.ROWS_PER_LANE[cap] = per_lane
            plan.variant.cache_clear()
            plan.grid = _capped_grid(blocks_per_sm)
            replay.clear()
            out, lse = cuattn.merge(outs, lses)
            if reference is None:
                reference = (out.copy(), lse.copy())
            same = bool((out == reference[0]).all() and (lse == reference[1]).all())
            ms = graph_ms(lambda: cuattn.merge(outs, lses))
            gbs = (n + 1) * b * s * h * (d * np_dtype.itemsize + 4) / ms / 1e6
            rows.append({"dtype": dtype, "partials": n, "shape": f"{b}x{s}x{h}x{d}", "rows_per_lane": per_lane, "blocks_per_sm": blocks_per_sm or "",
                         "kernel_ms": round(ms, 4), "GB/s": round(gbs, 1), "of_copy": round(gbs / copy, 3), "same": same, **env})
    write_csv(args.csv, rows)
    print(f"{env['gpu']}: device copy {copy:.0f} GB/s")
    for r in rows:
        print(f"{r['dtype']:<9} {r['partials']:>2} {r['shape']:<16} rows/lane {r['rows_per_lane']} blocks/SM {r['blocks_per_sm'] or '-':>2}  {r['kernel_ms']:.4f} ms  {r['GB/s']:>6.0f} GB/s  {r['of_copy']:>4.0%}  same={r['same']}")


if __name__ == "__main__":
    main()
