"""Backward TFLOP/s of cuattn next to cuDNN and flash (SDPA), one line per config, for A/B runs
of two trees in one lease (bf16, 16k tokens, heads = 2048 / head_dim; head dims 64 / 96 / 128
unless listed):

    PYTHONPATH=<old tree> python scripts/ab_backward.py old [160,192,224,256] >> ab.txt
    PYTHONPATH=. python scripts/ab_backward.py new [160,192,224,256] >> ab.txt
"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuattn
from benchmarks.timing import torch_tflops


def main() -> None:
    tag = sys.argv[1]
    dims = [int(d) for d in sys.argv[2].split(",")] if len(sys.argv) > 2 else [64, 96, 128]
    for d in dims:
        for s in (1024, 4096, 16384):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                out, lse = cuattn.attention(q, k, v, causal=causal, return_lse=True)
                t = torch_tflops(flops, lambda: cuattn.attention_backward(do, q, k, v, out, lse, causal=causal))
                qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    ot = sdpa(qt, kt, vt, is_causal=causal)
                c = torch_tflops(flops, lambda: torch.autograd.grad(ot, (qt, kt, vt), do.transpose(1, 2), retain_graph=True))
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    of = sdpa(qt, kt, vt, is_causal=causal)
                f = torch_tflops(flops, lambda: torch.autograd.grad(of, (qt, kt, vt), do.transpose(1, 2), retain_graph=True))
                print(f"{tag} d{d} s{s} causal={int(causal)} cuattn {t:.1f} cudnn {c:.1f} flash {f:.1f} ratio {t / c:.3f} vs_flash {t / f:.3f}",
                      flush=True)


if __name__ == "__main__":
    main()
