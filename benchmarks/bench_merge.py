"""Merge bandwidth: GB/s of the bytes merge must move (kernel time from a graph replay)
against the device copy bandwidth; the per-call time with Python overhead beside it.

    PYTHONPATH=. python benchmarks/bench_merge.py [--csv results/merge.csv]
"""

from __future__ import annotations

import argparse

import numpy as np

import cuattn
from benchmarks.timing import copy_bandwidth_gbs, environment, median_ms, write_csv


def graph_ms(fn, repeat: int = 20) -> float:
    """Kernel time without the Python call overhead: the call captured once in a CUDA graph,
    the graph replayed ``repeat`` times between two events."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        fn()  # warm: compiled kernel, pool blocks cached, so the capture allocates nothing new
        stream.synchronize()
        stream.begin_capture()
        fn()
        graph = stream.end_capture()
        graph.launch(stream)
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(repeat):
            graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeat


def main() -> None:
    import cupy

    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default="results/merge.csv")
    args = parser.parse_args()
    env = environment()
    copy = copy_bandwidth_gbs()
    rows = []
    rng = cupy.random.default_rng(0)
    for op, dtype, n, (b, s, h, d) in [
        ("merge", "bfloat16", 2, (8, 4096, 16, 128)),
        ("merge", "bfloat16", 4, (8, 4096, 16, 128)),
        ("merge", "bfloat16", 2, (8, 4096, 32, 64)),
        ("merge", "bfloat16", 2, (4, 4096, 8, 256)),
        ("merge", "float16", 8, (4, 4096, 16, 128)),
        ("merge", "bfloat16", 16, (1, 4096, 16, 128)),
        ("merge", "float32", 2, (4, 4096, 16, 128)),
        ("merge_", "bfloat16", 2, (8, 4096, 16, 128)),
        ("merge_", "float32", 2, (4, 4096, 16, 128)),
    ]:
        np_dtype = cuattn.dtypes.BFLOAT16 if dtype == "bfloat16" else np.dtype(dtype)
        outs = rng.standard_normal((n, b, s, h, d), dtype=np.float32).astype(np_dtype)
        lses = rng.standard_normal((n, b, h, s), dtype=np.float32)
        if op == "merge":
            call = lambda: cuattn.merge(outs, lses)  # noqa: E731
        else:  # in place into partial 0; replays only grow its lse by at most log 2 each
            call = lambda: cuattn.merge_(outs[0], lses[0], outs[1], lses[1])  # noqa: E731
        call_ms = median_ms(lambda _: call())
        ms = graph_ms(call)
        rows_ = b * s * h
        moved = (n + 1) * rows_ * (d * np_dtype.itemsize + 4)
        gbs = moved / ms / 1e6
        rows.append({"op": op, "dtype": dtype, "partials": n, "shape": f"{b}x{s}x{h}x{d}", "kernel_ms": round(ms, 4), "call_ms": round(call_ms, 4), "GB/s": round(gbs, 1), "of_copy": round(gbs / copy, 3), **env})
    write_csv(args.csv, rows)
    print(f"{env['gpu']}, {env['date']}: device copy {copy:.0f} GB/s (read + write)")
    print(f"{'op':<7} {'dtype':<9} {'N':>2} {'shape':<18} {'kernel ms':>9} {'call ms':>8} {'GB/s':>7} {'of copy':>8}")
    for r in rows:
        print(f"{r['op']:<7} {r['dtype']:<9} {r['partials']:>2} {r['shape']:<18} {r['kernel_ms']:>9.4f} {r['call_ms']:>8.4f} {r['GB/s']:>7.0f} {r['of_copy']:>8.0%}")


if __name__ == "__main__":
    main()
