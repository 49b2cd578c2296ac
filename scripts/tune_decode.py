"""Times forms of the decode kernel (cuattn.kernels.decode: the ring depths STAGES /
PAGED_STAGES / WIDE_STAGES, MIN_BLOCKS_PER_SPLIT) on rows of the decode benchmark, bf16, GQA
32:8, head_dim 128 (``--head-dim``), L2-cold as `python -m benchmarks decode` times them: GB/s of K/V read for a
contiguous cache and pages of 16 and 1, SDPA's cuDNN backend beside.

    PYTHONPATH=. python scripts/tune_decode.py --stages 3,4 --min-blocks 1,2 --pdl 0,1

``--pdl`` sets CUATTN_PDL (the decode family's programmatic dependent launches on Hopper: the
decode kernel, its merge and append_kv).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import cuattn  # noqa: E402
from benchmarks.bench_decode import HEAD_DIM, _gbs, _paged, rotated_row  # noqa: E402
from cuattn import replay  # noqa: E402
from cuattn.kernels import decode as plan  # noqa: E402
from cuattn.kernels.variant import head_dim_bucket  # noqa: E402


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", default="")
    parser.add_argument("--min-blocks", default=str(plan.MIN_BLOCKS_PER_SPLIT))
    parser.add_argument("--pdl", default="1")
    parser.add_argument("--rows", default="1x1024,1x32768,4x8192,16x1024,16x131072,64x1024")
    parser.add_argument("--head-dim", type=int, default=HEAD_DIM)
    args = parser.parse_args()
    head_dim = args.head_dim
    plan_bucket = head_dim_bucket(head_dim)
    rng = np.random.default_rng(0)
    rows = [tuple(map(int, r.split("x"))) for r in args.rows.split(",")]
    configs = [(s, m, pdl) for s in (args.stages.split(",") if args.stages else [""]) for m in map(int, args.min_blocks.split(","))
               for pdl in args.pdl.split(",")]
    tables = {k: dict(getattr(plan, k)) for k in ("STAGES", "PAGED_STAGES", "WIDE_STAGES")}
    print(f"{'row':>10} {'cudnn':>6}  " + "  ".join(f"{'st %s mb %d pdl %s' % (s or '-', m, pdl):>20}" for s, m, pdl in configs)
          + "   (contiguous/page16/page1 GB/s)")
    for batch, seqlen in rows:
        nbytes, sets, q, kv, lengths = rotated_row(batch, seqlen, head_dim)
        paged = {ps: [_paged(k, v, ps, rng) for k, v in kv] for ps in (16, 1)}
        views = [[x.transpose(1, 2) for x in (q[i], *kv[i])] for i in range(sets)]

        def cudnn(i):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                return sdpa(*views[i], enable_gqa=True)

        cells, reference = [], None
        for stages, min_blocks, pdl in configs:
            os.environ["CUATTN_PDL"] = pdl
            plan.MIN_BLOCKS_PER_SPLIT = min_blocks
            for k, table in tables.items():
                getattr(plan, k).update(table)
                if stages:
                    getattr(plan, k)[plan_bucket] = int(stages)
            plan.variant.cache_clear()
            replay.clear()
            out = cuattn.attention_with_kvcache(q[0], *paged[1][0][:2], cache_seqlens=lengths, block_table=paged[1][0][2]).float()
            if reference is None:
                reference = out
            error = (out - reference).abs().max().item()
            rates = [_gbs(nbytes, lambda i: cuattn.attention_with_kvcache(q[i], *kv[i], cache_seqlens=lengths), sets)]
            for ps in (16, 1):
                rates.append(_gbs(nbytes, lambda i: cuattn.attention_with_kvcache(
                    q[i], paged[ps][i][0], paged[ps][i][1], cache_seqlens=lengths, block_table=paged[ps][i][2]), sets))
            cells.append("/".join(f"{r:.0f}" for r in rates) + ("" if error < 1e-2 else f" ERR{error:.2g}"))
        print(f"{f'b{batch}s{seqlen}':>10} {_gbs(nbytes, cudnn, sets):>6.0f}  " + "  ".join(f"{c:>20}" for c in cells), flush=True)
        del q, kv, paged, views


if __name__ == "__main__":
    main()
