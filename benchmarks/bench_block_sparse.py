"""Block-sparse attention's time against density: cuattn's forward and backward with a block
mask (128 x 128 blocks) at densities 10-50%, next to the dense call on the same inputs in the
same run; bf16, 16k tokens. Two patterns: ``random`` (each head its own random blocks, the
diagonal kept: no locality between the query blocks that run together) and ``local_global``
(a band of blocks around the diagonal plus the first block row and column). ``ratio`` = time
/ (dense time x density): issue 17's bar is <= 1.10.

    PYTHONPATH=. python -m benchmarks block_sparse [--out results/block_sparse.csv]
"""

from __future__ import annotations

import argparse

import numpy as np

import cuattn
from benchmarks.timing import torch_kernel_ms, write_csv
from cuattn import block_mask as bm

# (batch, seqlen, heads, head_dim, causal): 16k tokens
ROWS = [(1, 16384, 16, 128, False), (1, 16384, 32, 64, False), (1, 16384, 16, 128, True)]
DENSITIES = (0.1, 0.25, 0.5)
# local_global's window_blocks for about those densities at 16k tokens: (not causal, causal)
BAND_BLOCKS = {0.1: (6, 5), 0.25: (16, 14), 0.5: (36, 33)}


def random_mask(rng, seqlen: int, heads: int, density: float, causal: bool) -> bm.BlockMask:
    """Each head keeps a random ``density`` of its blocks (of those at or below the diagonal
    when causal), the diagonal always."""
    n = bm.blocks(seqlen)
    keep = rng.random((1, heads, n, n)) < density
    keep |= np.eye(n, dtype=bool)
    if causal:
        keep &= np.tril(np.ones((n, n), dtype=bool))
    return bm.from_dense(keep, seqlen, seqlen)


def pattern_mask(pattern: str, rng, seqlen: int, heads: int, density: float, causal: bool) -> bm.BlockMask:
    if pattern == "random":
        return random_mask(rng, seqlen, heads, density, causal)
    window = BAND_BLOCKS[density][causal]
    return bm.local_global(seqlen, seqlen, window_blocks=window, global_blocks=1, causal=causal)


def main(argv=None) -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/block_sparse.csv")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'case':<28} {'pattern':<12} {'mode':>4} {'density':>7} {'ms':>8} {'dense ms':>8} {'ratio':>6}")
    for batch, seqlen, heads, d, causal in ROWS:
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        dense_out, dense_lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
        dense = {
            "fwd": torch_kernel_ms(lambda: cuattn.attention(q, k, v, causal=causal)),
            "bwd": torch_kernel_ms(lambda: cuattn.attention_backward(dense_out, q, k, v, dense_out, dense_lse, causal=causal)),
        }
        full = np.tril(np.ones((bm.blocks(seqlen),) * 2)).sum() if causal else bm.blocks(seqlen) ** 2
        for pattern, density in ((p, d) for p in ("random", "local_global") for d in DENSITIES):
            mask = pattern_mask(pattern, rng, seqlen, heads, density, causal)
            kept = float(mask.kv_counts.sum()) / (mask.kv_counts.shape[1] * full)  # of the blocks the dense call computes
            device_mask = mask.to(lambda a: torch.as_tensor(a, device="cuda"))
            out, lse = cuattn.attention(q, k, v, causal=causal, block_mask=device_mask, return_lse=True)
            times = {
                "fwd": torch_kernel_ms(lambda: cuattn.attention(q, k, v, causal=causal, block_mask=device_mask)),
                "bwd": torch_kernel_ms(lambda: cuattn.attention_backward(out, q, k, v, out, lse, causal=causal, block_mask=device_mask)),
            }
            for mode in ("fwd", "bwd"):
                ratio = times[mode] / (dense[mode] * kept)
                label = f"b{batch} s{seqlen} h{heads} d{d}" + (" causal" if causal else "")
                rows.append({
                    "pattern": pattern, "mode": mode, "batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": d, "causal": causal,
                    "density": round(kept, 4), "ms": round(times[mode], 4), "dense_ms": round(dense[mode], 4), "ratio": round(ratio, 3),
                    "gpu": torch.cuda.get_device_name(),
                })
                print(f"{label:<28} {pattern:<12} {mode:>4} {kept:>7.3f} {times[mode]:>8.3f} {dense[mode]:>8.3f} {ratio:>6.3f}", flush=True)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
