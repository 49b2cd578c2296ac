"""Writes README.md's performance section from the latest results in docs/bench/ (the suite,
the paper tables, the accuracy table, the adapters' per-call overhead): no hand-typed numbers.

    PYTHONPATH=. python -m benchmarks readme [--results docs/bench] [--readme README.md]
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib

BEGIN, END = "<!-- performance:begin (python -m benchmarks readme) -->", "<!-- performance:end -->"
PEERS = ("sdpa_flash", "sdpa_cudnn")


def _fmt(x) -> str:
    return "-" if x is None else f"{x:g}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def suite_section(results: pathlib.Path) -> list[str]:
    data = json.loads((results / "suite.json").read_text())
    env, rows = data["environment"], data["rows"]
    impls = [k for k in rows[0] if k in {"cuattn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "jax_cudnn", "jax_xla", "naive_cupy"}]
    out = [
        f"Suite: `PYTHONPATH=. python -m benchmarks --out {results}` ({env['seconds']} s; "
        f"{env['gpu']}, {env['date']}, cuattn {env['cuattn_version']}, torch {env.get('torch')}, jax {env.get('jax')}, cupy {env['cupy']}). "
        "TFLOP/s with the FlashAttention count (`4*B*H*Sq*Sk*D`, halved when causal, x2.5 backward, x3.5 forward+backward); "
        "decode in GB/s of K/V read. Each implementation is timed on its GPU work (CUDA events, a sleep queued ahead, "
        "median of samples, input sets rotated past L2); JAX by wall time of back-to-back dispatches. "
        "A dash: the implementation refused the case or its materialized scores would not fit.",
        "",
    ]
    for mode in ("fwd", "bwd", "fwdbwd", "decode"):
        out.append(f"![{mode}]({results}/suite_{mode}.png)")
    titles = {"fwd": "Forward", "bwd": "Backward", "fwdbwd": "Forward + backward", "decode": "Decode (one query per sequence, KV cache)"}
    for mode, title in titles.items():
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        out += ["", f"{title}, {sel[0]['unit']}:", ""]
        head = ["head_dim", "seqlen", "batch", "heads q/kv", "causal", "dtype", *impls, "vs flash", "vs cuDNN"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in sel:
            cells = [r["head_dim"], r["seqlen_k"], r["batch"], f"{r['heads_q']}/{r['heads_kv']}", "yes" if r["causal"] else "no", r["dtype"]]
            cells += [_fmt(r.get(n)) for n in impls]
            cells += [_ratio(r.get("cuattn"), r.get(p)) for p in PEERS]
            out.append("| " + " | ".join(map(str, cells)) + " |")
    return out


def paper_section(results: pathlib.Path) -> list[str]:
    from benchmarks.paper import table_rows

    data = json.loads((results / "paper_tables.json").read_text())
    out = [
        "",
        "Rabe & Staats, *Self-attention does not need O(n^2) memory*, Tables 2 and 3, on this GPU: "
        f"`PYTHONPATH=. python -m benchmarks paper --out {results}` (one head, head_dim 64; memory overhead = peak of "
        "PyTorch's allocator beyond inputs and outputs; standard = SDPA math backend; paper rows: TPUv3, its own sizes).",
    ]
    for dtype in ("bfloat16", "float32"):
        for kind in ("inference", "differentiation"):
            rows = data[dtype][kind]
            out += ["", f"{kind.capitalize()}, {dtype} inputs:", ""]
            out.append("| | " + " | ".join(f"2^{r['log2']}" for r in rows) + " |")
            out.append("|" + "---|" * (len(rows) + 1))
            lines = table_rows(rows, kind)
            out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in lines]
    acc = data["accuracy"]
    out += ["", f"Accuracy (the paper's check): max |cuattn - standard| at 2^14, float32: normal inputs {acc['normal']:.1e}, uniform {acc['uniform']:.1e}."]
    return out


def accuracy_section(results: pathlib.Path) -> list[str]:
    data = json.loads((results / "accuracy.json").read_text())
    rows = data["rows"]
    names = list(rows[0]["errors"])
    out = ["", f"Accuracy: `PYTHONPATH=. python -m benchmarks accuracy --out {results}`: max |error| against float64 on the same bf16 inputs, out / dq / dk / dv:", ""]
    out.append("| batch x seqlen x heads x d | causal | " + " | ".join(names) + " |")
    out.append("|---|---|" + "---|" * len(names))
    for r in rows:
        b, s, h, d, c = r["size"]
        cells = [" / ".join(f"{e:.1e}" for e in v) if isinstance(v, list) else v for v in r["errors"].values()]
        out.append(f"| {b}x{s}x{h}x{d} | {'yes' if c else 'no'} | " + " | ".join(cells) + " |")
    return out


def overhead_section(results: pathlib.Path) -> list[str]:
    with (results / "overhead.csv").open() as f:
        rows = list(csv.DictReader(f))
    out = ["", f"Per-call time on a tiny problem (`PYTHONPATH=. python benchmarks/bench_overhead.py --csv {results}/overhead.csv`; "
           f"{rows[0]['gpu']}, {rows[0]['date']}):", "", "| framework | call | us per call |", "|---|---|---|"]
    out += [f"| {r['framework']} | {r['call']} | {r['us_per_call']} |" for r in rows]
    return out


def section(results: pathlib.Path) -> str:
    lines = []
    for part in (suite_section, paper_section, accuracy_section, overhead_section):
        try:
            lines += part(results)
        except FileNotFoundError as exc:
            lines += ["", f"({part.__name__}: no results yet, {exc.filename})"]
    return "\n".join([BEGIN, *lines, END])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("docs/bench"))
    parser.add_argument("--readme", type=pathlib.Path, default=pathlib.Path("README.md"))
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{args.readme} has no {BEGIN} ... {END} block")
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    args.readme.write_text(text[:start] + section(args.results) + text[stop:])
    print(f"rewrote the performance section of {args.readme} from {args.results}")


if __name__ == "__main__":
    main()
