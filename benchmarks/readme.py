"""Writes every measured figure of the docs from the files that the measuring commands wrote:
README.md's performance summary and its language-model paragraph (between their markers), and
docs/performance.md (every table). No hand-typed numbers: each table names the GPU it ran on,
and a result file that is not there yet shows as "(not measured yet: run ...)".

    PYTHONPATH=. python -m benchmarks readme [--results docs/bench] [--lm docs]
                                            [--readme README.md] [--performance docs/performance.md]

The output depends on those files alone, so running it twice changes nothing.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib

BEGIN, END = "<!-- performance:begin (python -m benchmarks readme) -->", "<!-- performance:end -->"
LM_BEGIN, LM_END = "<!-- lm:begin (python -m benchmarks readme) -->", "<!-- lm:end -->"
PEERS = ("sdpa_flash", "sdpa_cudnn")
IMPLS = ("cuattn", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math", "jax_cudnn", "jax_xla", "naive_cupy")
MODE_TITLES = {"fwd": "Forward", "bwd": "Backward", "fwdbwd": "Forward + backward", "decode": "Decode (one query per sequence, KV cache)"}
LM_RUNS = {"torch": ("PyTorch", "bf16 autocast"), "jax": ("JAX", "bf16 attention")}


class NotMeasured(Exception):
    """A result file is missing; ``command`` is what writes it."""

    def __init__(self, command: str):
        super().__init__(command)
        self.command = command


def commands(results: pathlib.Path, lm: pathlib.Path) -> dict[str, str]:
    """The command that writes each result file (run from the repository root, on a GPU)."""
    return {
        "suite": f"PYTHONPATH=. python -m benchmarks --out {results}",
        "quick": f"PYTHONPATH=. python -m benchmarks --quick --out {results}",
        "paper": f"PYTHONPATH=. python -m benchmarks paper --out {results}",
        "accuracy": f"PYTHONPATH=. python -m benchmarks accuracy --out {results}",
        "overhead": f"PYTHONPATH=. python -m benchmarks overhead --csv {results}/overhead.csv",
        "lm_torch": f"python examples/train_lm_torch.py --out {lm}",
        "lm_jax": f"python examples/train_lm_jax.py --out {lm}",
    }


def _json(path: pathlib.Path, command: str) -> dict:
    if not path.exists():
        raise NotMeasured(command)
    return json.loads(path.read_text())


def _not_measured(exc: NotMeasured) -> str:
    return f"not measured yet: run `{exc.command}`"


def _fmt(x) -> str:
    return "-" if x is None else f"{x:g}"


def _ratio(a, b) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def _link(target: pathlib.Path, page: pathlib.Path) -> str:
    """``target`` relative to the directory of the page that links to it (POSIX separators)."""
    return pathlib.PurePath(os.path.relpath(target, page.parent)).as_posix()


def _run_note(env: dict) -> str:
    return "" if env.get("complete", True) else " (an incomplete run: it stopped before the last case)"


def _timing(env: dict) -> str:
    """A suite run's wall time, with its GPU and, where recorded, its options."""
    run = ""
    if "options" in env:
        run = "`" + f"python -m benchmarks {env['options']}".strip() + "`: "
    return f"{run}{env['seconds']} s on the {env['gpu']}, {env['date']}{_run_note(env)}"


def _suite(results: pathlib.Path, cmd: dict) -> dict:
    return _json(results / "suite.json", cmd["suite"])


# --- README: the performance summary ---------------------------------------------------------


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def summary_rows(rows: list[dict]) -> list[list[str]]:
    """Per mode and head_dim, over the bf16 MHA sweep (the plotted cases; decode: all): cuattn's
    rate range and its ratio to each peer (geometric mean, min-max)."""
    out = []
    for mode, title in MODE_TITLES.items():
        sel = [r for r in rows if r["mode"] == mode and r["dtype"] == "bfloat16" and (mode == "decode" or r["heads_q"] == r["heads_kv"])]
        for d in sorted({r["head_dim"] for r in sel}):
            group = [r for r in sel if r["head_dim"] == d and r.get("cuattn") is not None]
            if not group:
                continue
            rates = [r["cuattn"] for r in group]
            cells = [title.split(" (")[0], str(d), str(len(group)), f"{min(rates):g}-{max(rates):g} {group[0]['unit']}"]
            for peer in PEERS:
                ratios = [r["cuattn"] / r[peer] for r in group if r.get(peer)]
                cells.append(f"{_geomean(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-")
            out.append(cells)
    return out


def readme_performance(results: pathlib.Path, lm: pathlib.Path, readme: pathlib.Path, page: pathlib.Path) -> list[str]:
    cmd = commands(results, lm)
    try:
        env = _suite(results, cmd)["environment"]
        suite_time = _timing(env)
    except NotMeasured as exc:
        suite_time = _not_measured(exc)
    try:
        quick = _json(results / "suite_quick.json", cmd["quick"])["environment"]
        quick_time = _timing(quick)
    except NotMeasured as exc:
        quick_time = _not_measured(exc)
    out = [
        f"`{cmd['suite']}` runs the suite: cuattn next to every peer installed (PyTorch SDPA's flash, cuDNN, "
        f"efficient and math backends, JAX's cuDNN and XLA attention, naive CuPy) in four modes ({suite_time}); "
        f"`--quick` runs a subset, head_dim 128 at seqlen 4k, into `suite_quick.json` ({quick_time}). "
        "`python -m benchmarks paper` and `accuracy` write the other tables, and `python -m benchmarks readme` "
        f"rewrites this section, the language-model paragraph above and [{_link(page, readme)}]({_link(page, readme)}) "
        "from the result files. Run them with `PYTHONPATH=.` from a checkout.",
        "",
    ]
    try:
        data = _suite(results, cmd)
    except NotMeasured as exc:
        return out + [f"Suite summary: ({_not_measured(exc)})"]
    env = data["environment"]
    seqlens = sorted({r["seqlen_k"] for r in data["rows"]})
    out += [
        f"Suite summary on the {env['gpu']} ({env['date']}, `{_link(results / 'suite.json', readme)}`): the bfloat16 "
        f"cases with as many K/V heads as query heads, seqlen {seqlens[0]} to {seqlens[-1]}, causal and not. cuattn's rate (TFLOP/s "
        "with the FlashAttention count; decode: GB/s of K/V read) and its ratio to PyTorch SDPA's FlashAttention "
        "and cuDNN backends (geometric mean, min-max in parentheses; above 1: cuattn is faster).",
        "",
        "| mode | head_dim | cases | cuattn | vs flash | vs cuDNN |",
        "|---|---|---|---|---|---|",
    ]
    out += ["| " + " | ".join(cells) + " |" for cells in summary_rows(data["rows"])]
    out.append("")
    out += [f"![{mode}]({_link(results / f'suite_{mode}.png', readme)})" for mode in MODE_TITLES]
    try:
        out += ["", *overhead_section(results, page, cmd)[2:]]
    except NotMeasured as exc:
        out += ["", f"Per-call time: ({_not_measured(exc)})"]
    out += [
        "",
        f"Every table, each with the GPU it ran on: [{_link(page, readme)}]({_link(page, readme)}) (the suite case by "
        "case, GQA and float16 included; the memory tables of Rabe & Staats; accuracy against float64; the adapters' "
        "per-call time).",
    ]
    return out


# --- README: the language-model paragraph ----------------------------------------------------


def lm_sentence(data: dict, source: str) -> str:
    (name_a, a), (name_b, b) = data["runs"].items()
    return (
        f"{data['gpu']} ({data['date']}, {data['steps']} steps of batch {data['batch']} x {data['seqlen']}; `{source}`): "
        f"last-50-step mean loss {a['last50_mean_loss']:.4f} ({name_a}) vs {b['last50_mean_loss']:.4f} ({name_b}), "
        f"largest per-step difference of the curves {data['max_abs_difference']:.4f}; wall time per run "
        f"{a['seconds']:.1f} s vs {b['seconds']:.1f} s ({a['first_step_seconds']:.1f} s / {b['first_step_seconds']:.1f} s "
        "of it the first step, compilation included"
        + ("; each run in a fresh process)." if data.get("processes") == "one per run" else ").")
    )


def readme_lm(lm: pathlib.Path, readme: pathlib.Path, results: pathlib.Path) -> list[str]:
    cmd = commands(results, lm)
    out = []
    for key, (framework, precision) in LM_RUNS.items():
        path = lm / f"lm_{key}.json"
        try:
            text = lm_sentence(_json(path, cmd[f"lm_{key}"]), _link(path, readme))
        except NotMeasured as exc:
            text = f"({_not_measured(exc)})"
        out += [f"- {framework}, {precision}: {text}"]
    out.append("")
    for key, (framework, _) in LM_RUNS.items():
        png = lm / f"lm_{key}_losses.png"
        if png.exists():
            out.append(f"![{framework} LM loss, cuattn vs the framework's attention (GPU in the title)]({_link(png, readme)})")
    return out


# --- docs/performance.md: every table ---------------------------------------------------------


def suite_section(results: pathlib.Path, page: pathlib.Path, cmd: dict) -> list[str]:
    data = _suite(results, cmd)
    env, rows = data["environment"], data["rows"]
    impls = [k for k in rows[0] if k in IMPLS]
    out = [
        f"## Suite, {env['gpu']}",
        "",
        f"`{cmd['suite']}` ({env['seconds']} s{_run_note(env)}; {env['gpu']}, {env['date']}, cuattn {env['cuattn_version']}, "
        f"torch {env.get('torch')}, jax {env.get('jax')}, cupy {env['cupy']}). "
        "TFLOP/s with the FlashAttention count (`4*B*H*Sq*Sk*D`, halved when causal, x2.5 backward, x3.5 forward+backward); "
        "decode in GB/s of K/V read. Each implementation is timed on its GPU work (CUDA events, a sleep queued ahead, "
        "median of samples, input sets rotated past L2); JAX by wall time of back-to-back dispatches. "
        "A dash: the implementation refused the case or its materialized scores would not fit.",
        "",
    ]
    out += [f"![{mode}]({_link(results / f'suite_{mode}.png', page)})" for mode in MODE_TITLES]
    for mode, title in MODE_TITLES.items():
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        out += ["", f"{title}, {sel[0]['unit']}, {env['gpu']}:", ""]
        head = ["head_dim", "seqlen", "batch", "heads q/kv", "causal", "dtype", *impls, "vs flash", "vs cuDNN"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for r in sel:
            cells = [r["head_dim"], r["seqlen_k"], r["batch"], f"{r['heads_q']}/{r['heads_kv']}", "yes" if r["causal"] else "no", r["dtype"]]
            cells += [_fmt(r.get(n)) for n in impls]
            cells += [_ratio(r.get("cuattn"), r.get(p)) for p in PEERS]
            out.append("| " + " | ".join(map(str, cells)) + " |")
    return out


def paper_section(results: pathlib.Path, page: pathlib.Path, cmd: dict) -> list[str]:
    from benchmarks.paper import table_rows

    data = _json(results / "paper_tables.json", cmd["paper"])
    gpu = data["environment"]["gpu"]
    out = [
        f"## Memory: Rabe & Staats, {gpu}",
        "",
        f"*Self-attention does not need O(n^2) memory*, Tables 2 and 3, on the {gpu} ({data['environment']['date']}, "
        f"cuattn {data['environment'].get('cuattn_version', '-')}): "
        f"`{cmd['paper']}` (one head, head_dim 64; memory overhead = peak of PyTorch's allocator beyond inputs and "
        "outputs; standard = SDPA math backend; paper rows: TPUv3, its own sizes).",
    ]
    for dtype in ("bfloat16", "float32"):
        for kind in ("inference", "differentiation"):
            rows = data[dtype][kind]
            out += ["", f"{kind.capitalize()}, {dtype} inputs, {gpu}:", ""]
            out.append("| | " + " | ".join(f"2^{r['log2']}" for r in rows) + " |")
            out.append("|" + "---|" * (len(rows) + 1))
            out += [f"| {name} | " + " | ".join(cells) + " |" for name, cells in table_rows(rows, kind)]
    acc = data["accuracy"]
    out += ["", f"Accuracy (the paper's check): max |cuattn - standard| at 2^14, float32, {gpu}: normal inputs {acc['normal']:.1e}, uniform {acc['uniform']:.1e}."]
    return out


def accuracy_section(results: pathlib.Path, page: pathlib.Path, cmd: dict) -> list[str]:
    data = _json(results / "accuracy.json", cmd["accuracy"])
    rows, gpu = data["rows"], data["environment"]["gpu"]
    names = list(rows[0]["errors"])
    out = [
        f"## Accuracy, {gpu}",
        "",
        f"`{cmd['accuracy']}` ({gpu}, {data['environment']['date']}, cuattn {data['environment'].get('cuattn_version', '-')}): "
        "max |error| against float64 on the same bf16 "
        "inputs, out / dq / dk / dv:",
        "",
        "| batch x seqlen x heads x d | causal | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for r in rows:
        b, s, h, d, c = r["size"]
        cells = [" / ".join(f"{e:.1e}" for e in v) if isinstance(v, list) else v for v in r["errors"].values()]
        out.append(f"| {b}x{s}x{h}x{d} | {'yes' if c else 'no'} | " + " | ".join(cells) + " |")
    return out


def overhead_section(results: pathlib.Path, page: pathlib.Path, cmd: dict) -> list[str]:
    path = results / "overhead.csv"
    if not path.exists():
        raise NotMeasured(cmd["overhead"])
    with path.open() as f:
        rows = list(csv.DictReader(f))
    gpus = sorted({r["gpu"] for r in rows})
    out = [
        f"## Per-call time, {', '.join(gpus)}",
        "",
        f"On a tiny problem, where the host path dominates: `{cmd['overhead']}` ({', '.join(gpus)}, {rows[0]['date']}); "
        "host time per call of back-to-back calls, every peer in the same run. Bars: CuPy calls at most 2x a bare "
        "CuPy kernel launch, PyTorch at most SDPA's time, JAX's jitted forward at most 2x `jax.nn.dot_product_attention`'s.",
        "",
        "| framework | call | us per call | bar (us) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        bar = r.get("bar_us") or ""
        verdict = "" if not bar else f"{bar} ({'met' if float(r['us_per_call']) <= float(bar) else 'missed'})"
        out.append(f"| {r['framework']} | {r['call']} | {r['us_per_call']} | {verdict} |")
    return out


SECTIONS = {
    "Suite": suite_section,
    "Memory: Rabe & Staats": paper_section,
    "Accuracy": accuracy_section,
    "Per-call time": overhead_section,
}


def performance_page(results: pathlib.Path, lm: pathlib.Path, page: pathlib.Path) -> str:
    cmd = commands(results, lm)
    lines = [
        "# Performance",
        "",
        "<!-- Generated by `PYTHONPATH=. python -m benchmarks readme` from the result files; edit that, not this. -->",
        "",
        "Every figure below is read from a file that the command quoted next to it wrote; each table names the GPU "
        "it was measured on.",
    ]
    for title, part in SECTIONS.items():
        try:
            body = part(results, page, cmd)
        except NotMeasured as exc:
            body = [f"## {title}", "", f"({_not_measured(exc)})"]
        lines += ["", *body]
    return "\n".join(lines) + "\n"


# --- the command -----------------------------------------------------------------------------


def _replace(text: str, begin: str, end: str, body: list[str], where: pathlib.Path) -> str:
    if begin not in text or end not in text:
        raise SystemExit(f"{where} has no {begin} ... {end} block")
    start, stop = text.index(begin), text.index(end) + len(end)
    return text[:start] + "\n".join([begin, *body, end]) + text[stop:]


def section(results: pathlib.Path, lm: pathlib.Path = pathlib.Path("docs"), readme: pathlib.Path = pathlib.Path("README.md"),
            page: pathlib.Path = pathlib.Path("docs/performance.md")) -> str:
    """README's performance block, markers included."""
    return "\n".join([BEGIN, *readme_performance(results, lm, readme, page), END])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=pathlib.Path, default=pathlib.Path("docs/bench"), help="the benchmark result files")
    parser.add_argument("--lm", type=pathlib.Path, default=pathlib.Path("docs"), help="the language-model examples' result files")
    parser.add_argument("--readme", type=pathlib.Path, default=pathlib.Path("README.md"))
    parser.add_argument("--performance", type=pathlib.Path, default=pathlib.Path("docs/performance.md"))
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    text = _replace(text, BEGIN, END, readme_performance(args.results, args.lm, args.readme, args.performance), args.readme)
    text = _replace(text, LM_BEGIN, LM_END, readme_lm(args.lm, args.readme, args.results), args.readme)
    args.readme.write_text(text)
    args.performance.parent.mkdir(parents=True, exist_ok=True)
    args.performance.write_text(performance_page(args.results, args.lm, args.performance))
    print(f"rewrote {args.readme} (performance, language model) and {args.performance} from {args.results} and {args.lm}")


if __name__ == "__main__":
    main()
