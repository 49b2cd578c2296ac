"""cuattn.jax.attention_with_kvcache / append_kv under jax.jit: against the float64 reference,
the new caches returned (aliased to the inputs: in place when donated), bad input at trace time."""

import numpy as np
import pytest

from cuattn import reference
from helpers import assert_attention_accuracy, naive_attention, randn
from test_decode import _cache, _expected_append, _gathered

pytestmark = pytest.mark.gpu
jax = pytest.importorskip("jax")
jnp = jax.numpy

import cuattn.jax as cj  # noqa: E402


def _check(out, q, k, v, table, lengths, dtype, **kw):
    out = np.asarray(out)
    ref = reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table, **kw)
    for b, length in enumerate(lengths):
        if length == 0:
            assert not out[b].astype(np.float32).any()
            continue
        kb, vb = _gathered(k, v, table, b, int(length))
        assert_attention_accuracy(out[b:b + 1], ref[b:b + 1], naive_attention(q[b:b + 1], kb[None], vb[None], dtype, **{"causal": True, **kw}))


@pytest.mark.parametrize("page_size", [None, 1, 16])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("seqlen_q", [1, 80])  # split decode, and the tiled forward (chunked prefill)
def test_jit_decode_matches_reference(page_size, dtype, seqlen_q):
    rng = np.random.default_rng(seqlen_q + (page_size or 0))
    lengths = np.array([0, 700, 1500], np.int32) if seqlen_q == 1 else np.array([90, 700, 1500], np.int32)
    k, v, table = _cache(rng, list(lengths), 1, 128, dtype, page_size)
    q = randn(rng, (3, seqlen_q, 8, 128), dtype)
    tables = {} if table is None else {"block_table": jnp.asarray(table)}
    fn = jax.jit(lambda q, k, v, n, **t: cj.attention_with_kvcache(q, k, v, cache_seqlens=n, return_lse=True, **t))
    out, lse = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), **tables)
    assert out.shape == q.shape and out.dtype == jnp.dtype(dtype) and lse.shape == (3, 8, seqlen_q)
    _check(out, q, k, v, table, lengths, dtype)
    ref_lse = reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table, return_lse=True)[1]
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), ~fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size, seqlen_new", [(None, 3), (16, 5), (7, 9), (16, 70)])
def test_append_returns_the_new_caches_and_attends_to_them(page_size, seqlen_new):
    rng = np.random.default_rng(20 + seqlen_new)
    lengths = np.array([0, 15, 300], np.int32)
    k, v, table = _cache(rng, [int(x) + seqlen_new for x in lengths], 2, 64, "bfloat16", page_size)
    q = randn(rng, (3, seqlen_new, 8, 64), "bfloat16")
    k_new, v_new = (randn(rng, (3, seqlen_new, 2, 64), "bfloat16") for _ in range(2))
    tables = {} if table is None else {"block_table": jnp.asarray(table)}

    @jax.jit
    def step(q, k, v, n, kn, vn, **t):
        return cj.attention_with_kvcache(q, k, v, cache_seqlens=n, k_new=kn, v_new=vn, **t)

    k_in, v_in = jnp.asarray(k), jnp.asarray(v)
    out, k_out, v_out = step(jnp.asarray(q), k_in, v_in, jnp.asarray(lengths), jnp.asarray(k_new), jnp.asarray(v_new), **tables)
    k_after, v_after = _expected_append(k, table, lengths, k_new), _expected_append(v, table, lengths, v_new)
    np.testing.assert_array_equal(np.asarray(k_out), k_after)
    np.testing.assert_array_equal(np.asarray(v_out), v_after)
    np.testing.assert_array_equal(np.asarray(k_in), k)  # not donated: the inputs keep their values
    _check(out, q, k_after, v_after, table, lengths + seqlen_new, "bfloat16")

    k2, v2 = cj.append_kv(jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(k), jnp.asarray(v), cache_seqlens=jnp.asarray(lengths), **tables)
    np.testing.assert_array_equal(np.asarray(k2), k_after)
    np.testing.assert_array_equal(np.asarray(v2), v_after)


def test_donated_caches_are_updated_in_place():
    """A decode step under jit with the caches donated: the returned caches live in the
    donated buffers (no copy of the cache per step)."""
    rng = np.random.default_rng(21)
    k, v, table = _cache(rng, [64, 64], 2, 64, "float16", 16, capacity=256)
    k_in, v_in = jnp.asarray(k), jnp.asarray(v)
    pointers = (k_in.unsafe_buffer_pointer(), v_in.unsafe_buffer_pointer())
    step = jax.jit(
        lambda q, k, v, n, kn, vn, t: cj.attention_with_kvcache(q, k, v, cache_seqlens=n, k_new=kn, v_new=vn, block_table=t),
        donate_argnums=(1, 2),
    )
    new = [jnp.asarray(randn(rng, (2, 1, 2, 64), "float16")) for _ in range(2)]
    _, k_out, v_out = step(jnp.asarray(randn(rng, (2, 1, 4, 64), "float16")), k_in, v_in, jnp.asarray(np.array([64, 10], np.int32)), *new,
                           jnp.asarray(table))
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    assert np.asarray(k_out)[table[1, 0], 10].tolist() == np.asarray(new[0])[1, 0].tolist()


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].astype(jnp.float32)}, ValueError, "cache_seqlens must be int32"),
    (lambda a: {**a, "k_new": a["k_new"][..., :32]}, ValueError, "k_new has shape"),
    (lambda a: {**a, "v_new": None}, TypeError, "k_new and v_new go together"),
])
def test_bad_arguments_raise_at_trace_time(change, error, match):
    rng = np.random.default_rng(22)
    k, v, _ = _cache(rng, [10, 10], 2, 64, "float16")
    args = {"q": jnp.asarray(randn(rng, (2, 1, 4, 64), "float16")), "k_cache": jnp.asarray(k), "v_cache": jnp.asarray(v),
            "cache_seqlens": jnp.asarray(np.array([3, 4], np.int32)), "k_new": jnp.asarray(randn(rng, (2, 1, 2, 64), "float16")),
            "v_new": jnp.asarray(randn(rng, (2, 1, 2, 64), "float16"))}
    args = change(args)
    with pytest.raises(error, match=match):
        jax.jit(lambda a: cj.attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), **a)).lower(args)
