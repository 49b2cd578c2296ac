"""Times ring depths and split policies of the decode kernel (cuattn.kernels.decode.STAGES and
PAGED_STAGES, MIN_BLOCKS_PER_SPLIT) on a few rows of the decode benchmark, bf16, GQA 32:8, head_dim 128:
GB/s of K/V read for a contiguous cache and pages of 16 and 1.

    PYTHONPATH=. python scripts/tune_decode.py --stages 2,3,4 --min-blocks 2,4,8
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from benchmarks.bench_decode import HEAD_DIM, HEADS_KV, HEADS_Q, _gbs, _paged  # noqa: E402
from cuattn import replay  # noqa: E402
from cuattn.kernels import decode as plan  # noqa: E402


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="2,3,4")
    parser.add_argument("--min-blocks", default="2,4,8")
    parser.add_argument("--rows", default="1x8192,1x32768,16x8192,16x32768,64x2048")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = [tuple(map(int, r.split("x"))) for r in args.rows.split(",")]
    print(f"{'stages':>6} {'minblk':>6} " + " ".join(f"{f'b{b}s{s}':>22}" for b, s in rows) + "   (contiguous/page16/page1 GB/s)")
    data = {}
    for batch, seqlen in rows:
        q = torch.randn(batch, 1, HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen, HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
        data[batch, seqlen] = (q, k, v, lengths, _paged(k, v, 16, rng), _paged(k, v, 1, rng))
    for stages in map(int, args.stages.split(",")):
        for min_blocks in map(int, args.min_blocks.split(",")):
            plan.STAGES[HEAD_DIM] = plan.PAGED_STAGES[HEAD_DIM] = plan.WIDE_STAGES[HEAD_DIM] = stages
            plan.MIN_BLOCKS_PER_SPLIT = min_blocks
            plan.variant.cache_clear()
            replay.clear()
            cells = []
            for (batch, seqlen), (q, k, v, lengths, p16, p1) in data.items():
                nbytes = 2 * k.numel() * k.element_size()
                rates = [_gbs(nbytes, lambda: cuattn.attention_with_kvcache(q, k, v, cache_seqlens=lengths))]
                for pk, pv, table in (p16, p1):
                    rates.append(_gbs(nbytes, lambda: cuattn.attention_with_kvcache(q, pk, pv, cache_seqlens=lengths, block_table=table)))
                cells.append("/".join(f"{r:.0f}" for r in rates))
            print(f"{stages:>6} {min_blocks:>6} " + " ".join(f"{c:>22}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
