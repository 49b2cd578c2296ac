"""Times candidate tilings of the Hopper forward kernel on the bench_forward grid, to choose
variants.WGMMA_FORWARD_TILES. Prints TFLOP/s per (BLOCK_N, WARPGROUPS, CTAS_PER_SM) and SDPA flash.

    PYTHONPATH=. python scripts/tune_forward_wgmma.py [--head-dims 64] [--candidates 64:128,2,1;64:64,2,2]
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cuattn  # noqa: E402
from cuattn import variants  # noqa: E402
from benchmarks.timing import grid_arguments, grid_configs, torch_tflops  # noqa: E402

DEFAULT_CANDIDATES = "64:128,2,1;64:64,2,2;64:128,3,1;64:64,4,1;128:128,2,1;128:64,2,1"


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    parser = grid_arguments("results/tune_forward_wgmma.csv")
    parser.add_argument("--candidates", default=DEFAULT_CANDIDATES)
    args = parser.parse_args()
    candidates: dict[int, list[tuple[int, ...]]] = {}
    for item in args.candidates.split(";"):
        d, tiles = item.split(":")
        candidates.setdefault(int(d), []).append(tuple(map(int, tiles.split(","))))
    default = dict(variants.WGMMA_FORWARD_TILES)
    for d, s, causal, b, h in grid_configs(args):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        cells = []
        for tiles in candidates.get(d, []):
            variants.WGMMA_FORWARD_TILES[d] = tiles
            variants.wgmma_forward_variant.cache_clear()
            cells.append(f"n{tiles[0]}wg{tiles[1]}c{tiles[2]}={torch_tflops(flops, lambda: cuattn.attention(q, k, v, causal=causal))}")
        variants.WGMMA_FORWARD_TILES.update(default)
        variants.wgmma_forward_variant.cache_clear()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            flash = torch_tflops(flops, lambda: sdpa(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal))
        print(f"d{d} s{s} causal={causal!s:<5} flash={flash} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
