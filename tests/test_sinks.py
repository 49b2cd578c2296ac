"""Attention sinks (a per-head logit in every row's softmax denominator, with no value): the
forward, backward (dsink included) and decode kernels against the float64 reference, the
adapters' gradients (GPU); the reference's gradient against finite differences and argument
checks (no GPU needed)."""

import numpy as np
import pytest

import cuattn
from cuattn import reference
from helpers import (
    KERNEL_PATHS, assert_attention_accuracy, kernel_path, max_err, naive_attention, naive_attention_backward, poison_cupy_pool, randn,
)

gpu = pytest.mark.gpu


def _sink(rng, heads):
    return (rng.standard_normal(heads) * 2.0).astype(np.float32)  # some above, some below the rows' maxima


def test_reference_sink_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 5, 4, 8)), rng.standard_normal((2, 7, 2, 8)), rng.standard_normal((2, 7, 2, 8))
    sink, dout, dlse = rng.standard_normal(4), rng.standard_normal((2, 5, 4, 8)), rng.standard_normal((2, 4, 5))
    kw = dict(causal=True, window=(2, -1), align="top_left")

    def loss(sink):
        out, lse = reference.attention(q, k, v, sink=sink, return_lse=True, **kw)
        return (out * dout).sum() + (lse * dlse).sum()

    out, lse = reference.attention(q, k, v, sink=sink, return_lse=True, **kw)
    *_, dsink = reference.attention_backward(dout, q, k, v, out, lse, sink=sink, dlse=dlse, **kw)
    eps = 1e-6
    numeric = [(loss(sink + eps * e) - loss(sink - eps * e)) / (2 * eps) for e in np.eye(4)]
    np.testing.assert_allclose(dsink, numeric, rtol=1e-6, atol=1e-8)


def test_reference_sink_is_a_partial_over_no_key():
    """The sink merges like a partial result with lse = sink and out = 0; a row that sees no
    key gets out = 0 and lse = sink."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 4, 2, 8)), rng.standard_normal((1, 2, 2, 8)), rng.standard_normal((1, 2, 2, 8))
    sink = np.array([0.5, -1.0])
    plain, plain_lse = reference.attention(q, k, v, causal=True, return_lse=True)  # bottom-right: rows 0, 1 see no key
    out, lse = reference.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    np.testing.assert_allclose(lse, np.logaddexp(plain_lse, sink[None, :, None]))
    np.testing.assert_array_equal(out[:, :2], 0.0)
    np.testing.assert_allclose(lse[:, :, :2], np.broadcast_to(sink[None, :, None], (1, 2, 2)))
    weight = np.exp(plain_lse - lse).transpose(0, 2, 1)[..., None]
    np.testing.assert_allclose(out[:, 2:], (plain * np.nan_to_num(weight))[:, 2:])


def test_a_sink_of_minus_infinity_has_a_finite_gradient():
    """A row that sees no key has lse = sink, so its p_sink is 1; with a sink of -inf both are
    -inf and exp(sink - lse) was NaN, making dsink NaN. The gradient is the limit of a very
    negative sink's."""
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((1, 3, 2, 8)), rng.standard_normal((1, 2, 2, 8)), rng.standard_normal((1, 2, 2, 8))
    dout, dlse = rng.standard_normal((1, 3, 2, 8)), rng.standard_normal((1, 2, 3))
    grads = []
    for sink in (np.array([-np.inf, 0.5]), np.array([-1e4, 0.5])):  # bottom-right causal: row 0 sees no key
        out, lse = reference.attention(q, k, v, causal=True, sink=sink, return_lse=True)
        grads.append(reference.attention_backward(dout, q, k, v, out, lse, causal=True, sink=sink, dlse=dlse)[3])
    assert np.isfinite(grads[0]).all()
    np.testing.assert_allclose(grads[0], grads[1], rtol=1e-12)


@pytest.mark.parametrize(
    "sink, exc, match",
    [
        (np.zeros((4, 1), np.float32), ValueError, "sink must have 1 dimensions"),
        (np.zeros(2, np.float32), ValueError, r"sink has shape \(2,\), expected \(4,\)"),
        (np.zeros(4, np.float16), TypeError, "sink must be float32"),
        (np.zeros(8, np.float32)[::2], ValueError, "sink must have unit stride"),
    ],
)
def test_bad_sinks_are_refused_before_any_launch(sink, exc, match):
    q, k = np.ones((1, 3, 4, 64), np.float16), np.ones((1, 5, 2, 64), np.float16)
    with pytest.raises(exc, match=match):
        cuattn.attention(q, k, k, sink=sink)
    with pytest.raises(exc, match=match):
        cuattn.attention_backward(q, q, k, k, q, np.zeros((1, 4, 3), np.float32), sink=sink)
    with pytest.raises(exc, match=match):
        cuattn.attention_with_kvcache(q, k, k, cache_seqlens=np.array([5], np.int32), sink=sink)


def _check_lse(lse, ref_lse):
    assert not np.isnan(lse).any()
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)


@gpu
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(
    "dtype, sq, sk, hq, hk, d, kw",
    [
        ("bfloat16", 113, 1023, 8, 2, 128, {"causal": True}),
        ("float16", 1023, 113, 4, 4, 64, {"causal": True}),  # bottom-right: the first 910 rows see no key
        ("bfloat16", 1, 1, 2, 1, 64, {}),
        ("float16", 200, 200, 4, 1, 256, {"window": (17, 3)}),
        ("bfloat16", 64, 300, 2, 2, 96, {"softcap": 20.0}),
        ("float32", 37, 70, 4, 2, 64, {"causal": True, "align": "top_left"}),
    ],
)
def test_forward_and_backward_match_the_reference(path, dtype, sq, sk, hq, hk, d, kw):
    import cupy

    rng = np.random.default_rng(sq * 7 + sk)
    q, k, v = randn(rng, (2, sq, hq, d), dtype), randn(rng, (2, sk, hk, d), dtype), randn(rng, (2, sk, hk, d), dtype)
    dout, sink = randn(rng, (2, sq, hq, d), dtype), _sink(rng, hq)
    dlse = rng.standard_normal((2, hq, sq)).astype(np.float32)
    ref_out, ref_lse = reference.attention(q, k, v, sink=sink, return_lse=True, **kw)
    with kernel_path(path):
        poison_cupy_pool()
        dev = [cupy.asarray(x) for x in (q, k, v, dout, sink, dlse)]
        out, lse = cuattn.attention(*dev[:3], sink=dev[4], return_lse=True, **kw)
        assert_attention_accuracy(out.get(), ref_out, naive_attention(q, k, v, dtype, sink=sink, **kw))
        _check_lse(lse.get(), ref_lse)
        for deterministic in (False, True):
            poison_cupy_pool()
            grads = cuattn.attention_backward(dev[3], *dev[:3], out, lse, sink=dev[4], dlse=dev[5], deterministic=deterministic, **kw)
            ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, sink=sink, dlse=dlse, **kw)
            naive = naive_attention_backward(dout, q, k, v, dtype, sink=sink, dlse=dlse, **kw)
            for name, g, r, n in zip(("dq", "dk", "dv", "dsink"), grads, ref, naive):
                g = g.get()
                assert g.shape == r.shape and not np.isnan(g.astype(np.float32)).any(), name
                bound = 3.0 * max_err(n, r) + 1e-5 * max(1.0, float(np.abs(r).max()))
                assert max_err(g, r) <= bound, f"{name}: {max_err(g, r):.3e} > {bound:.3e}"


@gpu
def test_dsink_of_a_sink_of_minus_infinity_is_finite():
    """The kernel's dsink where a head's sink is -inf and some rows see no key (bottom-right
    causal, more queries than keys) equals the reference's finite value (it was NaN)."""
    import cupy

    rng = np.random.default_rng(6)
    q, k, v, dout = (randn(rng, s, "bfloat16") for s in ((1, 200, 4, 64), (1, 120, 2, 64), (1, 120, 2, 64), (1, 200, 4, 64)))
    dlse = rng.standard_normal((1, 4, 200)).astype(np.float32)
    sink = np.array([-np.inf, 0.5, -np.inf, -2.0], np.float32)
    qd, kd, vd = cupy.asarray(q), cupy.asarray(k), cupy.asarray(v)
    out, lse = cuattn.attention(qd, kd, vd, causal=True, sink=cupy.asarray(sink), return_lse=True)
    dsink = cuattn.attention_backward(cupy.asarray(dout), qd, kd, vd, out, lse, causal=True, sink=cupy.asarray(sink),
                                      dlse=cupy.asarray(dlse))[3].get()
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True, sink=sink, dlse=dlse)[3]
    assert np.isfinite(dsink).all()
    np.testing.assert_allclose(dsink, ref, rtol=2e-2, atol=0.05 * np.abs(ref).max())


@gpu
def test_dsink_is_deterministic_and_gqa_shares_nothing_across_heads():
    """dsink is summed in a fixed order (bit-identical across runs), and each query head's
    sink only moves its own rows."""
    import cupy

    rng = np.random.default_rng(5)
    q, k = cupy.asarray(randn(rng, (3, 300, 8, 64), "bfloat16")), cupy.asarray(randn(rng, (3, 500, 2, 64), "bfloat16"))
    sink = cupy.asarray(_sink(rng, 8))
    out, lse = cuattn.attention(q, k, k, sink=sink, return_lse=True)
    bumped = sink.copy()
    bumped[3] += 1.0
    out2 = cuattn.attention(q, k, k, sink=bumped)
    changed = cupy.abs(out2.astype(cupy.float32) - out.astype(cupy.float32)).max(axis=(0, 1, 3)).get()
    assert changed[3] > 0 and not np.delete(changed, 3).any()
    dsinks = [cuattn.attention_backward(q, q, k, k, out, lse, sink=sink)[3].get() for _ in range(3)]
    assert all(np.array_equal(dsinks[0], d) for d in dsinks[1:])


@gpu
@pytest.mark.parametrize("page_size, num_splits, seqlen_q", [(None, 1, 1), (None, None, 1), (16, 5, 4), (1, None, 2), (None, None, 80), (16, None, 96)])
def test_decode_matches_the_reference(page_size, num_splits, seqlen_q):
    """Decoding with sinks, one split (the decode kernel adds the sink) and several (the merge
    adds it), paged and contiguous; 80+ new tokens take the forward kernel (chunked prefill).
    A sequence of length 0 sees only the sink."""
    import cupy

    rng = np.random.default_rng(seqlen_q)
    lengths, heads_q, heads_kv, head_dim = [700, 0, 129], 8, 2, 128
    capacity = 768
    if page_size is None:
        k, v = (randn(rng, (3, capacity, heads_kv, head_dim), "bfloat16") for _ in range(2))
        table = None
    else:
        pages = 3 * capacity // page_size
        k, v = (randn(rng, (pages, page_size, heads_kv, head_dim), "bfloat16") for _ in range(2))
        table = rng.permutation(pages).reshape(3, -1).astype(np.int32)
    q, sink = randn(rng, (3, seqlen_q, heads_q, head_dim), "bfloat16"), _sink(rng, heads_q)
    seqlens = np.array(lengths, np.int32)
    poison_cupy_pool()
    out, lse = cuattn.attention_with_kvcache(
        cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cache_seqlens=cupy.asarray(seqlens),
        block_table=None if table is None else cupy.asarray(table), sink=cupy.asarray(sink), num_splits=num_splits, return_lse=True,
    )
    out, lse = out.get(), lse.get()
    ref_out, ref_lse = reference.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, sink=sink, return_lse=True)
    _check_lse(lse, ref_lse)
    assert not out[1].astype(np.float32).any()
    for b in (0, 2):
        keys = k[b, :lengths[b]] if table is None else np.concatenate(list(k[table[b]]))[:lengths[b]]
        values = v[b, :lengths[b]] if table is None else np.concatenate(list(v[table[b]]))[:lengths[b]]
        naive = naive_attention(q[b:b + 1], keys[None], values[None], "bfloat16", causal=True, sink=sink)
        assert_attention_accuracy(out[b:b + 1], ref_out[b:b + 1], naive)


@gpu
def test_torch_gradients_match_float64_autograd():
    """cuattn.torch.attention with a learnable sink (eager autograd and the traced op) against
    a float64 autograd of the textbook form: the sink as one more score column, dropped after
    the softmax."""
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 70, 8, 64, generator=g, device="cuda", dtype=torch.float64)
    k, v = (torch.randn(2, 90, 2, 64, generator=g, device="cuda", dtype=torch.float64) for _ in range(2))
    sink = torch.randn(8, generator=g, device="cuda", dtype=torch.float64)
    w = torch.randn(2, 70, 8, 64, generator=g, device="cuda", dtype=torch.float64)

    def textbook(q, k, v, sink):
        kx, vx = k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2)
        s = torch.einsum("bmhd,bnhd->bhmn", q, kx) / 8.0
        s = s.masked_fill(torch.ones(70, 90, dtype=torch.bool, device="cuda").triu(91 - 70), float("-inf"))
        s = torch.cat([s, sink.view(1, 8, 1, 1).expand(2, 8, 70, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
        return torch.einsum("bhmn,bnhd->bmhd", p, vx)

    def grads(fn, dtype):
        xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)] + [sink.detach().float().requires_grad_()]
        (fn(*xs).double() * w).sum().backward()
        return [x.grad.double() for x in xs]

    exact = grads(textbook, torch.float64)
    base = grads(lambda q, k, v, s: textbook(q, k, v, s.to(q.dtype)), torch.bfloat16)
    eager = grads(lambda q, k, v, s: ct.attention(q, k, v, causal=True, sink=s), torch.bfloat16)
    compiled = grads(torch.compile(lambda q, k, v, s: ct.attention(q, k, v, causal=True, sink=s), fullgraph=True), torch.bfloat16)
    for name, e, b, x, c in zip(("dq", "dk", "dv", "dsink"), exact, base, eager, compiled):
        bound = 3.0 * float((b - e).abs().max()) + 1e-5
        assert float((x - e).abs().max()) <= bound, name
        assert float((c - e).abs().max()) <= bound, name


@gpu
def test_torch_sink_ops_pass_opcheck():
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct
    from cuattn.options import AttnOptions

    q = torch.randn(1, 33, 4, 64, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(1, 40, 2, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    sink = torch.randn(4, device="cuda")
    options = AttnOptions.from_user(causal=True, head_dim=64).flat()
    torch.library.opcheck(ct.op("attention_sink"), (q, k, v, sink), options)
    out, lse = ct.op("attention_sink")(q, k, v, sink, **options)
    torch.library.opcheck(ct.op("attention_sink_backward"), (torch.randn_like(out), q, k, v, out, lse, None, sink), {**options, "deterministic": True})


@gpu
def test_jax_gradient_in_the_sink_matches_the_reference():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuattn.jax as cj

    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 50, 4, 64), "float32"), randn(rng, (2, 60, 2, 64), "float32"), randn(rng, (2, 60, 2, 64), "float32")
    sink, w = _sink(rng, 4), rng.standard_normal((2, 50, 4, 64)).astype(np.float32)

    def loss(q, k, v, sink):
        return (cj.attention(q, k, v, causal=True, sink=sink) * w).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*map(jnp.asarray, (q, k, v, sink)))
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, sink=sink, return_lse=True)
    ref = reference.attention_backward(w, q, k, v, ref_out, ref_lse, causal=True, sink=sink)
    for g, r in zip(grads, ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=2e-4, atol=2e-4)


@gpu
def test_varlen_forward_and_backward_match_each_sequence_alone():
    """Packed sequences with sinks: each sequence's out, lse and gradients as attention alone
    (float64 reference); dsink sums every sequence's rows."""
    import cupy

    rng = np.random.default_rng(9)
    lengths_q, lengths_k = [5, 0, 130, 64], [9, 3, 130, 200]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lengths_q, lengths_k))
    hq, hk, d, dtype = 4, 2, 64, "bfloat16"
    q, k, v = randn(rng, (cu_q[-1], hq, d), dtype), randn(rng, (cu_k[-1], hk, d), dtype), randn(rng, (cu_k[-1], hk, d), dtype)
    dout, sink = randn(rng, (cu_q[-1], hq, d), dtype), _sink(rng, hq)
    dev = [cupy.asarray(x) for x in (q, k, v, cu_q, cu_k, dout, sink)]
    poison_cupy_pool()
    out, lse = cuattn.attention_varlen(*dev[:5], causal=True, sink=dev[6], return_lse=True)
    grads = [g.get() for g in cuattn.attention_varlen_backward(dev[5], *dev[:3], out, lse, *dev[3:5], causal=True, sink=dev[6])]
    out, lse = out.get(), lse.get()
    dsink, naive_dsink = np.zeros(hq), np.zeros(hq)
    for b in range(len(lengths_q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref_out, ref_lse = reference.attention(q[None, rows], k[None, keys], v[None, keys], causal=True, sink=sink, return_lse=True)
        _check_lse(lse[:, rows], ref_lse[0])
        naive = naive_attention(q[None, rows], k[None, keys], v[None, keys], dtype, causal=True, sink=sink)
        assert_attention_accuracy(out[None, rows], ref_out, naive)
        ref = reference.attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], ref_out, ref_lse, causal=True, sink=sink)
        naive_grads = naive_attention_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], dtype, causal=True, sink=sink)
        for g, r, n in zip((grads[0][rows], grads[1][keys], grads[2][keys]), ref[:3], naive_grads[:3]):
            assert max_err(g[None], r) <= 3.0 * max_err(n, r) + 1e-5
        dsink, naive_dsink = dsink + ref[3], naive_dsink + naive_grads[3]
    assert max_err(grads[3], dsink) <= 3.0 * max_err(naive_dsink, dsink) + 1e-5 * max(1.0, float(np.abs(dsink).max()))
