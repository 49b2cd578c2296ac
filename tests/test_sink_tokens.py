"""The StreamingLLM mask (``sink_tokens``: the first n keys stay visible beside a sliding
window): the key ranges the kernels visit against the reference mask, the argument checks
(no GPU needed); forward, backward and the adapters against float64 (GPU)."""

import numpy as np
import pytest

import cuattn
from cuattn import reference
from cuattn.options import OP_SCHEMA, AttnOptions
from helpers import (
    KERNEL_PATHS, assert_attention_accuracy, kernel_path, max_err, naive_attention, naive_attention_backward, poison_cupy_pool, randn,
    torch_attention_grads,
)

gpu = pytest.mark.gpu

MASKS = [
    {"causal": True, "window": (100, 0)},
    {"window": (64, 64)},
    {"causal": True, "window": (8, -1), "align": "top_left"},
    {"window": (3, 0)},
    {"causal": True, "window": (10, None)},
]


@pytest.mark.parametrize("kw", MASKS)
@pytest.mark.parametrize("sq, sk", [(1, 1), (1, 300), (113, 1023), (1023, 113), (64, 64), (300, 5)])
@pytest.mark.parametrize("n", [0, 1, 4, 64, 5000])
def test_key_pieces_are_disjoint_and_show_the_mask(kw, sq, sk, n):
    """Each piece's kernel mask (its own keys from 0) shows exactly the reference mask's keys
    in its range, and the ranges tile the keys."""
    options = AttnOptions.from_user(head_dim=64, sink_tokens=n, **kw)
    left, right = reference.window_bounds(kw.get("causal", False), kw.get("window"))
    full = reference.visible(np.arange(sq), np.arange(sk), reference.diagonal_offset(sq, sk, kw.get("align", "bottom_right")), left, right, n)
    pieces = options.key_pieces(sq, sk)
    assert pieces[0].start == 0 and pieces[-1].stop == sk
    assert all(a.stop == b.start for a, b in zip(pieces, pieces[1:]))
    assert len(pieces) == (2 if 0 < n < sk else 1)
    for piece in pieces:
        f = piece.fields
        local = reference.visible(np.arange(sq), np.arange(piece.stop - piece.start), f["diagonal_offset"], f["window_left"], f["window_right"])
        np.testing.assert_array_equal(local, full[:, piece.start:piece.stop])


def test_sink_tokens_without_a_left_bound_change_nothing():
    for kw in ({}, {"causal": True}, {"window": (None, 5)}):
        plain = AttnOptions.from_user(head_dim=64, **kw)
        with_sinks = AttnOptions.from_user(head_dim=64, sink_tokens=4, **kw)
        assert [p.fields for p in with_sinks.key_pieces(100, 200)] == [plain.kernel_fields(100, 200)]


def test_reference_sink_tokens_widen_only_the_left_bound():
    rows, cols = np.arange(50), np.arange(60)
    ok = reference.visible(rows, cols, 10, 5, 0, sink_tokens=3)
    plain = reference.visible(rows, cols, 10, 5, 0)
    unbounded_left = reference.visible(rows, cols, 10, -1, 0)
    np.testing.assert_array_equal(ok[:, 3:], plain[:, 3:])
    np.testing.assert_array_equal(ok[:, :3], unbounded_left[:, :3])


def test_options_carry_sink_tokens_through_the_op_table():
    assert ("sink_tokens", "int") in OP_SCHEMA
    options = AttnOptions.from_user(causal=True, window=(16, 0), head_dim=64, sink_tokens=4)
    assert AttnOptions(**options.flat()) == options
    assert options.user_keywords()["sink_tokens"] == 4
    assert "sink_tokens" not in AttnOptions.from_user(head_dim=64).user_keywords()  # the ops without the keyword never see it


@pytest.mark.parametrize("value, exc", [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("4", TypeError), (None, TypeError)])
def test_bad_sink_tokens_are_refused_before_any_launch(value, exc):
    q, k = np.ones((1, 3, 4, 64), np.float16), np.ones((1, 5, 2, 64), np.float16)
    with pytest.raises(exc, match="sink_tokens"):
        cuattn.attention(q, k, k, window=(2, 0), sink_tokens=value)
    with pytest.raises(exc, match="sink_tokens"):
        cuattn.attention_backward(q, q, k, k, q, np.zeros((1, 4, 3), np.float32), window=(2, 0), sink_tokens=value)


CASES = [
    # dtype, sq, sk, hq, hk, d, n, kw, with a sink logit
    ("bfloat16", 1023, 1023, 8, 2, 128, 4, {"causal": True, "window": (100, 0)}, False),
    ("float16", 113, 1023, 4, 4, 64, 1, {"window": (64, 64)}, False),
    ("float32", 37, 70, 4, 2, 64, 16, {"causal": True, "window": (8, -1), "align": "top_left"}, False),
    ("bfloat16", 1, 1023, 8, 1, 128, 4, {"causal": True, "window": (32, 0)}, False),
    ("float16", 1023, 113, 4, 2, 256, 2, {"causal": True, "window": (10, 0)}, False),  # bottom-right: 910 rows see no key
    ("bfloat16", 200, 500, 8, 2, 96, 8, {"causal": True, "window": (50, 0)}, True),
    ("bfloat16", 64, 300, 2, 2, 64, 5000, {"window": (20, 0)}, False),  # every key a sink token: one piece, no left bound
]


def _compared_part(sq, sk, hq, hk, d, with_sink):
    """(batch entries, query heads, KV heads) compared with float64: all of them, but where the
    scores cost over 2^29 multiply-adds per batch entry (sq * sk * hq * d), the last batch entry
    and the last KV head with its query heads: a problem of its own (all of its outputs are
    compared) at nonzero offsets. A sink logit's gradient sums over all: its cases compare all."""
    if with_sink or sq * sk * hq * d <= 1 << 29:
        return slice(None), slice(None), slice(None)
    return slice(-1, None), slice(hq - hq // hk, hq), slice(hk - 1, hk)


@gpu
@pytest.mark.parametrize("dtype, sq, sk, hq, hk, d, n, kw, with_sink", CASES)
def test_forward_and_backward_match_the_reference(dtype, sq, sk, hq, hk, d, n, kw, with_sink):
    """Both kernel paths against one float64 reference; 16-bit backward through query splits.
    Every output is checked for NaN, the part that :func:`_compared_part` picks against float64."""
    import cupy

    rng = np.random.default_rng(sq * 13 + sk + n)
    q, k, v = randn(rng, (2, sq, hq, d), dtype), randn(rng, (2, sk, hk, d), dtype), randn(rng, (2, sk, hk, d), dtype)
    dout = randn(rng, (2, sq, hq, d), dtype)
    dlse = rng.standard_normal((2, hq, sq)).astype(np.float32)
    sink = (rng.standard_normal(hq) * 2.0).astype(np.float32) if with_sink else None
    kw = {**kw, "sink_tokens": n}
    batch, heads, kv_heads = _compared_part(sq, sk, hq, hk, d, with_sink)
    by_q, by_kv = (lambda x: x[batch][:, :, heads]), (lambda x: x[batch][:, :, kv_heads])  # of (batch, seqlen, heads, d)
    parts = (by_q, by_kv, by_kv, lambda g: g[heads])  # of dq, dk, dv, dsink
    args, dlse_part = (by_q(q), by_kv(k), by_kv(v)), dlse[batch][:, heads]
    part_kw = {**kw, "sink": None if sink is None else sink[heads]}
    ref_out, ref_lse = reference.attention(*args, return_lse=True, **part_kw)
    naive_out = naive_attention(*args, dtype, **part_kw)
    ref = reference.attention_backward(by_q(dout), *args, ref_out, ref_lse, dlse=dlse_part, **part_kw)
    naive = naive_attention_backward(by_q(dout), *args, dtype, dlse=dlse_part, **part_kw)
    for path in KERNEL_PATHS:
        with kernel_path(path):
            poison_cupy_pool()
            dev = [cupy.asarray(x) for x in (q, k, v, dout, dlse)]
            dkw = {**kw, "sink": None if sink is None else cupy.asarray(sink)}
            out, lse = cuattn.attention(*dev[:3], return_lse=True, **dkw)
            out_host, lse_host = out.get(), lse.get()
            assert not np.isnan(out_host.astype(np.float32)).any() and not np.isnan(lse_host).any()
            assert_attention_accuracy(by_q(out_host), ref_out, naive_out)
            np.testing.assert_allclose(lse_host[batch][:, heads], ref_lse, rtol=1e-5, atol=1e-5)
            np.testing.assert_array_equal(cuattn.attention(*dev[:3], **dkw).get(), out_host)  # without return_lse, the same result
            for deterministic in (False, True):
                poison_cupy_pool()
                grads = cuattn.attention_backward(dev[3], *dev[:3], out, lse, dlse=dev[4], deterministic=deterministic, **dkw)
                assert len(grads) == len(ref)
                for name, g, x, part, r, nv in zip(("dq", "dk", "dv", "dsink"), grads, (q, k, v, sink), parts, ref, naive):
                    g = g.get()
                    assert g.shape == x.shape and not np.isnan(g.astype(np.float32)).any(), f"{path} {name}"
                    bound = 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))
                    assert max_err(part(g), r) <= bound, f"{path} {name}: {max_err(part(g), r):.3e} > {bound:.3e}"


@gpu
def test_sink_tokens_without_a_left_bound_give_the_plain_result_bit_for_bit():
    import cupy

    rng = np.random.default_rng(2)
    q, k, v = (cupy.asarray(randn(rng, (2, 300, 4, 64), "bfloat16")) for _ in range(3))
    for kw in ({"causal": True}, {"window": (None, 7)}):
        plain, plain_lse = cuattn.attention(q, k, v, return_lse=True, **kw)
        out, lse = cuattn.attention(q, k, v, return_lse=True, sink_tokens=4, **kw)
        assert cupy.array_equal(out, plain) and cupy.array_equal(lse, plain_lse)


@gpu
def test_deterministic_gradients_are_bit_identical_across_runs():
    import cupy

    rng = np.random.default_rng(4)
    q, dout = (cupy.asarray(randn(rng, (2, 700, 8, 128), "bfloat16")) for _ in range(2))
    k, v = (cupy.asarray(randn(rng, (2, 700, 2, 128), "bfloat16")) for _ in range(2))
    kw = {"causal": True, "window": (64, 0), "sink_tokens": 4}
    out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
    runs = [[g.get() for g in cuattn.attention_backward(dout, q, k, v, out, lse, deterministic=True, **kw)] for _ in range(3)]
    for run in runs[1:]:
        assert all(np.array_equal(a.view(np.uint16), b.view(np.uint16)) for a, b in zip(runs[0], run))


@gpu
def test_torch_eager_and_compiled_gradients_match_the_reference():
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    rng = np.random.default_rng(6)
    q, k, v = randn(rng, (2, 300, 8, 64), "bfloat16"), randn(rng, (2, 300, 2, 64), "bfloat16"), randn(rng, (2, 300, 2, 64), "bfloat16")
    w = randn(rng, (2, 300, 8, 64), "bfloat16").astype(np.float32)  # the cotangent reaches the kernels rounded to bf16
    kw = {"causal": True, "window": (40, 0), "sink_tokens": 4}
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    ref = reference.attention_backward(w, q, k, v, ref_out, ref_lse, **kw)
    naive_out = naive_attention(q, k, v, "bfloat16", **kw)
    naive = naive_attention_backward(w, q, k, v, "bfloat16", **kw)

    for fn in (lambda q, k, v: ct.attention(q, k, v, **kw), torch.compile(lambda q, k, v: ct.attention(q, k, v, **kw), fullgraph=True)):
        out, grads = torch_attention_grads(fn, q, k, v, w)
        assert_attention_accuracy(out, ref_out, naive_out)
        for g, r, nv in zip(grads, ref, naive):
            assert max_err(g, r) <= 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the sink range's dK / dV in query splits
def test_jax_gradients_match_the_reference(dtype):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuattn.jax as cj

    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 150, 4, 64), dtype), randn(rng, (2, 160, 2, 64), dtype), randn(rng, (2, 160, 2, 64), dtype)
    w = randn(rng, (2, 150, 4, 64), dtype).astype(np.float32)  # the cotangent reaches the kernels rounded to dtype
    kw = {"causal": True, "window": (16, 0), "sink_tokens": 3}

    def loss(q, k, v):
        return (cj.attention(q, k, v, **kw).astype(jnp.float32) * w).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*map(jnp.asarray, (q, k, v)))
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    ref = reference.attention_backward(w, q, k, v, ref_out, ref_lse, **kw)
    naive = naive_attention_backward(w, q, k, v, dtype, **kw)
    for g, r, nv in zip(grads, ref, naive):
        g = np.asarray(g).astype(np.float64)
        if dtype == "float32":
            np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-4)
        else:
            assert max_err(g, r) <= 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))

def test_query_splits_fill_the_gpu_only_where_key_blocks_are_few():
    from cuattn.kernels.backward import MAX_QUERY_SPLITS, BackwardGrid, query_splits

    def splits(c_type, batch, sq, sk, hq, hk, d, layout="dense"):
        return query_splits(c_type, BackwardGrid(layout, batch, sq, sk, hq, hk, d, batch * sq, batch * sk), 132)

    sink_range = splits("bf16", 1, 16384, 4, 32, 8, 64)
    assert sink_range > 1 and sink_range & (sink_range - 1) == 0 and sink_range <= MAX_QUERY_SPLITS
    assert 8 * sink_range <= 2 * 132 * 2  # about two CTAs per SM
    assert splits("bf16", 1, 16384, 16384, 16, 16, 128) == 1  # the window range fills the GPU by itself
    assert splits("float", 1, 16384, 4, 32, 8, 64) == 1  # the fp32 kernels have no splits
    assert splits("bf16", 1, 16384, 4, 32, 8, 64, layout="packed") == 1
    assert splits("bf16", 2, 1, 4, 8, 8, 64) == 1  # too few query steps to share


def test_huge_sink_tokens_mean_every_key_and_fit_the_ops():
    options = AttnOptions.from_user(window=(8, 0), head_dim=64, sink_tokens=2**70)
    assert options.sink_tokens < 2**63  # the torch ops' int
    assert [(p.start, p.stop, p.fields["window_left"]) for p in options.key_pieces(10, 50)] == [(0, 50, -1)]


def test_query_split_sums_take_powers_of_two_only():
    from cuattn.backward import _sum_splits

    for splits in (1, 3, 6):
        with pytest.raises(ValueError, match="power of two"):
            _sum_splits(None, None, 0, splits, 1, None)
