"""GB/s of the decode benchmark's rows (bf16, GQA 32:8, head_dim 128, L2-cold as `python -m
benchmarks decode` times them) at explicit split counts beside the default: whether fewer, longer
splits (a narrower merge) or more would serve a row better than the one-wave default.

    PYTHONPATH=. python scripts/decode_splits_probe.py --rows 1x32768,4x8192 --splits 0,8,16,24
(0: the default, num_splits=None.) ``--pages in_order``: each sequence's pages consecutive in the
pool (the table an arange) instead of shuffled, to tell the cost of scattered pages from the
cost of the paged addressing itself; ``--pages local:2097152`` shuffles them only within runs of
that many bytes of pool (whether what scattered pages lose is address translation, 2 MB
pages, or a finer locality).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from benchmarks.bench_decode import _gbs, _paged, rotated_row  # noqa: E402


class _InOrder:
    """Stands in for the generator whose permutation shuffles the pages: the identity."""

    def permutation(self, n: int) -> np.ndarray:
        return np.arange(n)


class _Local:
    """Shuffles the pool's pages within runs of ``run_bytes`` (the page size read from the
    bytes of one page of the row at hand, set before each use)."""

    def __init__(self, run_bytes: int):
        self.run_bytes, self.page_bytes, self.rng = run_bytes, None, np.random.default_rng(0)

    def permutation(self, n: int) -> np.ndarray:
        run = max(1, self.run_bytes // self.page_bytes)
        order = np.arange(n)
        for start in range(0, n, run):
            order[start:start + run] = start + self.rng.permutation(min(run, n - start))
        return order


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1x32768,4x8192")
    parser.add_argument("--splits", default="0,8,16,24,32")
    parser.add_argument("--pages", default="shuffled", help="shuffled, in_order or local:BYTES")
    args = parser.parse_args()
    if args.pages.startswith("local:"):
        rng = _Local(int(args.pages.split(":")[1]))
    else:
        rng = {"shuffled": np.random.default_rng(0), "in_order": _InOrder()}[args.pages]
    splits = [int(s) or None for s in args.splits.split(",")]
    print(f"{'row':>10}  " + "  ".join(f"{'splits ' + str(s or 'default'):>22}" for s in splits) + "   (contiguous/page16/page1 GB/s)")
    for batch, seqlen in (tuple(map(int, r.split("x"))) for r in args.rows.split(",")):
        nbytes, sets, q, kv, lengths = rotated_row(batch, seqlen)
        paged = {}
        for ps in (16, 1):
            if isinstance(rng, _Local):
                rng.page_bytes = ps * kv[0][0][0, 0].numel() * kv[0][0].element_size()
            paged[ps] = [_paged(k, v, ps, rng) for k, v in kv]
        cells = []
        for n in splits:
            rates = [_gbs(nbytes, lambda i: cuattn.attention_with_kvcache(q[i], *kv[i], cache_seqlens=lengths, num_splits=n), sets)]
            for ps in (16, 1):
                rates.append(_gbs(nbytes, lambda i: cuattn.attention_with_kvcache(
                    q[i], paged[ps][i][0], paged[ps][i][1], cache_seqlens=lengths, block_table=paged[ps][i][2], num_splits=n), sets))
            cells.append("/".join(f"{r:.0f}" for r in rates))
        print(f"{f'b{batch}s{seqlen}':>10}  " + "  ".join(f"{c:>22}" for c in cells), flush=True)
        del q, kv, paged


if __name__ == "__main__":
    main()
