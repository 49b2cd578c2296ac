"""GB/s of the decode benchmark's rows (bf16, GQA 32:8, head_dim 128, L2-cold as `python -m
benchmarks decode` times them) at explicit split counts beside the default: whether fewer, longer
splits (a narrower merge) or more would serve a row better than the one-wave default.

    PYTHONPATH=. python scripts/decode_splits_probe.py --rows 1x32768,4x8192 --splits 0,8,16,24
(0: the default, num_splits=None.) ``--pages in_order``: each sequence's pages consecutive in the
pool (the table an arange) instead of shuffled, to tell the cost of scattered pages from the
cost of the paged addressing itself.
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1x32768,4x8192")
    parser.add_argument("--splits", default="0,8,16,24,32")
    parser.add_argument("--pages", choices=("shuffled", "in_order"), default="shuffled")
    args = parser.parse_args()
    rng = np.random.default_rng(0) if args.pages == "shuffled" else _InOrder()
    splits = [int(s) or None for s in args.splits.split(",")]
    print(f"{'row':>10}  " + "  ".join(f"{'splits ' + str(s or 'default'):>22}" for s in splits) + "   (contiguous/page16/page1 GB/s)")
    for batch, seqlen in (tuple(map(int, r.split("x"))) for r in args.rows.split(",")):
        nbytes, sets, q, kv, lengths = rotated_row(batch, seqlen)
        paged = {ps: [_paged(k, v, ps, rng) for k, v in kv] for ps in (16, 1)}
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
