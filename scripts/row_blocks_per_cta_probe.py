"""The TMA forward with its CTAs taking 1, 2, 4 or 8 row blocks of a (head, sequence) in turn
(forward_tma.cu SEVERAL; the launch rule tma_row_blocks_per_cta patched), next to cuDNN, on the
suite's short rows (16k tokens per row, batch x heads = 2048 / head_dim).

    PYTHONPATH=. python scripts/row_blocks_per_cta_probe.py [--dims 64,128,256] [--seqlens 512,1024,2048] [--per 1,2,4,8] [--window 256]

``--window L``: the banded rows under a sliding window of L keys (window=(L, 0)) instead of causal.
"""

import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuattn
from benchmarks.timing import torch_tflops
from cuattn import replay
from cuattn.kernels import forward


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlens", default="512,1024,2048")
    parser.add_argument("--per", default="1,2,4,8")
    parser.add_argument("--window", type=int, default=0)
    args = parser.parse_args()
    rule = forward.tma_row_blocks_per_cta
    for d in map(int, args.dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                mask = ({"window": (args.window, 0)} if args.window else {"causal": True}) if causal else {}
                keys = min(s, args.window + 1) if args.window and causal else s / 2 if causal else s  # keys a row sees, about
                flops = 4 * b * h * s * keys * d
                cols = []
                for per in ["rule", *map(int, args.per.split(","))]:
                    forward.tma_row_blocks_per_cta = rule if per == "rule" else (lambda *a, per=per: per)
                    replay.clear()
                    cols.append(f"{per}:{torch_tflops(flops, lambda: cuattn.attention(q, k, v, **mask)):.1f}")
                forward.tma_row_blocks_per_cta = rule
                replay.clear()
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                c = float("nan")
                if not (args.window and causal):  # SDPA has no window
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        c = torch_tflops(flops, lambda: sdpa(qt, kt, vt, is_causal=causal))
                print(f"d{d} s{s} {'window' if args.window else 'causal'}={int(causal)} " + " ".join(cols) + f" cudnn:{c:.1f}", flush=True)


if __name__ == "__main__":
    main()
