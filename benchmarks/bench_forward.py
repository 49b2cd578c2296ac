"""Forward TFLOP/s of cuattn next to PyTorch SDPA's flash and cuDNN backends, same run.

FLOPs follow FlashAttention: 4 * batch * heads * seqlen^2 * head_dim, halved when causal.
Grid: head_dim 64 / 128, seqlen 1k / 4k / 16k with batch * seqlen = 16k tokens and
heads = 2048 / head_dim, causal or not, bf16.

On Hopper the default kernel for head dims 64 / 128 / 256 is the TMA one (forward_tma.cu); the
column ``copying`` times the wgmma kernel that copies its own tiles (``CUATTN_TMA=0``) and
``mma.sync`` the portable kernel (``CUATTN_WGMMA=0``), on the same inputs.

    PYTHONPATH=. python benchmarks/bench_forward.py [--csv results/forward.csv]
"""

from __future__ import annotations

import cuattn
from cuattn import loader
from benchmarks.timing import (
    copying, environment, grid_arguments, grid_configs, portable, print_comparison, torch_tflops, write_csv,
)


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    parser = grid_arguments("results/forward.csv")
    args = parser.parse_args()
    hopper = loader.device_arch() == "sm_90a" and loader.wgmma_enabled()
    env = {**environment(), "torch": torch.__version__}
    rows = []
    for d, s, causal, b, h in grid_configs(args):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA layout, strided view
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        row = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal}
        impls = {"cuattn": lambda: cuattn.attention(q, k, v, causal=causal)}
        if hopper:
            impls["cuattn_copying"] = copying(impls["cuattn"])
            impls["cuattn_mma_sync"] = portable(impls["cuattn"])
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return sdpa(qt, kt, vt, is_causal=causal)
            impls[name] = run
        for name, fn in impls.items():
            row[name] = torch_tflops(flops, fn)
        rows.append({**row, **env})
        del q, k, v
    write_csv(args.csv, rows)
    print_comparison(f"forward, bf16, TFLOP/s — {env['gpu']}, {env['date']}, torch {env['torch']}, cupy {env['cupy']}", rows)


if __name__ == "__main__":
    main()
