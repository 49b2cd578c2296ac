"""Ring attention in JAX (cuattn.jax.ring_attention, cuattn/dist/jax_ring.py).

- No GPU: the whole ring under ``shard_map`` on 4 CPU devices with jnp attention in place of the
  kernels, also run inside a ``buffer_callback`` as cuattn's are (tests/jax_ring_cpu.py, in a
  subprocess: the device count is fixed at JAX's start), every layout, causal and not,
  W = 1, 2, 4, against float64; argument checks.
- GPU: cuattn's kernels in each layout's pieces, the branch picked by a traced rank, every rank
  of a W = 4 ring run on one GPU (the exchange left out) against float64 within 2x the
  single-device error, forward and backward; and the ring under ``shard_map`` over one GPU.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cuattn
from conftest import HAS_GPU
from cuattn import dist, reference
from helpers import max_err

jax = pytest.importorskip("jax")
jnp = jax.numpy
P = jax.sharding.PartitionSpec

from cuattn.dist import jax_ring  # noqa: E402


@pytest.mark.skipif(HAS_GPU, reason="the schedule is checked on CPU devices in CI; the GPU tests run the kernels")
def test_ring_on_cpu_devices_matches_float64():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(Path(cuattn.__file__).parents[1]), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("jax_ring_cpu.py"))], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(": ok") == 37 + 12, result.stdout


def _one_device_ring(fn):
    """``fn`` under shard_map over a mesh of one device, its arguments placed on it."""
    mesh = jax.make_mesh((1,), ("cp",), devices=jax.devices()[:1])
    ring = jax.shard_map(fn, mesh=mesh, in_specs=(P(None, "cp"),) * 3, out_specs=P(None, "cp"))
    sharding = jax.sharding.NamedSharding(mesh, P(None, "cp"))
    return lambda *arrays: ring(*(jax.device_put(x, sharding) for x in arrays))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"layout": "spiral"}, ValueError, "layout must be one of"),
    ({"causal": "yes"}, TypeError, "causal"),
    ({"return_lse": 1}, TypeError, "return_lse"),
    ({"softcap": -1.0}, ValueError, "softcap"),
])
def test_bad_arguments_are_refused_while_tracing(kwargs, error, match):
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    ring = _one_device_ring(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="cp", **kwargs))
    with pytest.raises(error, match=match):
        jax.eval_shape(ring, q, q, q)


def test_shards_of_unequal_rows_are_refused():
    q, k = jnp.ones((1, 8, 2, 16), jnp.float32), jnp.ones((1, 4, 2, 16), jnp.float32)
    ring = _one_device_ring(lambda q, k, v: jax_ring.ring_attention(q, k, v, axis_name="cp"))
    with pytest.raises(ValueError, match="self-attention"):
        jax.eval_shape(ring, q, k, k)


def _simulated(shards, douts, layout, causal, world, scale):
    """Every rank's forward and backward on one device from jax_ring's pieces and fold, rank
    traced (lax.switch picks the branch); the K/V shard of step s taken from rank r - s."""
    q_all, k_all, v_all = (jnp.stack(x) for x in shards)
    rows = q_all.shape[2]

    @jax.jit
    def forward(rank):
        acc = lse = None
        for s in range(world):
            src = (rank - s) % world
            pieces = jax_ring.cases(layout, causal, s, rows)
            out_s, lse_s = jax_ring._switch(rank, s, [jax_ring._forward_piece(p, q_all[rank], k_all[src], v_all[src], scale, None, None)
                                                      for p in pieces])
            acc, lse = jax_ring.fold(acc, lse, out_s, lse_s)
        return acc.astype(q_all.dtype), lse

    @jax.jit
    def backward(rank, dout, out, lse):
        dq, dks, dvs = jnp.zeros(q_all.shape[1:], jnp.float32), [], []
        dlse = jnp.zeros_like(lse)
        for s in range(world):
            src = (rank - s) % world
            pieces = jax_ring.cases(layout, causal, s, rows)
            branches = [jax_ring._backward_piece(p, dout, q_all[rank], k_all[src], v_all[src], out, lse, dlse, scale, None, None) for p in pieces]
            dq_s, dk_s, dv_s = jax_ring._switch(rank, s, branches)
            dq = dq + dq_s.astype(jnp.float32)
            dks.append(dk_s.astype(jnp.float32))
            dvs.append(dv_s.astype(jnp.float32))
        return dq, dks, dvs

    outs, lses = zip(*(forward(jnp.int32(r)) for r in range(world)))
    dq = [None] * world
    dk = [np.zeros(k_all.shape[1:]) for _ in range(world)]
    dv = [np.zeros(v_all.shape[1:]) for _ in range(world)]
    for r in range(world):
        dq[r], dks, dvs = backward(jnp.int32(r), douts[r], outs[r], lses[r])
        for s in range(world):
            dk[(r - s) % world] += np.asarray(dks[s], np.float64)
            dv[(r - s) % world] += np.asarray(dvs[s], np.float64)
    f64 = lambda xs: [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in xs]  # noqa: E731
    return f64(outs), f64(lses), f64(dq), dk, dv


@pytest.mark.gpu
@pytest.mark.parametrize("layout, causal, dtype", [
    ("zigzag", True, "bfloat16"), ("stripe", True, "float16"), ("contiguous", True, "bfloat16"), ("contiguous", False, "bfloat16"),
])
def test_every_rank_of_a_simulated_ring_matches_float64(layout, causal, dtype):
    """W = 4, GQA 4:2, d64, 256 tokens: out, lse and dq / dk / dv of every rank's shard within 2x
    the error of cuattn.jax.attention over the whole sequence in the same dtype."""
    import cuattn.jax as cj

    world, scale = 4, 0.125
    rng = np.random.default_rng(len(layout) + causal)
    full = [rng.standard_normal((2, 256, h, 64)) for h in (4, 2, 2)]
    dout = rng.standard_normal((2, 256, 4, 64))
    want_out, want_lse = reference.attention(*full, causal=causal, scale=scale, return_lse=True)
    want = [want_out, want_lse, *reference.attention_backward(dout, *full, want_out, want_lse, causal=causal, scale=scale)]

    xs = [jnp.asarray(x, dtype) for x in full]
    single = lambda q, k, v: cj.attention(q, k, v, causal=causal, scale=scale, return_lse=True)  # noqa: E731
    one_out, one_lse = jax.jit(single)(*xs)
    loss = lambda q, k, v: (single(q, k, v)[0].astype(jnp.float32) * jnp.asarray(dout, jnp.float32)).sum()  # noqa: E731
    one = [one_out, one_lse, *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs)]

    shards = [[jnp.asarray(dist.shard(x, world, r, layout), dtype) for r in range(world)] for x in full]
    douts = [jnp.asarray(dist.shard(dout, world, r, layout), dtype) for r in range(world)]
    got = _simulated(shards, douts, layout, causal, world, scale)
    for name, parts, exact, same in zip(("out", "lse", "dq", "dk", "dv"), got, want, one):
        axis = 2 if name == "lse" else 1
        ring = dist.unshard(parts, layout, axis=axis)
        err, bar = max_err(ring, exact), max_err(np.asarray(jnp.asarray(same, jnp.float32), np.float64), exact)
        assert err <= 2 * bar + 1e-5, (layout, name, err, bar)


@pytest.mark.gpu
def test_ring_under_shard_map_on_one_gpu_is_cuattn_attention():
    """W = 1 under shard_map (the ring's collectives on a one-device mesh): out and the
    gradients within 2x the error of cuattn.jax.attention against float64."""
    import cuattn.jax as cj

    rng = np.random.default_rng(3)
    full = [rng.standard_normal((2, 96, h, 64)) for h in (4, 1, 1)]
    dout = rng.standard_normal((2, 96, 4, 64))
    want_out, want_lse = reference.attention(*full, causal=True, return_lse=True)
    want = [want_out, *reference.attention_backward(dout, *full, want_out, want_lse, causal=True)]
    xs = [jnp.asarray(x, jnp.bfloat16) for x in full]
    w = jnp.asarray(dout, jnp.float32)

    def results(fn):
        loss = lambda q, k, v: (fn(q, k, v).astype(jnp.float32) * w).sum()  # noqa: E731
        return [np.asarray(x.astype(jnp.float32), np.float64) for x in (jax.jit(fn)(*xs), *jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs))]

    ring = results(_one_device_ring(lambda q, k, v: cj.ring_attention(q, k, v, axis_name="cp", layout="zigzag", causal=True)))
    single = results(lambda q, k, v: cj.attention(q, k, v, causal=True))
    for name, got, same, exact in zip(("out", "dq", "dk", "dv"), ring, single, want):
        assert max_err(got, exact) <= 2 * max_err(same, exact) + 1e-5, name
