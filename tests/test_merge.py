"""cuattn.merge / merge_ on the GPU against the float64 reference."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cuattn
from cuattn import reference
from helpers import assert_close_to_rounding, poison_cupy_pool, randn

pytestmark = pytest.mark.gpu


def _partials(rng, n, shape, dtype, empty_fraction=0.1):
    b, s, h, d = shape
    outs = randn(rng, (n, b, s, h, d), dtype)
    lses = (rng.standard_normal((n, b, h, s)) * 5).astype(np.float32)
    lses[rng.random(lses.shape) < empty_fraction] = -np.inf
    lses[:, 0, 0, 0] = -np.inf  # one row seen by no partial
    # An empty partial's values must not reach the result, NaN included.
    outs[np.isneginf(lses).transpose(0, 1, 3, 2)] = np.nan
    return outs, lses


def _check(out, lse, outs, lses, dtype):
    ref_out, ref_lse = reference.merge(outs, lses)
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert_close_to_rounding(out, ref_out, dtype)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-6, atol=2e-6)
    assert np.all(out[0, 0, 0] == 0)


@settings(max_examples=40, deadline=None)
@example(n=40, shape=(2, 1, 2, 1), dtype="bfloat16", stacked=False, seed=2)  # rounded per group of 16, one element was off
@example(n=300, shape=(1, 17, 3, 64), dtype="float16", stacked=True, seed=5)  # groups of groups
@given(
    n=st.sampled_from([1, 2, 3, 16, 17, 40]),
    shape=st.tuples(st.integers(1, 3), st.sampled_from([1, 17, 113]), st.integers(1, 4), st.sampled_from([1, 8, 12, 64, 128, 256, 264])),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    stacked=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_merge_matches_reference(n, shape, dtype, stacked, seed):
    import cupy

    rng = np.random.default_rng(seed)
    outs, lses = _partials(rng, n, shape, dtype)
    d_outs, d_lses = cupy.asarray(outs), cupy.asarray(lses)
    poison_cupy_pool()
    if stacked:
        out, lse = cuattn.merge(d_outs, d_lses)
    else:
        out, lse = cuattn.merge(list(d_outs), list(d_lses))
    assert isinstance(out, cupy.ndarray) and out.dtype == outs.dtype and lse.dtype == np.float32
    assert out.shape == shape and lse.shape == (shape[0], shape[2], shape[1])
    _check(out.get(), lse.get(), outs, lses, dtype)  # rounded once, whatever the number of partials


def test_strided_views_and_unaligned_head_dim():
    """Partials laid out (batch, heads, seqlen, head_dim) in memory, viewed transposed; and a
    head_dim that forces the element-wise path."""
    import cupy

    rng = np.random.default_rng()
    for d in (64, 12):
        base = cupy.asarray(randn(rng, (3, 2, 4, 33, d), "bfloat16"))
        outs = base.transpose(0, 1, 3, 2, 4)
        lses = cupy.asarray((rng.standard_normal((3, 2, 4, 33)) * 3).astype(np.float32))
        out, lse = cuattn.merge(outs, lses)
        ref_out, ref_lse = reference.merge(outs.get(), lses.get())
        assert_close_to_rounding(out.get(), ref_out, "bfloat16")
        np.testing.assert_allclose(lse.get(), ref_lse, rtol=2e-6, atol=2e-6)


def test_all_partials_empty_gives_zero_and_neg_inf():
    import cupy

    outs = cupy.full((2, 1, 5, 2, 8), np.nan, dtype=np.float32)  # never read: their lse is -inf
    lses = cupy.full((2, 1, 2, 5), -np.inf, dtype=np.float32)
    out, lse = cuattn.merge(outs, lses)
    assert bool((out == 0).all()) and bool(cupy.isneginf(lse).all())


@pytest.mark.parametrize("parts", [2, 20])  # 20: merged in groups of 16, then the groups
def test_a_partial_of_infinite_lse_gives_nan_and_inf_as_the_reference(parts):
    """Scores that overflowed (lse +inf) show in the merged row as out NaN and lse +inf, as in
    cuattn.reference.merge; the kernel made such a row out 0, lse -inf (a row that saw no key).
    Rows beside it merge as usual."""
    import cupy

    rng = np.random.default_rng(9)
    outs = rng.standard_normal((parts, 1, 3, 2, 8)).astype(np.float32)
    lses = rng.standard_normal((parts, 1, 2, 3)).astype(np.float32)
    lses[1, 0, 1, 2] = np.inf
    out, lse = cuattn.merge(cupy.asarray(outs), cupy.asarray(lses))
    ref_out, ref_lse = reference.merge(outs, lses)
    assert np.isposinf(ref_lse[0, 1, 2]) and np.isnan(ref_out[0, 2, 1]).all()
    np.testing.assert_array_equal(np.isnan(out.get()), np.isnan(ref_out))
    np.testing.assert_allclose(lse.get(), ref_lse, rtol=2e-6, atol=2e-6)
    finite = ~np.isnan(ref_out)
    np.testing.assert_allclose(out.get()[finite], ref_out[finite], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("parts", [2, 17])
def test_a_partial_of_nan_lse_gives_nan_as_the_reference(parts):
    """A partial whose lse is NaN makes its merged row out NaN and lse NaN, in the kernel and
    in cuattn.reference.merge (both made it an empty row: fmaxf passes over NaN; 17 partials
    take the grouped path); in place too. Rows beside it merge as usual."""
    import cupy

    rng = np.random.default_rng(11)
    outs = rng.standard_normal((parts, 1, 3, 2, 8)).astype(np.float32)
    lses = rng.standard_normal((parts, 1, 2, 3)).astype(np.float32)
    lses[1, 0, 1, 2] = np.nan
    ref_out, ref_lse = reference.merge(outs, lses)
    assert np.isnan(ref_lse[0, 1, 2]) and np.isnan(ref_out[0, 2, 1]).all()
    assert np.isnan(ref_lse).sum() == 1 and np.isnan(ref_out).sum() == 8
    out, lse = cuattn.merge(cupy.asarray(outs), cupy.asarray(lses))
    np.testing.assert_array_equal(np.isnan(out.get()), np.isnan(ref_out))
    np.testing.assert_array_equal(np.isnan(lse.get()), np.isnan(ref_lse))
    finite = ~np.isnan(ref_lse)
    np.testing.assert_allclose(lse.get()[finite], ref_lse[finite], rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(out.get()[~np.isnan(ref_out)], ref_out[~np.isnan(ref_out)], rtol=1e-5, atol=1e-6)
    acc_out, acc_lse = cupy.asarray(outs[0]), cupy.asarray(lses[0])
    cuattn.merge_(acc_out, acc_lse, cupy.asarray(outs[1]), cupy.asarray(lses[1]))
    ref2_out, ref2_lse = reference.merge(outs[:2], lses[:2])
    np.testing.assert_array_equal(np.isnan(acc_out.get()), np.isnan(ref2_out))
    np.testing.assert_array_equal(np.isnan(acc_lse.get()), np.isnan(ref2_lse))


def test_merge_in_place_accumulates_chunks():
    """merge_ over KV chunks equals attention over all keys (the accumulating-loop use)."""
    import cupy

    rng = np.random.default_rng()
    q = rng.standard_normal((2, 9, 3, 16))
    k, v = rng.standard_normal((2, 40, 3, 16)), rng.standard_normal((2, 40, 3, 16))
    chunks = [(0, 7), (7, 25), (25, 40)]
    parts = [reference.attention(q, k[:, a:b], v[:, a:b], return_lse=True) for a, b in chunks]
    acc_out = cupy.asarray(parts[0][0].astype(np.float32))
    acc_lse = cupy.asarray(parts[0][1].astype(np.float32))
    ptr = acc_out.data.ptr
    for o, l in parts[1:]:
        r = cuattn.merge_(acc_out, acc_lse, cupy.asarray(o.astype(np.float32)), cupy.asarray(l.astype(np.float32)))
        assert r[0] is acc_out
    assert acc_out.data.ptr == ptr
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    np.testing.assert_allclose(acc_out.get(), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(acc_lse.get(), ref_lse, rtol=1e-6, atol=1e-6)


def test_empty_inputs_give_empty_outputs():
    import cupy

    out, lse = cuattn.merge(cupy.ones((2, 1, 0, 3, 8), np.float16), cupy.ones((2, 1, 3, 0), np.float32))
    assert out.shape == (1, 0, 3, 8) and lse.shape == (1, 3, 0)


def test_merge_in_place_refuses_views_that_overlap():
    """merge_ writes out and lse while other warps read rows of out_b: a view of out_b shifted
    onto out (or lse onto lse_b) is a ValueError before any launch, also after a good call of
    the same shapes was cached, and out is left as it was."""
    import cupy

    rng = np.random.default_rng(3)
    rows = cupy.asarray(randn(rng, (1, 65, 1, 64), "float16"))
    lses = cupy.asarray(rng.standard_normal((1, 1, 65)).astype(np.float32))
    out, lse = rows[:, 1:], lses[..., 1:]
    out_b, lse_b = rows[:, :-1], lses[..., :-1]
    before = rows.get()
    for _ in range(2):
        cuattn.merge_(out.copy(), lse.copy(), out_b.copy(), lse_b.copy())  # the same shapes and strides, apart
        with pytest.raises(ValueError, match="out overlaps out_b"):
            cuattn.merge_(out, lse.copy(), out_b, lse_b.copy())
        with pytest.raises(ValueError, match="lse overlaps lse_b"):
            cuattn.merge_(out.copy(), lse, out_b.copy(), lse_b)
    np.testing.assert_array_equal(rows.get(), before)
