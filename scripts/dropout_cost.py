"""What dropout costs: cuattn's forward and backward with ``dropout_p=0.1`` against the same
call without, next to PyTorch SDPA's flash backend with and without dropout, bf16, one run,
TFLOP/s in the FlashAttention convention (4 B H Sq Sk D, halved for causal, x2.5 backward).

    PYTHONPATH=. python scripts/dropout_cost.py [--out results/dropout_cost.csv]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import cuattn  # noqa: E402
from benchmarks.timing import torch_kernel_ms, write_csv  # noqa: E402

# (batch, seqlen, heads, head_dim, causal): 16k tokens per row
ROWS = [(8, 2048, 32, 64, False), (2, 8192, 32, 64, True), (8, 2048, 16, 128, False), (2, 8192, 16, 128, True), (2, 8192, 16, 128, False)]
P = 0.1
SEED = 1234


def main() -> None:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/dropout_cost.csv")
    args = parser.parse_args()
    rows = []
    print(f"{'case':<26} {'mode':>4} {'plain':>7} {'dropout':>8} {'ratio':>6} {'sdpa':>7} {'sdpa+do':>8} {'ratio':>6}  (TFLOP/s)")
    for batch, seqlen, heads, d, causal in ROWS:
        q, k, v = (torch.randn(batch, seqlen, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
        qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
        for mode in ("fwd", "bwd"):
            work = flops * (2.5 if mode == "bwd" else 1.0)
            ms = []
            for p in (0.0, P):
                kw = {"causal": causal, "dropout_p": p, "dropout_seed": SEED}
                if mode == "fwd":
                    ms.append(torch_kernel_ms(lambda kw=kw: cuattn.attention(q, k, v, **kw)))
                else:
                    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
                    ms.append(torch_kernel_ms(lambda kw=kw, out=out, lse=lse: cuattn.attention_backward(out, q, k, v, out, lse, **kw)))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                for p in (0.0, P):
                    if mode == "fwd":
                        ms.append(torch_kernel_ms(lambda p=p: F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)))
                    else:
                        out = F.scaled_dot_product_attention(qt, kt, vt, dropout_p=p, is_causal=causal)
                        grad = torch.randn_like(out)
                        ms.append(torch_kernel_ms(lambda out=out, grad=grad: torch.autograd.grad(out, (qt, kt, vt), grad, retain_graph=True)))
            tflops = [work / (m * 1e-3) / 1e12 for m in ms]
            row = {"mode": mode, "batch": batch, "seqlen": seqlen, "heads": heads, "head_dim": d, "causal": causal, "dropout_p": P,
                   "cuattn_tflops": round(tflops[0], 1), "cuattn_dropout_tflops": round(tflops[1], 1), "cuattn_ratio": round(ms[0] / ms[1], 3),
                   "sdpa_flash_tflops": round(tflops[2], 1), "sdpa_flash_dropout_tflops": round(tflops[3], 1),
                   "sdpa_ratio": round(ms[2] / ms[3], 3), "dropout_vs_sdpa_dropout": round(ms[3] / ms[1], 3), "gpu": torch.cuda.get_device_name()}
            rows.append(row)
            label = f"b{batch} s{seqlen} h{heads} d{d}" + (" causal" if causal else "")
            print(f"{label:<26} {mode:>4} {tflops[0]:>7.1f} {tflops[1]:>8.1f} {row['cuattn_ratio']:>6.3f} {tflops[2]:>7.1f} {tflops[3]:>8.1f} "
                  f"{row['sdpa_ratio']:>6.3f}", flush=True)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
