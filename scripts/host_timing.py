"""Host-time helpers of the host probes (scripts/host_probe*.py): ``rate`` times long loops
(whichever of host and GPU is slower), ``host`` times bursts short enough for the launch queue
(the host alone), median over bursts, in microseconds per call."""
import time

import numpy as np


def rate(fn, sync, calls=2000):
    fn(); sync()
    s = time.perf_counter()
    for _ in range(calls): fn()
    sync()
    return (time.perf_counter() - s) / calls * 1e6


def host(fn, sync, burst=40, bursts=60):
    fn(); sync()
    ts = []
    for _ in range(bursts):
        sync()
        s = time.perf_counter_ns()
        for _ in range(burst): fn()
        ts.append((time.perf_counter_ns() - s) / burst / 1e3)
    sync()
    return float(np.median(ts))
