"""``python -m cuattn selftest``: each public kernel on a default problem against the reference."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from cuattn import reference


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    error: float
    bound: float
    milliseconds: float


def _time_ms(fn, repeat: int = 10) -> float:
    import cupy

    fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeat):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / repeat


def _rel(x, ref) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64) - ref) / max(np.linalg.norm(ref), 1e-30))


def check_merge(rng: np.random.Generator) -> Check:
    import cupy

    import cuattn

    n, b, s, h, d = 3, 2, 129, 4, 64
    outs = cupy.asarray(rng.standard_normal((n, b, s, h, d)).astype(np.float32))
    lses = cupy.asarray(rng.standard_normal((n, b, h, s)).astype(np.float32) * 4)
    lses[1, 0, 0, :7] = -np.inf
    out, lse = cuattn.merge(outs, lses)
    ref_out, ref_lse = reference.merge(outs.get(), lses.get())
    err = max(_rel(out.get(), ref_out), _rel(np.where(np.isfinite(ref_lse), lse.get(), 0), np.where(np.isfinite(ref_lse), ref_lse, 0)))
    bound = 1e-6
    ok = err <= bound and not np.isnan(out.get()).any()
    return Check("merge float32 (3 partials, 2x129x4x64)", ok, err, bound, _time_ms(lambda: cuattn.merge(outs, lses)))


def check_attention(rng: np.random.Generator) -> Check:
    """bf16 causal GQA attention; bound: twice the error of rounding the reference to bf16
    plus the bf16 probability rounding, a loose form of the FlashAttention criterion."""
    import cupy

    import cuattn
    from cuattn.dtypes import BFLOAT16

    b, s, hq, hk, d = 2, 1000, 8, 2, 128
    q, k, v = (rng.standard_normal((b, s, h, d)).astype(BFLOAT16) for h in (hq, hk, hk))
    dq, dk, dv = (cupy.asarray(x) for x in (q, k, v))
    out = cuattn.attention(dq, dk, dv, causal=True)
    ref = reference.attention(q, k, v, causal=True)
    err = _rel(out.get(), ref)
    bound = 2 * _rel(ref.astype(BFLOAT16), ref) + 4e-3
    ok = err <= bound and not np.isnan(out.get().astype(np.float32)).any()
    return Check(f"attention bf16 causal GQA ({b}x{s}x{hq}/{hk}x{d})", ok, err, bound, _time_ms(lambda: cuattn.attention(dq, dk, dv, causal=True)))


def check_attention_varlen(rng: np.random.Generator) -> Check:
    """bf16 causal GQA attention over packed sequences of ragged lengths (an empty one too),
    bound as :func:`check_attention`."""
    import cupy

    import cuattn
    from cuattn.dtypes import BFLOAT16

    lengths, hq, hk, d = [700, 0, 1, 300], 8, 2, 128
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((int(cu[-1]), h, d)).astype(BFLOAT16) for h in (hq, hk, hk))
    args = [cupy.asarray(x) for x in (q, k, v, cu, cu)]
    out = cuattn.attention_varlen(*args, max_seqlen_q=max(lengths), causal=True)
    ref = reference.attention_varlen(q, k, v, cu, cu, causal=True)
    err = _rel(out.get(), ref)
    bound = 2 * _rel(ref.astype(BFLOAT16), ref) + 4e-3
    ok = err <= bound and not np.isnan(out.get().astype(np.float32)).any()
    timed = lambda: cuattn.attention_varlen(*args, max_seqlen_q=max(lengths), causal=True)  # noqa: E731
    return Check(f"attention_varlen bf16 causal GQA (lengths {lengths}, {hq}/{hk}x{d})", ok, err, bound, _time_ms(timed))


def check_attention_varlen_backward(rng: np.random.Generator) -> Check:
    """Gradients of bf16 causal GQA attention over packed ragged sequences: the largest relative
    error of dq, dk and dv, bound by 3x that of the float64 gradients rounded to bf16."""
    import cupy

    import cuattn
    from cuattn.dtypes import BFLOAT16

    lengths, hq, hk, d = [300, 0, 1, 150], 4, 2, 64
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, dout = (rng.standard_normal((int(cu[-1]), hq, d)).astype(BFLOAT16) for _ in range(2))
    k, v = (rng.standard_normal((int(cu[-1]), hk, d)).astype(BFLOAT16) for _ in range(2))
    dev = [cupy.asarray(x) for x in (dout, q, k, v)]
    cu_d = cupy.asarray(cu)
    out, lse = cuattn.attention_varlen(*dev[1:], cu_d, cu_d, max_seqlen_q=max(lengths), causal=True, return_lse=True)
    bounds = dict(max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), causal=True)
    grads = [g.get() for g in cuattn.attention_varlen_backward(*dev, out, lse, cu_d, cu_d, **bounds)]
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    refs = reference.attention_varlen_backward(dout, q, k, v, ref_out, ref_lse, cu, cu, causal=True)
    err = max(_rel(g, r) for g, r in zip(grads, refs))
    bound = 3 * max(_rel(r.astype(BFLOAT16), r) for r in refs) + 4e-3
    ok = err <= bound and not any(np.isnan(g.astype(np.float32)).any() for g in grads)
    timed = lambda: cuattn.attention_varlen_backward(*dev, out, lse, cu_d, cu_d, **bounds)  # noqa: E731
    return Check(f"attention_varlen_backward bf16 causal GQA (lengths {lengths}, {hq}/{hk}x{d})", ok, err, bound, _time_ms(timed))


CHECKS = [check_merge, check_attention, check_attention_varlen, check_attention_varlen_backward]


def run(print_fn=print) -> bool:
    rng = np.random.default_rng()
    all_ok = True
    for check in CHECKS:
        start = time.perf_counter()
        try:
            result = check(rng)
        except Exception as exc:  # report every kernel, then fail
            print_fn(f"FAIL  {check.__name__}: {type(exc).__name__}: {exc}")
            all_ok = False
            continue
        status = "pass" if result.ok else "FAIL"
        print_fn(
            f"{status}  {result.name}: rel. error {result.error:.2e} (bound {result.bound:.0e}), "
            f"{result.milliseconds:.3f} ms/call, {time.perf_counter() - start:.1f} s with compile"
        )
        all_ok &= result.ok
    return all_ok
