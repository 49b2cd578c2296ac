"""Head dim 64: the TMA forward's one-block form (three consumer warpgroups) against its SEVERAL
form (two, two row blocks per CTA), forced by patching the launch rule, next to cuDNN.

    PYTHONPATH=. python scripts/d64_several_probe.py
"""

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuattn
from benchmarks.timing import torch_tflops
from cuattn import replay
from cuattn.kernels import forward


def main() -> None:
    rule, d = forward.tma_row_blocks_per_cta, 64
    for s in (1024, 2048, 4096, 8192):
        for causal in (False, True):
            b, h = 16384 // s, 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            cols = []
            for per in (1, 2):
                forward.tma_row_blocks_per_cta = lambda *a, per=per: per
                replay.clear()
                cols.append(f"{per}:{torch_tflops(flops, lambda: cuattn.attention(q, k, v, causal=causal)):.1f}")
            forward.tma_row_blocks_per_cta = rule
            replay.clear()
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                c = torch_tflops(flops, lambda: sdpa(qt, kt, vt, is_causal=causal))
            print(f"d{d} s{s} causal={int(causal)} " + " ".join(cols) + f" cudnn:{c:.1f}", flush=True)


if __name__ == "__main__":
    main()
