"""Backward TFLOP/s of cuattn next to PyTorch SDPA's flash and cuDNN backends, same run.

FLOPs follow FlashAttention: 2.5 x the forward's 4 * batch * heads * seqlen^2 * head_dim,
halved when causal. Grid as in bench_forward.py (batch * seqlen = 16k tokens, heads =
2048 / head_dim, bf16). Peers are timed on ``torch.autograd.grad`` of their own forward;
cuattn on ``attention_backward`` (delta pass, the one-pass kernel, dQ conversion). On Hopper the
column ``mma_sync`` times the portable kernels (``CUATTN_WGMMA=0``) on the same inputs, and
``copying`` the one-pass kernel that copies its own tiles (``CUATTN_TMA=0``).

    PYTHONPATH=. python benchmarks/bench_backward.py [--csv results/backward.csv]
"""

from __future__ import annotations

import cuattn
from cuattn import loader
from benchmarks.timing import copying, environment, grid_arguments, grid_configs, portable, print_comparison, torch_tflops, write_csv


def main() -> None:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    parser = grid_arguments("results/backward.csv")
    args = parser.parse_args()
    hopper = loader.device_arch() == "sm_90a" and loader.wgmma_enabled()
    env = {**environment(), "torch": torch.__version__}
    rows = []
    for d, s, causal, b, h in grid_configs(args):
        q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
        row = {"head_dim": d, "seqlen": s, "batch": b, "heads": h, "causal": causal}
        out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
        impls = {"cuattn": lambda: cuattn.attention_backward(do, q, k, v, out, lse, causal=causal)}
        if hopper:
            impls["cuattn_mma_sync"] = portable(impls["cuattn"])
            impls["cuattn_copying"] = copying(impls["cuattn"])
        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(backend):
                ot = sdpa(qt, kt, vt, is_causal=causal)
            impls[name] = lambda ot=ot, leaves=(qt, kt, vt): torch.autograd.grad(ot, leaves, do.transpose(1, 2), retain_graph=True)
        for name, fn in impls.items():
            row[name] = torch_tflops(flops, fn)
        rows.append({**row, **env})
        del q, k, v, do, out, lse, impls
    write_csv(args.csv, rows)
    print_comparison(f"backward, bf16, TFLOP/s — {env['gpu']}, {env['date']}, torch {env['torch']}, cupy {env['cupy']}", rows)


if __name__ == "__main__":
    main()
