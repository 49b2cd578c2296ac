"""The benchmark suite: cuattn next to every peer on this machine, in one run.

    PYTHONPATH=. python -m benchmarks [--quick] [--modes fwd,bwd,fwdbwd,decode] [--impls ...] [--out results]

Peers: PyTorch SDPA (flash, cuDNN, efficient, math), JAX ``dot_product_attention`` (cudnn,
xla), naive CuPy attention (materialized scores). Method: CUDA events on the stream each runs
on (GPU work only, a sleep queued ahead so that host overhead does not count; JAX by wall time
of back-to-back dispatches), warm-up, median of samples, input sets rotated when they would fit
in L2, random normal data. Writes ``<out>/suite.csv``, ``suite.json`` and one PNG per mode
(``suite_quick.*`` with ``--quick``, so that a quick run leaves the full results alone); the JSON's
``environment`` records the GPU, the versions and the run's wall time in ``seconds``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

# JAX shares the GPU with torch: no preallocated pool, and memory returned after each case.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

from benchmarks.cases import MODES, case_of, default_grid, label  # noqa: E402
from benchmarks.impls import IMPLEMENTATIONS, Skip, torch_inputs  # noqa: E402
from benchmarks.timing import environment, median_ms, torch_kernel_ms, write_csv  # noqa: E402

L2_ROTATE_BYTES = 256 << 20  # input sets rotated until together they exceed this (several L2s)


def time_ms(fn, clock: str, sets: int) -> float:
    """Median ms per call; calls per sample scaled so that a sample takes about 40 ms."""
    if clock == "cupy":
        return median_ms(fn, repeat=10, input_sets=sets)
    if clock == "torch":
        once = torch_kernel_ms(fn, repeat=1, samples=1, input_sets=sets)
        repeat = max(1, min(10, int(40 / max(once, 1e-3))))
        return torch_kernel_ms(fn, repeat=repeat, samples=3, input_sets=sets)
    import jax

    samples = []
    jax.block_until_ready(fn(0))
    start = time.perf_counter()
    jax.block_until_ready(fn(0))
    repeat = max(1, min(10, int(0.04 / max(time.perf_counter() - start, 1e-6))))
    for _ in range(3):
        start = time.perf_counter()
        for i in range(repeat):
            out = fn(i % sets)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / repeat * 1e3)
    return statistics.median(samples)


def versions() -> dict:
    env = environment()
    for module in ("torch", "jax"):
        try:
            env[module] = __import__(module).__version__
        except ImportError:
            pass
    import cuattn
    from cuattn import loader

    env["cuattn_version"] = f"{cuattn.__version__}+{loader.source_hash()[:10]}"  # the kernels' source hash
    return env


def run(cases, impl_names, log=print, checkpoint=None) -> list[dict]:
    """Times every implementation on every case; ``checkpoint(rows)`` after each case."""
    import torch

    rows = []
    for case in cases:
        sets = max(1, min(4, -(-L2_ROTATE_BYTES // case.input_bytes)))
        try:
            inputs = torch_inputs(case, sets)
        except torch.cuda.OutOfMemoryError:
            log(f"{label(case):<40} inputs do not fit, left out")
            continue
        torch.cuda.synchronize()
        row = {**{k: getattr(case, k) for k in case.__dataclass_fields__}, "unit": case.unit}
        for name in impl_names:
            try:
                fn, clock = IMPLEMENTATIONS[name](case, inputs)
                row[name] = round(case.rate(time_ms(fn, clock, sets)), 1)
            except Skip as exc:
                row[name] = None
                row[f"{name}_skip"] = str(exc)
            except torch.cuda.OutOfMemoryError:
                row[name] = None
                row[f"{name}_skip"] = "out of memory"
            finally:
                fn = None
                torch.cuda.empty_cache()
        rows.append(row)
        log(f"{label(case):<40} " + " ".join(f"{n}={row[n] if row[n] is not None else '-'}" for n in impl_names))
        del inputs
        if checkpoint is not None:
            checkpoint(rows)
    return rows


def print_table(rows, impl_names) -> None:
    for mode in MODES:
        sel = [r for r in rows if r["mode"] == mode]
        if not sel:
            continue
        print(f"\n{mode} ({sel[0]['unit']})")
        print(f"{'case':<40}" + "".join(f"{n:>15}" for n in impl_names))
        for r in sel:
            print(f"{label(case_of(r)):<40}" + "".join(f"{'-' if r[n] is None else r[n]:>15}" for n in impl_names))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="head_dim 128, seqlen 4k (under a minute)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--impls", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = parser.parse_args(argv)
    stem = "suite_quick" if args.quick else "suite"
    modes, impl_names = args.modes.split(","), [n for n in args.impls.split(",") if _available(n)]
    cases = [c for c in default_grid(args.quick) if c.mode in modes]
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    options = " ".join(sys.argv[1:] if argv is None else argv)  # what the time below is the time of
    base_env = {**versions(), "quick": args.quick, "options": options}

    def save(rows, complete=False):
        env = {**base_env, "seconds": round(time.perf_counter() - start, 1), "complete": complete}
        write_csv(args.out / f"{stem}.csv", [{**r, **env} for r in rows])
        (args.out / f"{stem}.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
        return env

    rows = run(cases, impl_names, checkpoint=save)
    env = save(rows, complete=True)
    from benchmarks.plots import plot_suite

    for path in plot_suite(rows, impl_names, env, args.out, stem):
        print(f"wrote {path}")
    print_table(rows, impl_names)
    print(f"\n{env['gpu']}, {env['date']}, cuattn {env['cuattn_version']}, torch {env.get('torch')}, jax {env.get('jax')}, cupy {env['cupy']}; {env['seconds']} s")


def _available(name: str) -> bool:
    module = {"jax_cudnn": "jax", "jax_xla": "jax"}.get(name, "torch")
    try:
        __import__(module)
        return True
    except ImportError:
        print(f"{name}: {module} is not installed here, left out")
        return False


if __name__ == "__main__":
    main()
