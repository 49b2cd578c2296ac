"""The TMA backward (backward_tma.cu) against the copying one-pass kernel on the same inputs:
max |difference| of each gradient and kernel times, d64 / d128, causal and not.

    PYTHONPATH=. python scripts/tma_backward_probe.py
"""

import cupy
import numpy as np

import cuattn
from benchmarks.timing import copying, median_ms


def main() -> None:
    rng = np.random.default_rng(0)
    for d in (64, 128, 96):
        for causal in (False, True):
            for b, s, hq, hk in ((1, 1000, 4, 2), (2, 4096, 2048 // d, 2048 // d)):
                q, k, v, do = (cupy.asarray(rng.standard_normal((b, s, h, d), np.float32)).astype(cupy.float16) for h in (hq, hk, hk, hq))
                out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
                call = lambda: cuattn.attention_backward(do, q, k, v, out, lse, causal=causal)  # noqa: E731
                results, times = {}, {}
                for tma, fn in (("1", call), ("0", copying(call))):
                    results[tma] = [g.astype(cupy.float32) for g in fn()]
                    times[tma] = median_ms(lambda _: fn(), repeat=10)
                diffs = [float(cupy.abs(x - y).max()) / max(float(cupy.abs(y).max()), 1e-6) for x, y in zip(results["1"], results["0"])]
                nan = any(bool(cupy.isnan(x).any()) for x in results["1"])
                flops = 2.5 * 4 * b * hq * s * s * d / (2 if causal else 1)
                print(f"d{d} s{s} b{b} h{hq}/{hk} causal={causal}: rel diff dq/dk/dv {diffs[0]:.2e} {diffs[1]:.2e} {diffs[2]:.2e} nan={nan} "
                      f"tma {flops / times['1'] / 1e9:.0f} copying {flops / times['0'] / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
