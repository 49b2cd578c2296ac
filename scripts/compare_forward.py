"""Dense forward TFLOP/s of the package on PYTHONPATH, and varlen on the same tokens (equal
lengths) and on a ragged batch next to padding it; one line per case (H100 probe).

    PYTHONPATH=old python3 scripts/compare_forward.py --dense-only; PYTHONPATH=. python3 scripts/compare_forward.py
"""
import sys

import cupy
import numpy as np

import cuattn
from benchmarks.timing import median_ms

dense_only = "--dense-only" in sys.argv
rng = np.random.default_rng(0)


def tflops(flops, ms):
    return flops / ms / 1e9


for d in (64, 128):
    for s, causal in ((1024, False), (4096, True), (16384, False)):
        b, h = 16384 // s, 2048 // d
        q, k, v = (cupy.random.standard_normal((b, s, h, d), dtype=np.float32).astype(cuattn.dtypes.BFLOAT16) for _ in range(3))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        dense = tflops(flops, median_ms(lambda i: cuattn.attention(q, k, v, causal=causal)))
        line = f"d{d} s{s} b{b} causal={causal}: dense {dense:6.1f}"
        if not dense_only:
            cu = cupy.arange(0, b * s + 1, s, dtype=cupy.int32)
            qp, kp, vp = (x.reshape(b * s, h, d) for x in (q, k, v))
            packed = tflops(flops, median_ms(lambda i: cuattn.attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=s, causal=causal)))
            line += f"  varlen {packed:6.1f} ({packed / dense:.3f}x)"
        print(line, flush=True)
if not dense_only:
    # ragged: lengths uniform in [1, 4096], 16k tokens; padding to the longest
    lengths = rng.integers(1, 4097, 8)
    lengths = (lengths * 16384 / lengths.sum()).astype(int).clip(1, 4096)
    d, h = 128, 16
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    total, longest = int(lengths.sum()), int(lengths.max())
    qp, kp, vp = (cupy.random.standard_normal((total, h, d), dtype=np.float32).astype(cuattn.dtypes.BFLOAT16) for _ in range(3))
    qd, kd, vd = (cupy.random.standard_normal((len(lengths), longest, h, d), dtype=np.float32).astype(cuattn.dtypes.BFLOAT16) for _ in range(3))
    flops = sum(4 * h * int(n) * int(n) * d / 2 for n in lengths)
    varlen_ms = median_ms(lambda i: cuattn.attention_varlen(qp, kp, vp, cu, cu, max_seqlen_q=longest, causal=True))
    padded_ms = median_ms(lambda i: cuattn.attention(qd, kd, vd, causal=True))
    print(f"ragged {lengths.tolist()} d{d} causal: varlen {varlen_ms:.3f} ms ({tflops(flops, varlen_ms):.1f} useful TFLOP/s), "
          f"padded dense {padded_ms:.3f} ms; padding fraction {1 - total / (len(lengths) * longest):.2f}")
