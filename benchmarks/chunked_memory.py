"""Device memory of attention as the key length grows past the device: the largest amount of
CuPy's memory pool in use during one forward (inputs included), for ``cuattn.attention`` with
K/V on the device and for ``cuattn.attention_chunked`` with K/V streamed from host memory.

    PYTHONPATH=. python benchmarks/chunked_memory.py [--keys 1M,4M,16M,64M] [--csv docs/bench/chunked/memory.csv]

bf16, batch 1, 256 query rows, GQA 32:8, head_dim 128: K and V take 4 KiB per key. Past what
host memory holds, the streamed rows repeat one page-locked block of keys (an iterable of
chunks), so the device still sees every key once, at its position.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cuattn
from benchmarks.bench_chunked import HEAD_DIM, HEADS_KV, HEADS_Q, _keys
from benchmarks.timing import environment, write_csv
from cuattn.dtypes import BFLOAT16

SEQLEN_Q = 256
CHUNK = 32768


class PeakPool:
    """CuPy's allocator through a memory pool whose largest use is recorded."""

    def __init__(self):
        import cupy

        self.pool = cupy.cuda.MemoryPool()
        self.peak = 0

    def malloc(self, size):
        mem = self.pool.malloc(size)
        self.peak = max(self.peak, self.pool.used_bytes())
        return mem

    def __enter__(self):
        import cupy

        cupy.cuda.set_allocator(self.malloc)
        return self

    def __exit__(self, *exc):
        import cupy

        cupy.cuda.get_current_stream().synchronize()
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
        self.pool.free_all_blocks()


def main() -> None:
    import cupy
    import cupyx

    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", default="1M,4M,16M,64M")
    parser.add_argument("--csv", default="results/chunked_memory.csv")
    args = parser.parse_args()
    env = environment()
    device_bytes = cupy.cuda.Device().mem_info[1]
    block = cupyx.empty_pinned((1, CHUNK, HEADS_KV, HEAD_DIM), BFLOAT16)
    block[...] = np.random.default_rng(0).standard_normal(block.shape, dtype=np.float32).astype(BFLOAT16)
    rows = []
    for keys in _keys(args.keys):
        kv_bytes = 2 * keys * HEADS_KV * HEAD_DIM * 2
        row = {"keys": keys, "kv_gib": round(kv_bytes / 2**30, 2)}
        dense_fits = kv_bytes * 1.02 < device_bytes
        if dense_fits:
            with PeakPool() as pool:
                q = cupy.ones((1, SEQLEN_Q, HEADS_Q, HEAD_DIM), BFLOAT16)
                k = cupy.ones((1, keys, HEADS_KV, HEAD_DIM), BFLOAT16)
                v = cupy.ones_like(k)
                cuattn.attention(q, k, v, return_lse=True)
                del q, k, v
            row["attention_gib"] = round(pool.peak / 2**30, 3)
        else:
            row["attention_gib"] = f"does not fit ({device_bytes / 2**30:.0f} GiB device)"
        with PeakPool() as pool:
            q = cupy.ones((1, SEQLEN_Q, HEADS_Q, HEAD_DIM), BFLOAT16)
            t0 = time.perf_counter()
            out, lse = cuattn.attention_chunked(q, ((block, block) for _ in range(keys // CHUNK)), return_lse=True)
            cupy.cuda.get_current_stream().synchronize()
            seconds = time.perf_counter() - t0
            finite = bool(cupy.isfinite(out.astype(cupy.float32)).all() and cupy.isfinite(lse).all())
            del q, out, lse
        row.update(chunked_gib=round(pool.peak / 2**30, 3), chunked_s=round(seconds, 2), chunked_gbs=round(kv_bytes / seconds / 1e9, 1),
                   finite=finite)
        rows.append(row)
        print(row, flush=True)
    write_csv(args.csv, [{**r, **env} for r in rows])
    print(f"\n{env['gpu']}: device memory of one forward, {SEQLEN_Q} query rows, GQA {HEADS_Q}:{HEADS_KV}, d{HEAD_DIM}, bf16")
    print(f"{'keys':>10} {'K/V GiB':>8} {'attention GiB':>28} {'chunked GiB':>11} {'chunked s':>9} {'GB/s':>6}")
    for r in rows:
        print(f"{r['keys']:>10} {r['kv_gib']:>8} {r['attention_gib']:>28} {r['chunked_gib']:>11} {r['chunked_s']:>9} {r['chunked_gbs']:>6}")


if __name__ == "__main__":
    main()
