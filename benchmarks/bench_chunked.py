"""K/V streamed from host memory (cuattn.attention_chunked): wall time of the streamed forward
and backward next to, measured in the same run, the host-to-device copy of the same bytes in
the same chunks (page-locked, nothing else running), the device-resident compute of the same
work (cuattn.attention / attention_backward over K/V already on the device), and their max.
The bar of the issue: streamed <= 1.15 x max(copy, compute).

    PYTHONPATH=. python benchmarks/bench_chunked.py [--keys 1M,2M,4M] [--csv docs/bench/chunked/chunked.csv]

bf16, batch 1, GQA 32:8, head_dim 128. The host K/V (2 x keys x 8 x 128 x 2 bytes: 4 KiB
per key) are filled by tiling one random block, so the memory is real and touched.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import cuattn
from benchmarks.timing import environment, write_csv
from cuattn.dtypes import BFLOAT16

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128


def _keys(text: str) -> list[int]:
    scale = {"K": 1 << 10, "M": 1 << 20}
    return [int(float(t[:-1]) * scale[t[-1]]) if t[-1] in scale else int(t) for t in text.split(",")]


def _host_kv(keys: int, pinned: bool):
    import cupyx

    rng = np.random.default_rng(0)
    block = rng.standard_normal((1, 1 << 14, HEADS_KV, HEAD_DIM), dtype=np.float32).astype(BFLOAT16)
    arrays = []
    for _ in range(2):
        a = cupyx.empty_pinned((1, keys, HEADS_KV, HEAD_DIM), BFLOAT16) if pinned else np.empty((1, keys, HEADS_KV, HEAD_DIM), BFLOAT16)
        for s in range(0, keys, block.shape[1]):
            n = min(block.shape[1], keys - s)
            a[:, s:s + n] = block[:, :n]
        arrays.append(a)
    return arrays


def _wall_ms(fn, repeat: int = 3) -> float:
    import cupy

    times = []
    for _ in range(repeat + 1):
        cupy.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.get_current_stream().synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times[1:]))


def _copy_ms(k, v, chunk: int, directions: int = 1) -> float:
    """The same bytes in the same chunks, host to device (and back, on a second stream, for
    the backward's dK / dV): two device slots, copies only."""
    import cupy

    rt = cupy.cuda.runtime
    nbytes = chunk * HEADS_KV * HEAD_DIM * 2
    slots = [cupy.empty(nbytes, cupy.uint8) for _ in range(2)]
    up, down = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    keys = k.shape[1]
    host_out = [k, v]  # the D2H direction writes back into the same host rows (timing only)

    def run():
        for s in range(0, keys, chunk):
            n = min(chunk, keys - s) * HEADS_KV * HEAD_DIM * 2
            for i, a in enumerate((k, v)):
                ptr = a.ctypes.data + s * HEADS_KV * HEAD_DIM * 2
                rt.memcpyAsync(slots[i % 2].data.ptr, ptr, n, rt.memcpyHostToDevice, up.ptr)
                if directions == 2:
                    rt.memcpyAsync(host_out[i].ctypes.data + s * HEADS_KV * HEAD_DIM * 2, slots[i % 2].data.ptr, n, rt.memcpyDeviceToHost, down.ptr)
        up.synchronize()
        down.synchronize()

    return _wall_ms(run)


def main() -> None:
    import cupy

    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", default="1M,2M,4M")
    parser.add_argument("--seqlen-q", default="1024,4096")
    parser.add_argument("--chunk-tokens", type=int, default=16384)  # the default for this shape: 128 MiB of K and V
    parser.add_argument("--pageable", action="store_true", help="also time pageable host K/V at the smallest key count")
    parser.add_argument("--csv", default="results/chunked.csv")
    args = parser.parse_args()
    env = environment()
    rows = []
    chunk = args.chunk_tokens
    for keys in _keys(args.keys):
        k, v = _host_kv(keys, pinned=True)
        kd, vd = cupy.asarray(k), cupy.asarray(v)  # the device-resident comparison
        nbytes = k.nbytes + v.nbytes
        h2d = _copy_ms(k, v, chunk)
        both = _copy_ms(k, v, chunk, directions=2)
        for sq in (int(s) for s in args.seqlen_q.split(",")):
            rng = cupy.random.default_rng(1)
            q = rng.standard_normal((1, sq, HEADS_Q, HEAD_DIM), dtype=cupy.float32).astype(BFLOAT16)
            dout = rng.standard_normal(q.shape, dtype=cupy.float32).astype(BFLOAT16)
            flops = 4 * HEADS_Q * sq * keys * HEAD_DIM
            out, lse = cuattn.attention(q, kd, vd, return_lse=True)
            fwd_dev = _wall_ms(lambda: cuattn.attention(q, kd, vd, return_lse=True))
            bwd_dev = _wall_ms(lambda: cuattn.attention_backward(dout, q, kd, vd, out, lse))
            fwd = _wall_ms(lambda: cuattn.attention_chunked(q, (k, v), chunk_tokens=chunk, return_lse=True))
            bwd = _wall_ms(lambda: cuattn.attention_chunked_backward(dout, q, (k, v), out, lse, chunk_tokens=chunk))
            for mode, streamed, copy, dev, f in (("fwd", fwd, h2d, fwd_dev, flops), ("bwd", bwd, both, bwd_dev, 2.5 * flops)):
                rows.append({
                    "mode": mode, "keys": keys, "seqlen_q": sq, "host": "pinned", "chunk_tokens": chunk, "gib": round(nbytes / 2**30, 2),
                    "streamed_ms": round(streamed, 1), "copy_ms": round(copy, 1), "compute_ms": round(dev, 1),
                    "ratio_to_max": round(streamed / max(copy, dev), 3),
                    "h2d_gbs": round(nbytes / streamed / 1e6, 1), "copy_gbs": round(nbytes / copy / 1e6, 1),
                    "streamed_tflops": round(f / streamed / 1e9, 1), "compute_tflops": round(f / dev / 1e9, 1),
                })
                print(rows[-1], flush=True)
        del kd, vd
        if args.pageable and keys == min(_keys(args.keys)):
            kp, vp = _host_kv(keys, pinned=False)
            sq = int(args.seqlen_q.split(",")[0])
            q = cupy.random.default_rng(1).standard_normal((1, sq, HEADS_Q, HEAD_DIM), dtype=cupy.float32).astype(BFLOAT16)
            streamed = _wall_ms(lambda: cuattn.attention_chunked(q, (kp, vp), chunk_tokens=chunk))
            rows.append({
                "mode": "fwd", "keys": keys, "seqlen_q": sq, "host": "pageable", "chunk_tokens": chunk, "gib": round(nbytes / 2**30, 2),
                "streamed_ms": round(streamed, 1), "copy_ms": round(h2d, 1), "compute_ms": "", "ratio_to_max": "",
                "h2d_gbs": round(nbytes / streamed / 1e6, 1), "copy_gbs": round(nbytes / h2d / 1e6, 1),
            })
            del kp, vp
        del k, v
    write_csv(args.csv, [{**r, **env} for r in rows])
    print(f"\n{env['gpu']}: streamed K/V, bf16, GQA {HEADS_Q}:{HEADS_KV}, d{HEAD_DIM}, chunks of {chunk} keys")
    print(f"{'mode':>4} {'keys':>8} {'sq':>5} {'host':>8} {'GiB':>5} {'streamed':>9} {'copy':>8} {'compute':>8} {'/max':>6} {'GB/s':>6} {'copy GB/s':>9}")
    for r in rows:
        print(f"{r['mode']:>4} {r['keys']:>8} {r['seqlen_q']:>5} {r['host']:>8} {r['gib']:>5} {r['streamed_ms']:>9} {r['copy_ms']:>8} "
              f"{r['compute_ms']:>8} {r['ratio_to_max']:>6} {r['h2d_gbs']:>6} {r['copy_gbs']:>9}")


if __name__ == "__main__":
    main()
