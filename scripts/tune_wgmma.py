"""Times candidate tilings of the Hopper kernels on the bench_forward / bench_backward grid, to
choose cuattn.kernels.forward.WGMMA_TILES / TMA_TILES and cuattn.kernels.backward.WGMMA_TILES / WGMMA_FUSED_TILES. A
candidate is ``table:head_dim:tiles``: ``forward:64:64,2,2`` (BLOCK_N, WARPGROUPS, CTAS_PER_SM),
``tma:128:128,2,2`` (the TMA forward's BLOCK_N, STAGES, CONSUMERS; head_dim is its tile; the
``forward`` candidates are timed with ``CUATTN_TMA=0``, on the kernel they tile), or
``backward_dq:128:64,2,1`` / ``backward_dkdv:128:64,1,2`` (stream rows, WARPGROUPS, CTAS_PER_SM;
timed with deterministic=True) / ``backward_fused:128:64,1,2`` (the default backward's one-pass
kernel). Each row prints TFLOP/s of the forward or of the whole backward, and SDPA flash.

    PYTHONPATH=. python scripts/tune_wgmma.py --candidates "backward_dkdv:128:64,1,2;backward_dkdv:128:64,2,1"
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import cuattn  # noqa: E402
from cuattn import replay  # noqa: E402
from cuattn.kernels import backward as backward_plan, forward as forward_plan  # noqa: E402
from benchmarks.timing import copying, grid_arguments, grid_configs, torch_tflops  # noqa: E402


def _table(name: str) -> dict:
    if name == "forward":
        return forward_plan.WGMMA_TILES
    if name == "tma":
        return forward_plan.TMA_TILES
    return backward_plan.WGMMA_FUSED_TILES if name == "backward_fused" else backward_plan.WGMMA_TILES[name]


def _clear() -> None:
    forward_plan.wgmma_variant.cache_clear()
    forward_plan.tma_variant.cache_clear()
    backward_plan.wgmma_variant.cache_clear()
    backward_plan.fused_variant.cache_clear()
    replay.clear()  # plans hold the variants they were recorded with


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    parser = grid_arguments("unused.csv")
    parser.add_argument("--candidates", required=True)
    args = parser.parse_args()
    candidates = [(name, int(d), tuple(map(int, tiles.split(",")))) for name, d, tiles in (c.split(":") for c in args.candidates.split(";"))]
    backward = any(name not in ("forward", "tma") for name, _, _ in candidates)
    dims = sorted({d for _, d, _ in candidates})
    args.head_dims = ",".join(map(str, dims))
    for d, s, causal, b, h in grid_configs(args):
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        flops = (2.5 if backward else 1) * 4 * b * h * s * s * d / (2 if causal else 1)
        out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
        cells = []
        for name, cd, tiles in candidates:
            if cd != d:
                continue
            if name == "forward":
                ours = copying(lambda: cuattn.attention(q, k, v, causal=causal))
            elif name == "tma":
                ours = lambda: cuattn.attention(q, k, v, causal=causal)  # noqa: E731
            else:
                deterministic = name != "backward_fused"
                ours = lambda: cuattn.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic)  # noqa: E731
            saved = _table(name)[d]
            _table(name)[d] = tiles
            _clear()
            cells.append(f"{name}:{','.join(map(str, tiles))}={torch_tflops(flops, ours)}")
            _table(name)[d] = saved
            _clear()
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ot = sdpa(qt, kt, vt, is_causal=causal)
            if backward:
                flash = torch_tflops(flops, lambda: torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True))
            else:
                flash = torch_tflops(flops, lambda: sdpa(qt, kt, vt, is_causal=causal))
        print(f"d{d} s{s} causal={causal!s:<5} flash={flash} " + " ".join(cells), flush=True)
        del q, k, v, do, out, lse, ot


if __name__ == "__main__":
    main()
