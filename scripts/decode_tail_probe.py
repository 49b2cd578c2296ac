"""Where a decode step's fixed time goes on caches of about 128 MB (issue 21's 90%-of-copy bar):
GB/s of K/V read, L2-cold as `python -m benchmarks decode` times them, for the default call, the
same call with its split merge (decode_combine) left out (the result is then wrong: this only
times what the merge adds), other split counts, and a plain device copy moving as many bytes
(read + write) over rotated buffers, beside the 1 GB copy the benchmark reports.

    PYTHONPATH=. python scripts/decode_tail_probe.py [--rows 1x32768,4x8192,1x131072]
"""

from __future__ import annotations

import argparse
import inspect
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cuattn  # noqa: E402
from benchmarks.bench_decode import _gbs, rotated_row  # noqa: E402
from benchmarks.timing import copy_bandwidth_gbs  # noqa: E402
from cuattn import decode, replay  # noqa: E402


def _without_merge():
    """decode._launch_decode with the launch of decode_combine removed."""
    source = inspect.getsource(decode._launch_decode)
    cut = source.index("        if splits > 1:\n            combine")
    namespace = dict(vars(decode))
    exec(source[:cut].replace("def _launch_decode", "def _launch_decode_unmerged"), namespace)
    return namespace["_launch_decode_unmerged"]


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1x32768,4x8192,1x131072,16x8192")
    parser.add_argument("--splits", default="8,32")
    args = parser.parse_args()
    merged, unmerged = decode._launch_decode, _without_merge()
    print(f"copy 1 GB: {copy_bandwidth_gbs():.0f} GB/s")
    for batch, seqlen in (tuple(map(int, r.split("x"))) for r in args.rows.split(",")):
        nbytes, sets, q, kv, lengths = rotated_row(batch, seqlen)
        cells = {}
        for name, launch, splits in [("default", merged, None), ("no merge", unmerged, None)] + [
                (f"splits {s}", merged, int(s)) for s in args.splits.split(",")]:
            decode._launch_decode = launch
            replay.clear()
            cells[name] = _gbs(nbytes, lambda i: cuattn.attention_with_kvcache(q[i], *kv[i], cache_seqlens=lengths, num_splits=splits), sets)
        decode._launch_decode = merged
        half = nbytes // 2 // 2  # elements of bf16 moved per copy: nbytes read + written
        src = [torch.empty(half, device="cuda", dtype=torch.bfloat16).normal_() for _ in range(sets)]
        dst = [torch.empty_like(x) for x in src]
        cells["copy same bytes"] = _gbs(nbytes, lambda i: dst[i].copy_(src[i]), sets)
        print(f"b{batch} s{seqlen} ({nbytes / 2**20:.0f} MB): " + ", ".join(f"{k} {v:.0f}" for k, v in cells.items()), flush=True)
        del q, kv, src, dst


if __name__ == "__main__":
    main()
