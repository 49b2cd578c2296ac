"""Per-call overhead of each adapter on a tiny problem, next to the framework's own attention:
host wall time per call over many back-to-back calls (one sync at the end; each call and its
peers sampled in turn, medians), where the GPU work (a few microseconds) is not what limits the
rate.

    PYTHONPATH=. python -m benchmarks overhead [--csv results/overhead.csv]

(also ``python benchmarks/bench_overhead.py``). Prints each call next to its bar (issue 14).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.timing import environment, write_csv

SHAPE = (1, 128, 4, 64)  # batch, seqlen, heads, head_dim
CALLS = 2000


SAMPLES = 11


def per_call_us(fn, sync, calls: int = CALLS) -> float:
    """Median over SAMPLES samples of the host time per call of ``calls`` back-to-back calls."""
    return interleaved({"": fn}, sync, calls)[""]


def interleaved(fns: dict, sync, calls: int = CALLS) -> dict:
    """Per-call time of each of ``fns``, their samples taken in turn (so that drift of the host,
    and garbage collections, fall on all of them alike); the median of SAMPLES after one warm-up."""
    samples = {name: [] for name in fns}
    for _ in range(SAMPLES + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: float(np.median(s[1:])) for name, s in samples.items()}


BARE_LAUNCH = "bare CuPy kernel launch (elementwise, out=)"


def cupy_rows():
    import cupy
    import ml_dtypes

    import cuattn

    q, k, v = (cupy.random.standard_normal(SHAPE, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    x, y = cupy.ones(SHAPE, np.float32), cupy.empty(SHAPE, np.float32)
    sync = cupy.cuda.get_current_stream().synchronize
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    dst, dq, dk, dv = (cupy.empty_like(q) for _ in range(4))
    times = interleaved({
        BARE_LAUNCH: lambda: cupy.multiply(x, 2, out=y),
        "bare CuPy kernel launch (elementwise, allocating)": lambda: x * 2,
        "cuattn.attention": lambda: cuattn.attention(q, k, v),
        "cuattn.attention (out=)": lambda: cuattn.attention(q, k, v, out=dst),
        "cuattn.attention_backward": lambda: cuattn.attention_backward(q, q, k, v, out, lse),
        "cuattn.attention_backward (dq=, dk=, dv=)": lambda: cuattn.attention_backward(q, q, k, v, out, lse, dq=dq, dk=dk, dv=dv),
        "cuattn.merge (2 partials)": lambda: cuattn.merge([out, out], [lse, lse]),
    }, sync)
    return [("cupy", call, us) for call, us in times.items()]


def torch_rows():
    import torch
    import torch.nn.functional as F

    import cuattn.torch as ct

    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sync = torch.cuda.synchronize
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)  # noqa: E731
    attends = {"cuattn.torch.attention": ct.attention, "SDPA": sdpa}
    with torch.no_grad():
        forward = interleaved({name: (lambda f=f: f(q, k, v)) for name, f in attends.items()}, sync)
    both = interleaved({name: (lambda f=f: f(q, k, v).sum().backward()) for name, f in attends.items()}, sync, CALLS // 4)
    return [("torch", f"{name} {kind}", times[name]) for name in attends for kind, times in (("forward", forward), ("forward+backward", both))]


def jax_rows():
    import jax
    import jax.numpy as jnp

    import cuattn.jax as cj

    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal(SHAPE), jnp.bfloat16) for i in range(3))
    attends = {"cuattn.jax.attention": cj.attention, "jax.nn.dot_product_attention": jax.nn.dot_product_attention}
    state = {}
    sync = lambda: jax.block_until_ready(state.get("last"))  # noqa: E731
    forward, both = {}, {}
    for name, attend in attends.items():
        fwd = jax.jit(attend)
        grad = jax.jit(jax.grad(lambda q, k, v, attend=attend: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        fwd(q, k, v).block_until_ready()
        jax.block_until_ready(grad(q, k, v))
        forward[name] = lambda fwd=fwd: state.__setitem__("last", fwd(q, k, v))
        both[name] = lambda grad=grad: state.__setitem__("last", grad(q, k, v))
    forward, both = interleaved(forward, sync), interleaved(both, sync, CALLS // 4)
    return [("jax (jit)", f"{name} {kind}", times[name]) for name in attends for kind, times in (("forward", forward), ("forward+backward", both))]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--csv", default="results/overhead.csv")
    args = parser.parse_args(argv)
    rows = []
    for section in (cupy_rows, torch_rows, jax_rows):
        try:
            rows += section()
        except ImportError as exc:
            print(f"skipped {section.__name__}: {exc}")
    env = environment()
    bars = {call: bar for call, bar in bar_rows(rows)}
    print(f"per-call time, bf16 {SHAPE} (batch, seqlen, heads, head_dim), {env.get('gpu', '')}")
    print(f"{'framework':<10} {'call':<52} {'us/call':>8}  bar (issue 14)")
    for framework, call, us in rows:
        bar = bars.get(call)
        verdict = "" if bar is None else f"<= {bar[0]:.1f} us ({bar[1]}): {'met' if us <= bar[0] else 'MISSED'}"
        print(f"{framework:<10} {call:<52} {us:8.1f}  {verdict}")
    write_csv(args.csv, [
        {"framework": f, "call": c, "us_per_call": round(u, 2), "bar_us": round(bars[c][0], 2) if c in bars else "", **env}
        for f, c, u in rows
    ])


def bar_rows(rows) -> list[tuple[str, tuple[float, str]]]:
    """(call, (bound in us, what it is)) of each row with a bar: CuPy calls <= 2x a bare CuPy
    launch, PyTorch <= SDPA (forward, forward+backward), JAX jit forward <= 2x jax.nn's."""
    us = {call: t for _, call, t in rows}
    bars = []
    for call in us:
        if call.startswith("cuattn.") and not call.startswith(("cuattn.torch", "cuattn.jax")) and BARE_LAUNCH in us:
            bars.append((call, (2 * us[BARE_LAUNCH], "2x bare launch")))
        for kind in ("forward", "forward+backward"):
            if call == f"cuattn.torch.attention {kind}" and f"SDPA {kind}" in us:
                bars.append((call, (us[f"SDPA {kind}"], f"SDPA {kind}")))
        if call == "cuattn.jax.attention forward" and "jax.nn.dot_product_attention forward" in us:
            bars.append((call, (2 * us["jax.nn.dot_product_attention forward"], "2x jax.nn")))
    return bars


if __name__ == "__main__":
    main()
