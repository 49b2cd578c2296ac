"""cuattn.jax: jit, grad, bfloat16 and merge against the float64 reference and jax.nn."""

import numpy as np
import pytest

from cuattn import reference
from helpers import max_err

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")
jnp = jax.numpy

import cuattn.jax as cj  # noqa: E402

DTYPES = {"float32": np.float32, "bfloat16": jnp.bfloat16}


def _inputs(rng, shape_q, shape_kv):
    return [rng.standard_normal(s) for s in (shape_q, shape_kv, shape_kv)]


def _grads(fn, inputs, dtype, w):
    xs = [jnp.asarray(x, dtype) for x in inputs]
    w = jnp.asarray(w, jnp.float32)
    loss = lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum()  # noqa: E731
    out = jax.jit(fn)(*xs)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs)
    return [np.asarray(x.astype(jnp.float32), np.float64) for x in (out, *grads)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_jit_grad_matches_jax_nn(dtype, causal):
    """jax.jit(jax.grad) through cuattn.jax.attention against the float64 reference, judged
    against jax.nn.dot_product_attention in the same dtype (GQA)."""
    rng = np.random.default_rng(0)
    inputs = _inputs(rng, (2, 130, 8, 64), (2, 130, 2, 64))
    w = rng.standard_normal((2, 130, 8, 64))
    ref_out, ref_lse = reference.attention(*inputs, causal=causal, return_lse=True)
    ref = [ref_out, *reference.attention_backward(w, *inputs, ref_out, ref_lse, causal=causal)]
    ours = _grads(lambda q, k, v: cj.attention(q, k, v, causal=causal), inputs, DTYPES[dtype], w)
    base = _grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal), inputs, DTYPES[dtype], w)
    for name, x, b, r, factor in zip(("out", "dq", "dk", "dv"), ours, base, ref, (2, 3, 3, 3)):
        assert max_err(x, r) <= factor * max_err(b, r) + 1e-5, f"{name}: {max_err(x, r):.3e} vs jax.nn {max_err(b, r):.3e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_of_partials_differentiates_through_lse(dtype):
    rng = np.random.default_rng(1)
    inputs = _inputs(rng, (1, 64, 4, 64), (1, 200, 4, 64))
    w = rng.standard_normal((1, 64, 4, 64))

    def halves(q, k, v):
        parts = [cj.attention(q, k[:, s], v[:, s], return_lse=True) for s in (slice(0, 90), slice(90, None))]
        return cj.merge([p[0] for p in parts], [p[1] for p in parts])[0]

    ref_out, ref_lse = reference.attention(*inputs, return_lse=True)
    ref = [ref_out, *reference.attention_backward(w, *inputs, ref_out, ref_lse)]
    ours = _grads(halves, inputs, DTYPES[dtype], w)
    base = _grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v), inputs, DTYPES[dtype], w)
    for name, x, b, r in zip(("out", "dq", "dk", "dv"), ours, base, ref):
        assert max_err(x, r) <= 3 * max_err(b, r) + 1e-5, f"{name}: {max_err(x, r):.3e} vs jax.nn {max_err(b, r):.3e}"


@pytest.mark.parametrize("count", [20, 300])
def test_jitted_merge_of_many_partials_matches_the_reference(count):
    """Past 16 partials the merge runs in groups through float32 scratch, which XLA allocates
    from the op's trace: jitted, it equals the float64 reference within one rounding."""
    from helpers import assert_close_to_rounding

    rng = np.random.default_rng(count)
    outs = rng.standard_normal((count, 1, 33, 2, 64)).astype(jnp.bfloat16)
    lses = (rng.standard_normal((count, 1, 2, 33)) * 4).astype(np.float32)
    out, lse = jax.jit(cj.merge)([jnp.asarray(o) for o in outs], [jnp.asarray(l) for l in lses])
    ref_out, ref_lse = reference.merge(outs.astype(np.float64), lses)
    assert_close_to_rounding(np.asarray(out.astype(jnp.float32), np.float64), ref_out, "bfloat16")
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=4e-6, atol=4e-6)


def test_eager_call_and_trace_time_validation():
    q = jnp.ones((1, 8, 4, 64), jnp.bfloat16)
    k = jnp.ones((1, 8, 3, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        jax.jit(cj.attention)(q, k, k)
    out, lse = cj.attention(q, q, q, return_lse=True)  # eager
    assert out.dtype == jnp.bfloat16 and lse.shape == (1, 4, 8)
    np.testing.assert_allclose(np.asarray(out, np.float32), 1.0)
    np.testing.assert_allclose(np.asarray(lse), 8.0 + np.log(8.0), rtol=1e-6)


def test_no_host_transfer_inside_jit():
    """The jitted gradient runs with device-to-host transfers disallowed, and its compiled
    program calls cuattn through XLA's GPU buffer callback, not a host callback."""
    q = jax.device_put(jnp.asarray(np.random.default_rng(2).standard_normal((1, 128, 2, 64)), jnp.bfloat16))
    loss = jax.jit(jax.grad(lambda q: cj.attention(q, q, q, causal=True).astype(jnp.float32).sum()))
    hlo = loss.lower(q).compile().as_text()
    assert "custom-call" in hlo and "cpu_callback" not in hlo
    with jax.transfer_guard_device_to_host("disallow"):
        g = loss(q)
    assert np.isfinite(np.asarray(g.astype(jnp.float32))).all()


@pytest.mark.parametrize("flags", ["", "--xla_gpu_deterministic_ops=true", "--xla_gpu_exclude_nondeterministic_ops=true"])
def test_xla_determinism_flag_picks_the_atomic_free_backward(monkeypatch, flags):
    """XLA_FLAGS asking for deterministic ops gives bit-identical gradients (no dQ atomics);
    otherwise Hopper runs the one-pass backward."""
    from cuattn import loader

    launched = []  # the variants each new launch plan loads (plans are recorded afresh per test)
    load = loader.load_kernel
    monkeypatch.setattr(loader, "load_kernel", lambda variant: launched.append(variant.kernel) or load(variant))
    monkeypatch.setenv("XLA_FLAGS", flags)
    deterministic = bool(flags)
    assert cj.xla_deterministic_ops() == deterministic
    rng = np.random.default_rng(1)
    q, k, v, w = (jnp.asarray(rng.standard_normal((1, 300, 4, 128)), jnp.bfloat16) for _ in range(4))
    loss = lambda q, k, v: (cj.attention(q, k, v, causal=True).astype(jnp.float32) * w.astype(jnp.float32)).sum()  # noqa: E731
    runs = [[np.asarray(g.astype(jnp.float32)) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v)] for _ in range(3)]
    assert bool({"backward_tma", "backward_wgmma_fused"} & set(launched)) == (loader.device_arch() == "sm_90a" and not deterministic)  # the one-pass kernels
    assert "backward_prep" in launched
    if deterministic:
        for later in runs[1:]:
            for a, b in zip(runs[0], later):
                np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false")
    assert not cj.xla_deterministic_ops()


def test_a_traced_backward_replays_its_allocation_decision(monkeypatch):
    """Whether the backward has an fp32 dQ accumulator is decided once, when XLA sizes the
    buffers; changing CUATTN_WGMMA afterwards (or running on another kind of GPU) must not
    make the compiled callback disagree with them (it raised a shape mismatch)."""
    rng = np.random.default_rng()
    inputs = _inputs(rng, (1, 100, 4, 64), (1, 100, 2, 64))
    xs = [jnp.asarray(x, jnp.bfloat16) for x in inputs]
    loss = jax.jit(jax.grad(lambda q, k, v: cj.attention(q, k, v, causal=True).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    monkeypatch.setenv("CUATTN_WGMMA", "1")
    first = [np.asarray(g.astype(jnp.float32)) for g in loss(*xs)]
    monkeypatch.setenv("CUATTN_WGMMA", "0")  # the compiled function is not traced again
    second = [np.asarray(g.astype(jnp.float32)) for g in loss(*xs)]
    ref_out, ref_lse = reference.attention(*inputs, causal=True, return_lse=True)
    ref = reference.attention_backward(np.ones_like(ref_out), *inputs, ref_out, ref_lse, causal=True)
    for a, b, r in zip(first, second, ref):
        scale = np.abs(r).max()
        assert max_err(a, r) <= 2e-2 * scale and max_err(b, r) <= 2e-2 * scale
