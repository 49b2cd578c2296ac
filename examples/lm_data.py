"""The text the language-model examples train on, generated (so the repo ships no corpus):
sentences from a small grammar mixed with sums, so a model has structure to learn."""

import numpy as np

_NOUNS = "cat dog bird model kernel tensor river engine garden teacher".split()
_ADJS = "small quick lazy bright exact tiled sparse warm".split()
_VERBS = "sees follows computes merges sorts reads writes moves".split()


def corpus(sentences: int = 40_000, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(sentences):
        if rng.random() < 0.3:
            a, b = rng.integers(0, 100, 2)
            out.append(f"{a} + {b} = {a + b} .")
        else:
            noun, other = rng.choice(_NOUNS, 2)
            out.append(f"the {rng.choice(_ADJS)} {noun} {rng.choice(_VERBS)} the {other} .")
    return " ".join(out)


def encode(text: str) -> tuple[np.ndarray, list[str]]:
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    return np.array([index[c] for c in text], np.int32), vocab


def batches(tokens: np.ndarray, batch: int, seqlen: int, steps: int, seed: int = 0):
    """``steps`` batches of (inputs, targets), each (batch, seqlen) int32, the same for a seed."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - seqlen - 1, batch)
        window = np.stack([tokens[s:s + seqlen + 1] for s in starts])
        yield window[:, :-1], window[:, 1:]


def compare(doc: str, attentions: dict, train, stem: str, title: str, gpu, versions: dict) -> None:
    """The examples' command line: trains the model once per attention implementation (same
    initialization, same batches) and reports the curves. ``train`` returns the losses, the
    run's wall time and the first step's (compilation included); ``gpu()`` names the device.

    Each run has a fresh process of its own: in one process the later run would find the
    framework warmed by the earlier one (its compiler, autotuning results and allocator
    pools), and the first run would pay for both."""
    import argparse
    import pathlib
    import subprocess
    import sys
    import tempfile

    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--only", choices=list(attentions), help="train with this attention alone, in this process")
    parser.add_argument("--result", type=pathlib.Path, help="with --only: where to write its losses and times (.npz)")
    args = parser.parse_args()
    setup = ["--steps", str(args.steps), "--batch", str(args.batch), "--seqlen", str(args.seqlen)]
    if args.only is not None:
        tokens, vocab = encode(corpus())
        losses, total, first = train(attentions[args.only], tokens, vocab, args.steps, args.batch, args.seqlen)
        if args.result is not None:
            np.savez(args.result, losses=losses, seconds=np.array([total, first]), gpu=np.array(gpu()))
        print(f"{args.only}: {total:.1f} s (first step {first:.1f} s), mean loss over the last 50 steps {losses[-50:].mean():.4f}")
        return
    curves, seconds, gpus = {}, {}, set()  # this process leaves the GPU alone (JAX would reserve its memory)
    with tempfile.TemporaryDirectory() as tmp:
        for i, label in enumerate(attentions):
            result = pathlib.Path(tmp) / f"run{i}.npz"
            subprocess.run([sys.executable, sys.argv[0], *setup, "--only", label, "--result", str(result)], check=True)
            with np.load(result) as run:
                curves[label], seconds[label] = run["losses"], tuple(float(t) for t in run["seconds"])
                gpus.add(str(run["gpu"]))
    setup = {"steps": args.steps, "batch": args.batch, "seqlen": args.seqlen}
    report(curves, seconds, args.out, stem, title, " / ".join(sorted(gpus)), {**setup, "versions": versions, "processes": "one per run"})


def report(curves: dict, seconds: dict, out_dir, stem: str, title: str, gpu: str, setup: dict) -> None:
    """Prints the two loss curves at a few steps and how far apart they are; writes the summary
    (GPU, wall times, last-50-step mean losses) as ``out_dir/stem.json``, which the README quotes
    (``python -m benchmarks readme``), and the curves as ``stem_losses.csv`` and ``.png``."""
    import datetime
    import json
    import shlex
    import sys

    (name_a, a), (name_b, b) = curves.items()
    for step in sorted({0, 49, 99, 199, len(a) - 1}):
        if step < len(a):
            print(f"step {step + 1:4d}  {name_a} {a[step]:.4f}  {name_b} {b[step]:.4f}")
    print(f"mean loss over the last 50 steps: {name_a} {a[-50:].mean():.4f}, {name_b} {b[-50:].mean():.4f}; "
          f"max |difference| of the curves {np.abs(a - b).max():.4f}")
    print(f"wall time per run on the {gpu}: " + ", ".join(f"{k} {total:.1f} s (first step {first:.1f} s)" for k, (total, first) in seconds.items()))
    (total_a, first_a), (total_b, first_b) = seconds[name_a], seconds[name_b]
    print(f"{name_a}'s wall time per run is {total_a / total_b:.2f}x {name_b}'s "
          f"({(total_a - first_a) / (total_b - first_b):.2f}x after the first step)")
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {
        "gpu": gpu,
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", *sys.argv]),
        **setup,
        "runs": {
            label: {"seconds": round(seconds[label][0], 2), "first_step_seconds": round(seconds[label][1], 2),
                    "last50_mean_loss": round(float(losses[-50:].mean()), 6)}
            for label, losses in curves.items()
        },
        "max_abs_difference": round(float(np.abs(a - b).max()), 6),
    }
    (out_dir / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    np.savetxt(out_dir / f"{stem}_losses.csv", np.stack([a, b], 1), delimiter=",", header=f"{name_a},{name_b}", comments="")
    plot_curves(curves, f"{title}, {gpu}", str(out_dir / f"{stem}_losses.png"))
    print(f"wrote {out_dir / stem}.json, {stem}_losses.csv and {stem}_losses.png")


def plot_curves(curves: dict, title: str, path: str) -> None:
    """Loss per step, one line per attention implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, losses in curves.items():
        ax.plot(np.arange(1, len(losses) + 1), losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
