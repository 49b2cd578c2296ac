"""What folding a partial result into the fp32 accumulator costs (the forward's FOLD form, used
by streamed K/V and the ring), against merging partials with a separate launch.

For N key pieces of one query block (ring steps with the K/V already on the device), in one
run on one GPU:
- ``plain``: N ``cuattn.attention`` calls (each writes its own out, lse);
- ``fold``: ``cuattn.attention_chunked`` over the same N device pieces (each launch folds into
  the fp32 accumulator; one cast at the end);
- ``merge``: N ``cuattn.attention(return_lse=True)`` calls plus ``cuattn.merge`` of the N
  partials (the separate-launch schedule).
The fold's extra time is compared with the bytes it moves (the fp32 accumulator read and
written, the lse) as an effective bandwidth, next to the device copy bandwidth.

    PYTHONPATH=. python benchmarks/bench_fold.py [--csv docs/bench/ring/fold.csv]
"""

from __future__ import annotations

import argparse

import numpy as np

import cuattn
from benchmarks.timing import copy_bandwidth_gbs, environment, write_csv
from cuattn.dtypes import BFLOAT16


def _events_ms(fn, repeat: int = 5) -> float:
    import cupy

    fn()
    times = []
    for _ in range(repeat):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return float(np.median(times))


def main() -> None:
    import cupy

    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default="results/fold.csv")
    args = parser.parse_args()
    env = environment()
    copy = copy_bandwidth_gbs()
    rows = []
    rng = cupy.random.default_rng(0)
    for rows_q, heads_q, heads_kv, head_dim, keys, pieces in [
        (4096, 32, 8, 128, 4096, 8),
        (8192, 16, 16, 128, 8192, 4),
        (4096, 32, 32, 64, 4096, 8),
    ]:
        q = rng.standard_normal((1, rows_q, heads_q, head_dim), dtype=np.float32).astype(BFLOAT16)
        kv = [tuple(rng.standard_normal((1, keys, heads_kv, head_dim), dtype=np.float32).astype(BFLOAT16) for _ in range(2))
              for _ in range(pieces)]
        plain = _events_ms(lambda: [cuattn.attention(q, k, v) for k, v in kv])
        fold = _events_ms(lambda: cuattn.attention_chunked(q, kv))
        merge = _events_ms(lambda: cuattn.merge(*map(list, zip(*[cuattn.attention(q, k, v, return_lse=True) for k, v in kv]))))
        acc_bytes = rows_q * heads_q * head_dim * 4 * 2 + rows_q * heads_q * 4 * 2  # accumulator and lse, read and written
        extra = (fold - plain) / pieces
        rows.append({
            "rows_q": rows_q, "heads": f"{heads_q}/{heads_kv}", "head_dim": head_dim, "keys_per_piece": keys, "pieces": pieces,
            "plain_ms": round(plain, 3), "fold_ms": round(fold, 3), "merge_ms": round(merge, 3),
            "fold_extra_per_piece_us": round(extra * 1e3, 1), "fold_extra_fraction": round((fold - plain) / plain, 4),
            "fold_gbs": round(acc_bytes / (extra * 1e6), 1) if extra > 0 else "inf", "copy_gbs": round(copy, 1),
            "merge_extra_fraction": round((merge - plain) / plain, 4),
        })
        print(rows[-1], flush=True)
    write_csv(args.csv, [{**r, **env} for r in rows])
    print(f"\n{env['gpu']}: folding partials in the epilogue vs merging them afterwards (copy {copy:.0f} GB/s)")
    print(f"{'rows':>5} {'heads':>6} {'d':>4} {'pieces':>6} {'plain ms':>9} {'fold ms':>8} {'merge ms':>9} {'fold +%':>8} {'merge +%':>9} {'fold GB/s':>9}")
    for r in rows:
        print(f"{r['rows_q']:>5} {r['heads']:>6} {r['head_dim']:>4} {r['pieces']:>6} {r['plain_ms']:>9} {r['fold_ms']:>8} {r['merge_ms']:>9} "
              f"{100 * r['fold_extra_fraction']:>7.2f}% {100 * r['merge_extra_fraction']:>8.2f}% {r['fold_gbs']:>9}")


if __name__ == "__main__":
    main()
