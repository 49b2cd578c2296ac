"""The JAX ring (cuattn/dist/jax_ring.py) on W CPU devices, its kernel replaced by a jnp
attention: ``python jax_ring_cpu.py`` with ``XLA_FLAGS=--xla_force_host_platform_device_count=4``
(tests/test_jax_ring.py starts it). Checks, for every layout, causal and not, W = 1, 2, 4, fp32
and bf16 with GQA: out, lse and the gradients of q, k, v against float64 attention over the
whole sequence; fp32 to 2e-5, bf16 within 2x the error of the same jnp attention in one piece.
Then again (W = 1 and 4, fp32) with the jnp kernels run as cuattn's are, inside a
``buffer_callback``. Exits non-zero on a failed check."""

import itertools

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from cuattn import dist  # noqa: E402
from cuattn.dist import jax_ring  # noqa: E402


def _scores(q, k, causal, scale, softcap):
    f = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    group = q.shape[2] // k.shape[2]
    kk = jnp.repeat(k, group, axis=2).astype(f)
    s0 = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f), kk) * (q.shape[-1] ** -0.5 if scale is None else scale)
    t = jnp.tanh(s0 / softcap) if softcap else None
    s = softcap * t if softcap else s0
    visible = jnp.ones(s.shape[-2:], bool)
    if causal:
        visible = jnp.arange(k.shape[1])[None, :] <= jnp.arange(q.shape[1])[:, None]
    return jnp.where(visible, s, -jnp.inf), visible, t, kk, f


def jnp_forward(q, k, v, causal, scale, softcap):
    """Attention in fp32 (top-left causal), out rounded to q's dtype: the forward kernels' contract."""
    s, _, _, _, f = _scores(q, k, causal, scale, softcap)
    group = q.shape[2] // k.shape[2]
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), jnp.repeat(v, group, axis=2).astype(f))
    return out.astype(q.dtype), lse.astype(jnp.float32)


def jnp_backward(dout, q, k, v, out, lse, dlse, causal, scale, softcap):
    """Gradients from the global out / lse / dlse of these rows: the backward kernels' contract."""
    s, visible, t, kk, f = _scores(q, k, causal, scale, softcap)
    batch, rows_k, heads_kv, d = k.shape
    group = q.shape[2] // heads_kv
    vv = jnp.repeat(v, group, axis=2).astype(f)
    p = jnp.where(visible, jnp.exp(s - lse[..., None].astype(f)), 0.0)
    do = dout.astype(f)
    delta = jnp.swapaxes(jnp.sum(do * out.astype(f), -1), 1, 2) - dlse.astype(f)
    ds = p * (jnp.einsum("bqhd,bkhd->bhqk", do, vv) - delta[..., None])
    if softcap:
        ds = ds * (1 - t * t)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    per_kv = lambda x: x.reshape(batch, rows_k, heads_kv, group, d).sum(3)  # noqa: E731
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kk) * scale
    dk = per_kv(jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(f)) * scale)
    dv = per_kv(jnp.einsum("bhqk,bqhd->bkhd", p, do))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _single(causal, scale, softcap):
    """The whole sequence in one piece: the stand-in kernels under a custom_vjp, as cuattn's."""
    @jax.custom_vjp
    def f(q, k, v):
        return jnp_forward(q, k, v, causal, scale, softcap)

    def fwd(q, k, v):
        out, lse = jnp_forward(q, k, v, causal, scale, softcap)
        return (out, lse), (q, k, v, out, lse)

    def bwd(saved, grads):
        q, k, v, out, lse = saved
        return jnp_backward(grads[0], q, k, v, out, lse, grads[1], causal, scale, softcap)

    f.defvjp(fwd, bwd)
    return f


def run(world, layout, causal, dtype, softcap):
    rng = np.random.default_rng(world * 100 + len(layout) + causal)
    batch, seqlen, hq, hkv, d = 2, 8 * world * 2, 4, 2, 16
    full = [rng.standard_normal((batch, seqlen, h, d)) for h in (hq, hkv, hkv)]
    dout = rng.standard_normal((batch, seqlen, hq, d))
    scale = 0.3

    def loss(fn, q, k, v, g):
        out, lse = fn(q, k, v)
        return jnp.sum(out.astype(jnp.float64) * g) + jnp.sum(jnp.sin(lse.astype(jnp.float64)))

    single = _single(causal, scale, softcap)
    exact = lambda q, k, v: jnp_forward(q, k, v, causal, scale, softcap)  # noqa: E731  (float64, JAX's autodiff)
    want = jax.value_and_grad(lambda *a: loss(exact, *a), argnums=(0, 1, 2))(*map(jnp.asarray, full), dout)
    want_out, want_lse = jnp_forward(*map(jnp.asarray, full), causal, scale, softcap)
    one = [jnp.asarray(x).astype(dtype) for x in full]
    got_one = single(*one), jax.grad(lambda *a: loss(single, *a), argnums=(0, 1, 2))(*one, dout)

    mesh = jax.make_mesh((world,), ("cp",), devices=jax.devices()[:world])
    spec = NamedSharding(mesh, P(None, "cp"))
    stat = NamedSharding(mesh, P(None, None, "cp"))

    def sharded(x):  # rank r's shard is the r-th piece of the sharded axis
        return jax.device_put(jnp.asarray(np.concatenate([dist.shard(x, world, r, layout) for r in range(world)], axis=1)).astype(dtype), spec)

    ring = jax.shard_map(
        lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="cp", layout=layout, causal=causal, scale=scale, softcap=softcap,
                                                return_lse=True),
        mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=(P(None, "cp"), P(None, None, "cp")),
    )
    shards = [sharded(x) for x in full]
    g = jax.device_put(jnp.asarray(np.concatenate([dist.shard(dout, world, r, layout) for r in range(world)], axis=1)), spec)
    out, lse = jax.jit(ring)(*shards)
    grads = jax.jit(jax.grad(lambda *a: loss(ring, *a), argnums=(0, 1, 2)))(*shards, g)
    del stat

    def unshard(x, axis=1):
        pieces = np.split(np.asarray(x, np.float64), world, axis=axis)
        return dist.unshard(pieces, layout, axis=axis)

    results = {"out": (unshard(out), want_out, got_one[0][0]), "lse": (unshard(lse, 2), want_lse, got_one[0][1])}
    results.update({n: (unshard(a), w, o) for n, a, w, o in zip(("dq", "dk", "dv"), grads, want[1], got_one[1])})
    for name, (got, exact, same) in results.items():
        exact, same = np.asarray(exact, np.float64), np.asarray(same, np.float64)
        err = np.abs(got - exact).max()
        bar = 2e-5 if dtype == jnp.float32 else 2 * np.abs(same - exact).max() + 1e-6
        assert np.isfinite(got).all() and err <= bar, (world, layout, causal, dtype.__name__, name, err, bar)
    print(f"W={world} {layout} causal={causal} {dtype.__name__} softcap={softcap}: ok", flush=True)


def through_buffer_callback(fn):
    """``fn`` run the way cuattn.jax.call runs its kernels: in a ``buffer_callback`` (whose
    results carry no per-device type under shard_map), then ``cuattn.jax.varying_like``."""
    from jax.experimental.buffer_callback import buffer_callback

    from cuattn.jax import varying_like

    def wrapped(*arrays):
        def callback(ctx, outs, *buffers):
            for out, value in zip(outs, fn(*(jnp.asarray(np.asarray(b)) for b in buffers))):
                np.asarray(out)[...] = np.asarray(value)

        results = buffer_callback(callback, list(jax.eval_shape(fn, *arrays)))(*arrays)
        return tuple(varying_like(results, arrays))

    return wrapped


def main():
    assert len(jax.devices()) >= 4, jax.devices()
    jax_ring.kernels.update(forward=jnp_forward, backward=jnp_backward)
    for world, layout, causal, dtype in itertools.product((1, 2, 4), dist.LAYOUTS, (True, False), (jnp.float32, jnp.bfloat16)):
        run(world, layout, causal, dtype, None)
    run(4, "zigzag", True, jnp.bfloat16, 5.0)
    jax_ring.kernels.update(
        forward=lambda q, k, v, *o: through_buffer_callback(lambda *a: jnp_forward(*a, *o))(q, k, v),
        backward=lambda *a: through_buffer_callback(lambda *b: jnp_backward(*b, *a[7:]))(*a[:7]),
    )
    for world, layout, causal in itertools.product((1, 4), dist.LAYOUTS, (True, False)):
        run(world, layout, causal, jnp.float32, None)


if __name__ == "__main__":
    main()
