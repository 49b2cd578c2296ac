"""Forward TFLOP/s of cuattn next to cuDNN (SDPA), one line per config, for A/B runs of two trees
in one lease (bf16, 16k tokens, heads = 2048 / head_dim, seqlens 1k-16k or the third argument's,
causal and not):

    PYTHONPATH=<old tree> python scripts/ab_forward.py old 64,128,256 >> ab.txt
    PYTHONPATH=. python scripts/ab_forward.py new 64,128,256 512,1024 >> ab.txt
"""

import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuattn
from benchmarks.timing import torch_tflops


def main() -> None:
    tag, dims = sys.argv[1], sys.argv[2]
    seqlens = tuple(map(int, sys.argv[3].split(","))) if len(sys.argv) > 3 else (1024, 2048, 4096, 16384)
    for d in map(int, dims.split(",")):
        for s in seqlens:
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                t = torch_tflops(flops, lambda: cuattn.attention(q, k, v, causal=causal))
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    c = torch_tflops(flops, lambda: sdpa(qt, kt, vt, is_causal=causal))
                print(f"{tag} d{d} s{s} causal={int(causal)} cuattn {t:.1f} cudnn {c:.1f} ratio {t / c:.3f}", flush=True)


if __name__ == "__main__":
    main()
