"""Per-call overhead of each adapter on a tiny problem, next to the framework's own attention:
host wall time per call over many back-to-back calls (one sync at the end), where the GPU work
(a few microseconds) is not what limits the rate.

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


def per_call_us(fn, sync, calls: int = CALLS) -> float:
    """Median over 5 samples of the host time per call of ``calls`` back-to-back calls."""
    samples = []
    for _ in range(6):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return float(np.median(samples[1:]))


BARE_LAUNCH = "bare CuPy kernel launch (elementwise, out=)"


def cupy_rows():
    import cupy
    import ml_dtypes

    import cuattn

    q, k, v = (cupy.random.standard_normal(SHAPE, dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(3))
    x, y = cupy.ones(SHAPE, np.float32), cupy.empty(SHAPE, np.float32)
    sync = cupy.cuda.get_current_stream().synchronize
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    return [
        ("cupy", BARE_LAUNCH, per_call_us(lambda: cupy.multiply(x, 2, out=y), sync)),
        ("cupy", "bare CuPy kernel launch (elementwise, allocating)", per_call_us(lambda: x * 2, sync)),
        ("cupy", "cuattn.attention", per_call_us(lambda: cuattn.attention(q, k, v), sync)),
        ("cupy", "cuattn.attention_backward", per_call_us(lambda: cuattn.attention_backward(q, q, k, v, out, lse), sync)),
        ("cupy", "cuattn.merge (2 partials)", per_call_us(lambda: cuattn.merge([out, out], [lse, lse]), sync)),
    ]


def torch_rows():
    import torch
    import torch.nn.functional as F

    import cuattn.torch as ct

    q, k, v = (torch.randn(SHAPE, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    sync = torch.cuda.synchronize
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)  # noqa: E731
    rows = []
    for name, attend in (("cuattn.torch.attention", ct.attention), ("SDPA", sdpa)):
        with torch.no_grad():
            rows.append(("torch", f"{name} forward", per_call_us(lambda: attend(q, k, v), sync)))
        rows.append(("torch", f"{name} forward+backward", per_call_us(lambda: attend(q, k, v).sum().backward(), sync, CALLS // 4)))
    return rows


def jax_rows():
    import jax
    import jax.numpy as jnp

    import cuattn.jax as cj

    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal(SHAPE), jnp.bfloat16) for i in range(3))
    rows = []
    for name, attend in (("cuattn.jax.attention", cj.attention), ("jax.nn.dot_product_attention", jax.nn.dot_product_attention)):
        fwd = jax.jit(attend)
        grad = jax.jit(jax.grad(lambda q, k, v: attend(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
        state = {}
        sync = lambda: jax.block_until_ready(state.get("last"))  # noqa: E731
        fwd(q, k, v).block_until_ready()
        jax.block_until_ready(grad(q, k, v))
        rows.append(("jax (jit)", f"{name} forward", per_call_us(lambda: state.__setitem__("last", fwd(q, k, v)), sync)))
        rows.append(("jax (jit)", f"{name} forward+backward", per_call_us(lambda: state.__setitem__("last", grad(q, k, v)), sync, CALLS // 4)))
    return rows


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
