"""The float64 reference against the textbook definition (materialized softmax)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuattn import reference


def textbook(q, k, v, causal=False, window=None, align="bottom_right", scale=None, softcap=None):
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    k = np.repeat(k, hq // hk, axis=2)
    v = np.repeat(v, hq // hk, axis=2)
    s = np.einsum("bmhd,bnhd->bhmn", q, k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    offset = sk - sq if align == "bottom_right" else 0
    left, right = reference.window_bounds(causal, window)
    i, j = np.arange(sq)[:, None] + offset, np.arange(sk)[None, :]
    ok = np.ones((sq, sk), bool)
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    s = np.where(ok, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    out = np.einsum("bhmn,bnhd->bmhd", p / np.where(denom > 0, denom, 1), v)
    lse = np.where(denom[..., 0] > 0, m[..., 0] + np.log(np.where(denom[..., 0] > 0, denom[..., 0], 1)), -np.inf)
    return out, lse


def textbook_grads(q, k, v, dout, dlse, **kw):
    """Closed-form gradients on the materialized probabilities, written independently of the
    reference's chunked loop (test_backward_matches_finite_differences checks the formula)."""
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    g = hq // hk
    scale = kw.get("scale") or 1 / math.sqrt(d)
    softcap = kw.get("softcap")
    out, lse = textbook(q, k, v, **kw)
    kk, vv = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    raw = np.einsum("bmhd,bnhd->bhmn", q, kk) * scale
    s = softcap * np.tanh(raw / softcap) if softcap else raw
    s = _mask_scores(s, q, k, **kw)
    safe_lse = np.where(np.isfinite(lse), lse, 0)[..., None]
    p = np.where(np.isfinite(s) & np.isfinite(lse)[..., None], np.exp(s - safe_lse), 0)
    dp = np.einsum("bmhd,bnhd->bhmn", dout, vv)
    delta = np.einsum("bmhd,bmhd->bhm", dout, out)
    ds = p * (dp - delta[..., None] + dlse[..., None])
    if softcap:
        ds *= 1 - np.tanh(raw / softcap) ** 2
    ds *= scale
    dq = np.einsum("bhmn,bnhd->bmhd", ds, kk)
    dk = np.einsum("bhmn,bmhd->bnhd", ds, q).reshape(b, -1, hk, g, d).sum(3)
    dv = np.einsum("bhmn,bmhd->bnhd", p, dout).reshape(b, -1, hk, g, d).sum(3)
    return out, lse, dq, dk, dv


def _mask_scores(s, q, k, causal=False, window=None, align="bottom_right", **_):
    sq, sk = q.shape[1], k.shape[1]
    offset = reference.diagonal_offset(sq, sk, align)
    left, right = reference.window_bounds(causal, window)
    ok = reference.visible(np.arange(sq), np.arange(sk), offset, left, right)
    return np.where(ok, s, -np.inf)


shapes = st.fixed_dictionaries({
    "batch": st.integers(1, 2),
    "seqlen_q": st.sampled_from([1, 2, 17, 40]),
    "seqlen_k": st.sampled_from([1, 3, 17, 33]),
    "heads_kv": st.integers(1, 2),
    "group": st.sampled_from([1, 3]),
    "head_dim": st.sampled_from([1, 8, 12]),
    "causal": st.booleans(),
    "window": st.sampled_from([None, (3, None), (None, 2), (4, 1), (0, 0)]),
    "align": st.sampled_from(["bottom_right", "top_left"]),
    "softcap": st.sampled_from([None, 2.0]),
})


def _inputs(rng, c):
    hq = c["heads_kv"] * c["group"]
    q = rng.standard_normal((c["batch"], c["seqlen_q"], hq, c["head_dim"]))
    k = rng.standard_normal((c["batch"], c["seqlen_k"], c["heads_kv"], c["head_dim"]))
    v = rng.standard_normal((c["batch"], c["seqlen_k"], c["heads_kv"], c["head_dim"]))
    kw = {x: c[x] for x in ("causal", "window", "align", "softcap")}
    return q, k, v, kw


@settings(max_examples=60, deadline=None)
@given(shapes, st.integers(0, 2**32 - 1))
def test_attention_matches_textbook(c, seed):
    rng = np.random.default_rng(seed)
    q, k, v, kw = _inputs(rng, c)
    ref_out, ref_lse = textbook(q, k, v, **kw)
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)


def test_chunked_online_softmax_spans_several_chunks(monkeypatch):
    """Chunks smaller than the sequence, so the rescale path of the online softmax runs."""
    monkeypatch.setattr(reference, "QUERY_CHUNK", 7)
    monkeypatch.setattr(reference, "KEY_CHUNK", 5)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, n, 2, 8)) * 3 for n in (23, 31, 31))
    for kw in ({}, {"causal": True}, {"window": (4, 2), "align": "top_left"}):
        ref_out, ref_lse = textbook(q, k, v, **kw)
        out, lse = reference.attention(q, k, v, return_lse=True, **kw)
        np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)
        dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
        _, _, dq, dk, dv = textbook_grads(q, k, v, dout, dlse, **kw)
        got = reference.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
        for g, r in zip(got, (dq, dk, dv)):
            np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11)


@settings(max_examples=40, deadline=None)
@given(shapes, st.integers(0, 2**32 - 1))
def test_backward_matches_textbook(c, seed):
    rng = np.random.default_rng(seed)
    q, k, v, kw = _inputs(rng, c)
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    _, _, dq, dk, dv = textbook_grads(q, k, v, dout, dlse, **kw)
    got = reference.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    for g, r in zip(got, (dq, dk, dv)):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-11)


def test_backward_matches_finite_differences():
    """The closed-form gradients are the derivative of the forward (incl. lse and softcap)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, n, 2, 4)) for n in (5, 6, 6))
    kw = {"causal": True, "softcap": 1.5, "window": (3, None)}
    dout, dlse = rng.standard_normal(q.shape), rng.standard_normal((1, 2, 5))

    def loss(q, k, v):
        out, lse = reference.attention(q, k, v, return_lse=True, **kw)
        return float((out * dout).sum() + (lse * dlse).sum())

    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    grads = reference.attention_backward(dout, q, k, v, out, lse, dlse=dlse, **kw)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        it = np.nditer(x, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            x[i] += eps
            up = loss(q, k, v)
            x[i] -= 2 * eps
            down = loss(q, k, v)
            x[i] += eps
            assert abs((up - down) / (2 * eps) - g[i]) < 1e-6


def test_fully_masked_rows_are_zero_with_neg_inf_lse():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, n, 1, 8)) for n in (6, 3, 3))
    out, lse = reference.attention(q, k, v, causal=True, return_lse=True)  # bottom-right: rows 0..2 see nothing
    assert np.all(out[0, :3] == 0) and np.all(np.isneginf(lse[0, 0, :3]))
    assert np.all(np.isfinite(lse[0, 0, 3:]))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_nan_or_infinite_score_makes_its_row_nan(value, monkeypatch):
    """A row that sees a NaN or +inf score has out and lse NaN (a NaN key gave out 0 and lse
    -inf, which a merge by lse weighs 0: the NaN vanished), wherever the key falls among the
    reference's key chunks; rows that do not see the key are unchanged."""
    monkeypatch.setattr(reference, "KEY_CHUNK", 4)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, n, 2, 8)) for n in (6, 10, 10))
    q[..., 0] = np.abs(q[..., 0]) + 0.1  # a key component of +inf gives +inf scores
    clean = reference.attention(q, k, v, causal=True, align="top_left", return_lse=True)
    for key in (1, 6):  # the first key chunk, a later one
        bad = k.copy()
        bad[0, key, 1, 0] = value
        out, lse = reference.attention(q, bad, v, causal=True, align="top_left", return_lse=True)
        seeing = np.arange(6) >= key
        assert np.isnan(out[0, seeing, 1]).all() and np.isnan(lse[0, 1, seeing]).all()
        np.testing.assert_array_equal(out[0, ~seeing], clean[0][0, ~seeing])
        np.testing.assert_array_equal(out[0, :, 0], clean[0][0, :, 0])
        assert np.isnan(reference.merge([out, clean[0]], [lse, clean[1]])[1][0, 1, seeing]).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 9), st.integers(1, 3), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_merge_equals_attention_over_the_union(n, batch, seqlen, heads, head_dim, seed):
    rng = np.random.default_rng(seed)
    sk = 4 * n
    q = rng.standard_normal((batch, seqlen, heads, head_dim))
    k, v = (rng.standard_normal((batch, sk, heads, head_dim)) for _ in range(2))
    cuts = np.sort(rng.choice(np.arange(1, sk), size=n - 1, replace=False)) if n > 1 else []
    bounds = [0, *cuts, sk]
    parts = [reference.attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in zip(bounds, bounds[1:])]
    out, lse = reference.merge([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-10, atol=1e-12)


def test_merge_of_empty_partials():
    outs = np.ones((2, 1, 3, 1, 4))
    lses = np.full((2, 1, 1, 3), -np.inf)
    lses[1, 0, 0, 1] = 0.5
    out, lse = reference.merge(outs, lses)
    assert np.all(out[0, 0] == 0) and np.all(out[0, 2] == 0) and np.all(out[0, 1] == 1)
    assert np.isneginf(lse[0, 0, 0]) and lse[0, 0, 1] == 0.5


def test_align_rejects_unknown():
    with pytest.raises(ValueError, match="align"):
        reference.diagonal_offset(3, 4, "center")


def test_varlen_references_take_cuattns_signatures_and_sinks():
    """The varlen references have cuattn.attention_varlen(_backward)'s keywords (an unknown one
    is a TypeError, not ignored), and a sink counts in every packed sequence as in the dense
    reference run on it alone; dsink sums over the sequences."""
    import inspect

    import cuattn

    for name in ("attention_varlen", "attention_varlen_backward"):
        ours, theirs = inspect.signature(getattr(reference, name)), inspect.signature(getattr(cuattn, name))
        assert list(ours.parameters) == list(theirs.parameters), name
    rng = np.random.default_rng(3)
    lengths = [5, 0, 9]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, dout = (rng.standard_normal((cu[-1], h, 16)) for h in (4, 2, 2, 4))
    sink = rng.standard_normal(4)
    out, lse = reference.attention_varlen(q, k, v, cu, cu, causal=True, sink=sink, return_lse=True)
    dq, dk, dv, dsink = reference.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True, sink=sink)
    total = np.zeros(4)
    for b in range(len(lengths)):
        r = slice(cu[b], cu[b + 1])
        o, l = reference.attention(q[None, r], k[None, r], v[None, r], causal=True, sink=sink, return_lse=True)
        np.testing.assert_allclose(out[r], o[0], atol=1e-12)
        np.testing.assert_allclose(lse[:, r], l[0], atol=1e-12)
        grads = reference.attention_backward(dout[None, r], q[None, r], k[None, r], v[None, r], o, l, causal=True, sink=sink)
        for got, want in zip((dq, dk, dv), grads[:3]):
            np.testing.assert_allclose(got[r], want[0], atol=1e-12)
        total += grads[3]
    np.testing.assert_allclose(dsink, total, atol=1e-12)
    assert not np.allclose(out, reference.attention_varlen(q, k, v, cu, cu, causal=True))  # the sink changed something
    with pytest.raises(TypeError):
        reference.attention_varlen(q, k, v, cu, cu, sink_tokens=1)


def test_reference_merge_of_a_nan_lse_is_nan():
    """The float64 reference the GPU test compares with: a partial of lse NaN gives out and lse
    NaN on its row alone."""
    rng = np.random.default_rng(12)
    outs = rng.standard_normal((3, 1, 4, 2, 5))
    lses = rng.standard_normal((3, 1, 2, 4))
    lses[2, 0, 0, 3] = np.nan
    out, lse = reference.merge(outs, lses)
    assert np.isnan(lse).sum() == 1 and np.isnan(lse[0, 0, 3])
    assert np.isnan(out).sum() == 5 and np.isnan(out[0, 3, 0]).all()


def test_reference_dropout_takes_the_seed_arrays_the_kernels_take():
    """The oracle read only an int seed; calls replayed by CUDA graphs pass (2,) uint32 words
    (low first) or one int64 / uint64."""
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 40, 2, 16)) for _ in range(3))
    seed = (7 << 32) | 12345
    want = reference.attention(q, k, v, dropout_p=0.3, dropout_seed=seed)
    for array in (np.array([12345, 7], np.uint32), np.array([seed], np.int64), np.array([seed], np.uint64)):
        np.testing.assert_array_equal(reference.attention(q, k, v, dropout_p=0.3, dropout_seed=array), want)
    assert not np.array_equal(reference.attention(q, k, v, dropout_p=0.3, dropout_seed=seed + 1), want)
