"""The GPU timeline of the last round in a torch.profiler chrome trace written by
``scripts/ring_probe.py`` (RING_PROFILE): each kernel, copy and memset after the last
all-reduce (the probe's barrier), with its start relative to that all-reduce, its length and
its stream, and each launch call's host time beside the start of the work it queued.

    python scripts/trace_timeline.py trace_0.json [trace_1.json ...]
"""

import json
import sys


def timeline(path: str) -> None:
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    gpu = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")}
    calls = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), key=lambda e: e["ts"])
    barriers = [i for i, e in enumerate(calls) if "AllReduce" in gpu.get(e["args"].get("correlation"), {}).get("name", "")]
    last = calls[barriers[-1]:]
    host0 = last[0]["ts"]
    gpu0 = gpu[last[0]["args"]["correlation"]]["ts"]
    print(f"== {path}: host us | call | GPU start us, length us, stream, work (both from the last all-reduce)")
    for e in last:
        g = gpu.get(e["args"].get("correlation"))
        if g is None:
            continue
        print(f"{e['ts'] - host0:9.1f} {e['name'][:18]:18s} {g['ts'] - gpu0:9.1f} {g['dur']:8.1f} s{g['args'].get('stream')} {g['name'][:70]}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        timeline(p)
