"""attention_varlen through the framework adapters: torch autograd, opcheck and torch.compile
(fullgraph); JAX jit and grad. Gradients against the float64 reference."""

import numpy as np
import pytest

from cuattn import reference

pytestmark = pytest.mark.gpu

LENGTHS_Q, LENGTHS_K = [37, 0, 100, 5], [40, 3, 100, 0]
HEADS_Q, HEADS_KV, HEAD_DIM = 4, 2, 64


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _problem(seed=0):
    """Float64 inputs, loss weights for out and lse, and the reference out, lse and gradients."""
    rng = np.random.default_rng(seed)
    cu_q, cu_k = _offsets(LENGTHS_Q), _offsets(LENGTHS_K)
    q = rng.standard_normal((cu_q[-1], HEADS_Q, HEAD_DIM))
    k, v = (rng.standard_normal((cu_k[-1], HEADS_KV, HEAD_DIM)) for _ in range(2))
    w_out, w_lse = rng.standard_normal(q.shape), rng.standard_normal((HEADS_Q, cu_q[-1]))
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    grads = reference.attention_varlen_backward(w_out, q, k, v, out, lse, cu_q, cu_k, causal=True, dlse=-w_lse)
    return (q, k, v), (cu_q, cu_k), (w_out, w_lse), (out, lse, *grads)


# Error bounds against float64: bf16 rounds inputs (2^-8 relative) and outputs.
ATOL = {"float32": 1e-4, "bfloat16": 4e-2}


def _check(name, got, ref, dtype):
    got = np.asarray(got, np.float64)
    finite = np.isfinite(ref)
    assert not np.isnan(got[finite]).any(), name
    err = float(np.abs(got[finite] - ref[finite]).max(initial=0.0))
    assert err <= ATOL[dtype] * max(1.0, float(np.abs(ref[finite]).max(initial=0.0))), f"{name}: max error {err:.3e}"


# --- torch ---------------------------------------------------------------------------------


def _torch_loss_and_grads(fn, dtype):
    torch = pytest.importorskip("torch")
    inputs, (cu_q, cu_k), (w_out, w_lse), _ = _problem()
    tdtype = getattr(torch, dtype)
    xs = [torch.tensor(x, device="cuda", dtype=tdtype, requires_grad=True) for x in inputs]
    cu = [torch.tensor(c, device="cuda") for c in (cu_q, cu_k)]
    out, lse = fn(*xs, *cu)
    w = torch.tensor(w_out, device="cuda", dtype=torch.float32)
    wl = torch.tensor(w_lse, device="cuda", dtype=torch.float32)
    finite = torch.isfinite(lse)
    loss = (out.float() * w).sum() - torch.where(finite, lse * wl, 0.0).sum()
    loss.backward()
    return [t.detach().float().cpu().numpy() for t in (out, lse, *(x.grad for x in xs))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_varlen_autograd_matches_reference(dtype):
    import cuattn.torch as ct

    got = _torch_loss_and_grads(
        lambda q, k, v, cq, ck: ct.attention_varlen(q, k, v, cq, ck, max_seqlen_q=100, max_seqlen_k=100, causal=True, return_lse=True),
        dtype,
    )
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, _problem()[3]):
        _check(name, g, r, dtype)


def test_torch_varlen_compile_fullgraph_matches_eager():
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    def fn(q, k, v, cq, ck):
        return ct.attention_varlen(q, k, v, cq, ck, max_seqlen_q=100, max_seqlen_k=100, causal=True, return_lse=True)

    eager = _torch_loss_and_grads(fn, "bfloat16")
    compiled = _torch_loss_and_grads(torch.compile(fn, fullgraph=True), "bfloat16")
    for name, e, c in zip(("out", "lse", "dq", "dk", "dv"), eager, compiled):
        np.testing.assert_allclose(c, e, atol=2e-2, rtol=2e-2, err_msg=name)


def test_torch_varlen_opcheck():
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    cu_q, cu_k = (torch.tensor(_offsets(x), device="cuda") for x in (LENGTHS_Q, LENGTHS_K))
    q = torch.randn(int(cu_q[-1]), HEADS_Q, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(int(cu_k[-1]), HEADS_KV, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    options = dict(causal=True, window_left=-1, window_right=-1, align="bottom_right", scale=0.125, softcap=0.0,
                   max_seqlen_q=100, max_seqlen_k=-1)
    torch.library.opcheck(ct.op("attention_varlen"), (q, k, v, cu_q, cu_k), options)
    out, lse = ct.op("attention_varlen")(q.detach(), k.detach(), v.detach(), cu_q, cu_k, **options)
    torch.library.opcheck(
        ct.op("attention_varlen_backward"), (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, None),
        {**options, "deterministic": True},
    )


# --- JAX -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_varlen_jit_grad_matches_reference(dtype):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    import cuattn.jax as cj

    inputs, (cu_q, cu_k), (w_out, w_lse), ref = _problem()
    xs = [jnp.asarray(x, getattr(jnp, dtype)) for x in inputs]
    cq, ck = jnp.asarray(cu_q), jnp.asarray(cu_k)
    w, wl = jnp.asarray(w_out, jnp.float32), jnp.asarray(w_lse, jnp.float32)

    def run(q, k, v):
        return cj.attention_varlen(q, k, v, cq, ck, max_seqlen_q=100, max_seqlen_k=100, causal=True, return_lse=True)

    def loss(q, k, v):
        out, lse = run(q, k, v)
        return (out.astype(jnp.float32) * w).sum() - jnp.where(jnp.isfinite(lse), lse * wl, 0.0).sum()

    out, lse = jax.jit(run)(*xs)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs)
    got = [np.asarray(x.astype(jnp.float32)) for x in (out, lse, *grads)]
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        _check(name, g, r, dtype)
