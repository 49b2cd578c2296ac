"""What attention sinks cost, and whether the plain path moved: cuattn's forward and backward
with and without ``sink`` on the suite's training rows (docs/bench/suite.csv, seqlen >= 1k),
TFLOP/s in one run, next to the plain number that file recorded.

    PYTHONPATH=. python scripts/sink_cost.py [--csv docs/bench/suite.csv] [--out results/sink_cost.csv]

``--plain-only`` times the plain path alone: with another checkout's package first on
PYTHONPATH (``PYTHONPATH=old_tree python scripts/sink_cost.py --plain-only``), runs taken in
turn on one GPU compare two versions of the kernels.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))  # after PYTHONPATH: another cuattn may come first

import cuattn  # noqa: E402
from benchmarks.cases import case_of  # noqa: E402
from benchmarks.timing import torch_kernel_ms, write_csv  # noqa: E402


def main() -> None:
    import torch

    parser = argparse.ArgumentParser()
    parser.add_argument("--csv", default="docs/bench/suite.csv")
    parser.add_argument("--out", default="results/sink_cost.csv")
    parser.add_argument("--plain-only", action="store_true")
    parser.add_argument("--modes", default="fwd,bwd", help="the suite's rows of these modes")
    args = parser.parse_args()
    print(f"cuattn from {pathlib.Path(cuattn.__file__).parent}")
    recorded = [r for r in csv.DictReader(open(args.csv)) if r["mode"] in args.modes.split(",") and int(r["seqlen_q"]) >= 1024]
    rows = []
    print(f"{'case':<40} {'recorded':>9} {'plain':>8} {'sink':>8} {'plain/rec':>9} {'sink/plain':>10}")
    for r in recorded:
        case = case_of({**{k: int(r[k]) for k in ("batch", "seqlen_q", "seqlen_k", "heads_q", "heads_kv", "head_dim")},
                        "mode": r["mode"], "dtype": r["dtype"], "causal": r["causal"] == "True"})
        dtype = getattr(torch, case.dtype)
        q = torch.randn(case.batch, case.seqlen_q, case.heads_q, case.head_dim, device="cuda", dtype=dtype)
        k, v = (torch.randn(case.batch, case.seqlen_k, case.heads_kv, case.head_dim, device="cuda", dtype=dtype) for _ in range(2))
        sink = torch.randn(case.heads_q, device="cuda")
        rates = []
        for s in (None,) if args.plain_only else (None, sink):
            extra = {} if s is None else {"sink": s}  # plain calls name no sink: an older cuattn has none
            out, lse = cuattn.attention(q, k, v, causal=case.causal, return_lse=True, **extra)
            if case.mode == "fwd":
                ms = torch_kernel_ms(lambda extra=extra: cuattn.attention(q, k, v, causal=case.causal, **extra))
            else:
                ms = torch_kernel_ms(lambda extra=extra, out=out, lse=lse: cuattn.attention_backward(out, q, k, v, out, lse, causal=case.causal, **extra))
            rates.append(round(case.rate(ms), 1))
        rates += rates[:1] * (2 - len(rates))
        row = {"mode": case.mode, "batch": case.batch, "seqlen": case.seqlen_q, "heads_q": case.heads_q, "heads_kv": case.heads_kv,
               "head_dim": case.head_dim, "causal": case.causal, "dtype": case.dtype, "recorded": float(r["cuattn"]),
               "plain": rates[0], "sink": rates[1], "plain_vs_recorded": round(rates[0] / float(r["cuattn"]), 3),
               "sink_vs_plain": round(rates[1] / rates[0], 3), "gpu": torch.cuda.get_device_name()}
        rows.append(row)
        label = f"{case.mode} d{case.head_dim} s{case.seqlen_q} b{case.batch} h{case.heads_q}/{case.heads_kv}{' causal' if case.causal else ''} {case.dtype}"
        print(f"{label:<40} {row['recorded']:>9.1f} {row['plain']:>8.1f} {row['sink']:>8.1f} {row['plain_vs_recorded']:>9.3f} {row['sink_vs_plain']:>10.3f}",
              flush=True)
        del q, k, v, out, lse
    write_csv(args.out, rows)


if __name__ == "__main__":
    main()
