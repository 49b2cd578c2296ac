"""Forward TFLOP/s of cuattn next to PyTorch SDPA's flash and cuDNN backends, same run.

FLOPs follow FlashAttention: 4 * batch * heads * seqlen^2 * head_dim, halved when causal.
Grid: head_dim 64 / 128, seqlen 1k / 4k / 16k with batch * seqlen = 16k tokens and
heads = 2048 / head_dim, causal or not, bf16.

    PYTHONPATH=. python benchmarks/bench_forward.py [--csv results/forward.csv] [--alt-tiles]
"""

from __future__ import annotations

import cuattn
from cuattn import variants
from benchmarks.timing import environment, grid_arguments, grid_configs, torch_tflops, write_csv

# Alternative (BLOCK_M, BLOCK_N, WARPS) tilings timed with --alt-tiles, to choose the table's.
ALT_TILES = {128: [(128, 64, 4)]}


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    parser = grid_arguments("results/forward.csv")
    parser.add_argument("--alt-tiles", action="store_true")
    args = parser.parse_args()
    env = {**environment(), "torch": torch.__version__}
    rows = []
    for d, s, causal, b, h in grid_configs(args):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA layout, strided view
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        row = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal}
        impls = {"cuattn": lambda: cuattn.attention(q, k, v, causal=causal)}
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(qt, kt, vt, is_causal=causal)
            impls[name] = run
        for name, fn in impls.items():
            row[name] = torch_tflops(flops, fn)
        if args.alt_tiles:
            default = variants.FORWARD_TILES[d]
            for tiles in ALT_TILES.get(d, []):
                variants.FORWARD_TILES[d] = tiles
                variants.forward_variant.cache_clear()  # the variant table is memoized
                row["cuattn_m%dn%dw%d" % tiles] = torch_tflops(flops, impls["cuattn"])
            variants.FORWARD_TILES[d] = default
            variants.forward_variant.cache_clear()
        rows.append({**row, **env})
        del q, k, v
    write_csv(args.csv, rows)
    print(f"forward, bf16, TFLOP/s — {env['gpu']}, {env['date']}, torch {env['torch']}, cupy {env['cupy']}")
    extra = sorted({c for r in rows for c in r if c.startswith("cuattn_m")})
    header = f"{'d':>4} {'seqlen':>6} {'causal':>6} {'cuattn':>7} {'flash':>7} {'cudnn':>7} {'vs flash':>8} {'vs cudnn':>8}" + "".join(f" {c[7:]:>11}" for c in extra)
    print(header)
    for r in rows:
        print(
            f"{r['head_dim']:>4} {r['seqlen']:>6} {str(r['causal']):>6} {r['cuattn']:>7} {r['sdpa_flash']:>7} {r['sdpa_cudnn']:>7} "
            f"{r['cuattn'] / r['sdpa_flash']:>8.2f} {r['cuattn'] / r['sdpa_cudnn']:>8.2f}" + "".join(f" {r.get(c, ''):>11}" for c in extra)
        )


if __name__ == "__main__":
    main()
