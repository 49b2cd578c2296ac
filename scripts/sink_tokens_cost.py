"""What the StreamingLLM mask costs: causal sliding-window attention with ``sink_tokens=4``
against the same window without sink tokens, forward and backward, bf16, one run. The
sink-token call visits 4 more keys per row; the rest of its cost is the second launch and
the fp32 accumulator (forward) or dQ sum (backward).

    PYTHONPATH=. python scripts/sink_tokens_cost.py [--out results/sink_tokens_cost.csv]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import cuattn  # noqa: E402
from benchmarks.timing import torch_kernel_ms, write_csv  # noqa: E402

# (batch, seqlen, heads_q, heads_kv, head_dim, window): 16k tokens per row, windows of 1k and 4k
ROWS = [
    (4, 4096, 16, 16, 128, 1024), (1, 16384, 16, 16, 128, 1024), (1, 16384, 16, 16, 128, 4096),
    (1, 16384, 32, 8, 64, 4096), (4, 4096, 32, 8, 64, 1024),
]
SINK_TOKENS = 4


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results/sink_tokens_cost.csv")
    args = parser.parse_args()
    rows = []
    print(f"{'case':<36} {'mode':>4} {'window ms':>10} {'+sinks ms':>10} {'ratio':>6}")
    for batch, seqlen, hq, hk, d, window in ROWS:
        q = torch.randn(batch, seqlen, hq, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(batch, seqlen, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for mode in ("fwd", "bwd"):
            ms = []
            for n in (0, SINK_TOKENS):
                kw = {"causal": True, "window": (window, 0), "sink_tokens": n}
                if mode == "fwd":
                    ms.append(torch_kernel_ms(lambda kw=kw: cuattn.attention(q, k, v, **kw)))
                else:
                    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
                    ms.append(torch_kernel_ms(lambda kw=kw, out=out, lse=lse: cuattn.attention_backward(out, q, k, v, out, lse, **kw)))
            row = {"mode": mode, "batch": batch, "seqlen": seqlen, "heads_q": hq, "heads_kv": hk, "head_dim": d, "window": window,
                   "sink_tokens": SINK_TOKENS, "window_ms": round(ms[0], 4), "sink_tokens_ms": round(ms[1], 4),
                   "ratio": round(ms[1] / ms[0], 3), "gpu": torch.cuda.get_device_name()}
            rows.append(row)
            label = f"b{batch} s{seqlen} h{hq}/{hk} d{d} w{window}"
            print(f"{label:<36} {mode:>4} {ms[0]:>10.3f} {ms[1]:>10.3f} {row['ratio']:>6.3f}", flush=True)
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
