"""cuattn.attention_varlen_backward: gradients of packed sequences against the float64 reference
and against the dense backward on each sequence alone (GPU), and its argument checks (no GPU)."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cuattn
from cuattn import reference
from helpers import (
    DTYPES, VARLEN_HEADS, assert_attention_accuracy, group_edge_heads, kernel_path, naive_attention_backward, poison_cupy_pool,
    ragged_lengths, randn, result_ulp,
)

gpu = pytest.mark.gpu
# As tests/test_backward.py: the Hopper default (one pass, dQ by atomics), deterministic=True,
# and the portable kernels.
BACKWARD_PATHS = ("default", "deterministic", "portable")


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _check_gradient(name, g, r, n, dtype, saved_out_err=0.0):
    """tests/test_backward.py's bound, plus ``saved_out_err``: what the exact gradient moves when
    it is computed from the forward's output as saved (rounded to ``dtype``), since delta =
    rowsum(dout * out) reads that output, as in every FlashAttention backward. It matters where
    the gradient is tiny next to |dout| |out| (found: one query, two keys, softcap, d128: dq off
    by 4.5e-3 where the rounding of out alone moves it 2.7e-3 and naive 3e-4)."""
    floor = 1e-5 * max(float(np.abs(r).max(initial=0.0)), 1e-30) if dtype == "float32" else 1e-4 + result_ulp(r, dtype)
    floor += saved_out_err
    try:
        assert_attention_accuracy(g, r, n, factor=3.0, floor=floor)
    except AssertionError as exc:
        raise AssertionError(f"{name}: {exc}") from None


def _run(rng, lengths_q, lengths_k, hq, hk, d, dtype, path="default", give_max=True, with_dlse=False, against_reference=True, **kw):
    """Packed forward and backward on CuPy arrays (device offsets). Each sequence's gradients
    within 3x the naive error of the float64 reference (tests/test_backward.py's bound; skipped
    with ``against_reference=False``), and equal to the dense backward of that sequence alone:
    bit for bit on the deterministic kernels, to a few ulps on the one-pass kernel (whose dQ
    atomics, and dK / dV ones where it splits key blocks, add in a varying order)."""
    import cupy

    cu_q, cu_k = _offsets(lengths_q), _offsets(lengths_k)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q, dout = (randn(rng, (total_q, hq, d), dtype) for _ in range(2))
    k, v = (randn(rng, (total_k, hk, d), dtype) for _ in range(2))
    dlse = rng.standard_normal((hq, total_q)).astype(np.float32) if with_dlse else None
    maxes = dict(max_seqlen_q=max(lengths_q), max_seqlen_k=max(lengths_k)) if give_max else {}
    deterministic = path == "deterministic"
    dev = {n: cupy.asarray(x) for n, x in dict(q=q, k=k, v=v, dout=dout, cu_q=cu_q, cu_k=cu_k).items()}
    with kernel_path(path):
        out, lse = cuattn.attention_varlen(dev["q"], dev["k"], dev["v"], dev["cu_q"], dev["cu_k"], return_lse=True, **maxes, **kw)
        poison_cupy_pool()
        grads = cuattn.attention_varlen_backward(
            dev["dout"], dev["q"], dev["k"], dev["v"], out, lse, dev["cu_q"], dev["cu_k"],
            dlse=None if dlse is None else cupy.asarray(dlse), deterministic=deterministic, **maxes, **kw,
        )
        grads = [g.get() for g in grads]
        out_h, lse_h = out.get(), lse.get()
        for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            assert g.dtype == x.dtype and g.shape == x.shape, name
            assert not np.isnan(g.astype(np.float32)).any(), f"NaN in {name}"
        for b in range(len(lengths_q)):
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            seq = [x[None, s] for x, s in ((dout, rows), (q, rows), (k, keys), (v, keys))]
            dlse_b = None if dlse is None else dlse[None, :, rows]
            got = (grads[0][rows], grads[1][keys], grads[2][keys])
            if rows.start == rows.stop or keys.start == keys.stop:  # nothing attended: zero gradients
                for name, g in zip(("dq", "dk", "dv"), got):
                    assert not g.astype(np.float32).any(), name
                continue
            if against_reference:
                ref_out, ref_lse = reference.attention(*seq[1:], return_lse=True, **kw)
                ref = reference.attention_backward(*seq, ref_out, ref_lse, dlse=dlse_b, **kw)
                naive = naive_attention_backward(*seq, dtype, dlse=dlse_b, **kw)
                saved_out = ref_out.astype(DTYPES[dtype]).astype(np.float64)
                from_saved = reference.attention_backward(*seq, saved_out, ref_lse, dlse=dlse_b, **kw)
                for name, g, r, n, x in zip(("dq", "dk", "dv"), got, ref, naive, from_saved):
                    _check_gradient(name, g[None], r, n, dtype, 2 * float(np.abs(x - r).max(initial=0.0)))
            dense = cuattn.attention_backward(
                *(cupy.asarray(x) for x in seq), cupy.asarray(out_h[None, rows]), cupy.asarray(lse_h[None, :, rows]),
                dlse=None if dlse_b is None else cupy.asarray(dlse_b), deterministic=deterministic, **kw,
            )
            # The dense call's one-pass kernel adds dQ by atomics, and dK / dV too where it splits
            # its key blocks over CTAs (kernels/backward.py tma_query_splits): a varying order.
            split = _dense_splits(seq[1].shape[1], seq[2].shape[1], hq, hk, d) > 1
            for name, g, x in zip(("dq", "dk", "dv"), got, dense):
                x = x.get()[0]
                if path == "default" and (name == "dq" or split):
                    g, x = g.astype(np.float64), x.astype(np.float64)
                    np.testing.assert_allclose(g, x, rtol=0, atol=4 * result_ulp(x, dtype) + 1e-6, err_msg=name)
                else:
                    np.testing.assert_array_equal(g, x, err_msg=name)
    return grads


@gpu
@settings(max_examples=30, deadline=None)
@given(
    lengths=ragged_lengths([0, 1, 2, 17, 64, 113, 128, 200], max_size=3),
    heads=st.sampled_from(VARLEN_HEADS),
    d=st.sampled_from([8, 32, 40, 64, 96, 128, 160, 192, 224, 256]),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    causal=st.booleans(),
    window=st.sampled_from([None, None, (16, 0), (40, 8), (None, 5), (0, 0)]),
    align=st.sampled_from(["bottom_right", "top_left"]),
    softcap=st.sampled_from([None, None, 5.0]),
    with_dlse=st.booleans(),
    path=st.sampled_from(BACKWARD_PATHS),
    give_max=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
@example(lengths=([17, 1], [2, 2]), heads=(1, 1), d=128, dtype="bfloat16", causal=False, window=None, align="bottom_right",
         softcap=5.0, with_dlse=False, path="default", give_max=False, seed=43)  # _check_gradient's saved-output term
def test_varlen_backward_matches_reference_and_dense(lengths, heads, d, dtype, causal, window, align, softcap, with_dlse, path,
                                                     give_max, seed):
    lengths_q, lengths_k = lengths
    _run(np.random.default_rng(seed), lengths_q, lengths_k, *heads, d, dtype, path=path, give_max=give_max,
         with_dlse=with_dlse, causal=causal, window=window, align=align, softcap=softcap)


@gpu
@pytest.mark.parametrize("heads, path", [((8, 1), "default"), ((2, 2), "default"), ((8, 1), "deterministic"), ((2, 2), "portable")])
def test_varlen_backward_long_ragged_batch(heads, path):
    """Lengths 0, 1, 2 .. 2000 mixed, GQA 8:1 and 1:1, both causal alignments: every sequence's
    gradients equal the dense backward's on it alone (which tests/test_backward.py holds to the
    float64 reference)."""
    rng = np.random.default_rng()
    for align in ("bottom_right", "top_left"):
        _run(rng, LONG_Q, LONG_K, *heads, 64, "bfloat16", path=path, against_reference=False, causal=True, align=align)


LONG_Q, LONG_K = [2000, 0, 1, 2, 700, 1023, 5], [2000, 3, 0, 2, 1500, 1023, 64]


def _dense_splits(seqlen_q: int, seqlen_k: int, heads_q: int, heads_kv: int, head_dim: int) -> int:
    """The TMA backward's CTAs per key block for one sequence alone (1 off Hopper)."""
    import cupy

    from cuattn import loader
    from cuattn.kernels import backward as backward_kernels

    if loader.device_arch() != "sm_90a":
        return 1
    grid = backward_kernels.BackwardGrid("dense", 1, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, seqlen_q, seqlen_k)
    return backward_kernels.tma_query_splits(grid, cupy.cuda.Device().attributes["MultiProcessorCount"])


def _reference_backward(dout, q, k, v, **kw):
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    return reference.attention_backward(dout, q, k, v, ref_out, ref_lse, **kw)


def _queries(seq, start, stop):
    """Queries [start, stop) of a sequence ``(dout, q, k, v)`` (no more queries than keys) under
    a bottom-right causal mask, with the keys they see: a problem of its own (its last query
    still on its last key), whose dQ is the sequence's on those queries. For the last queries its
    dK / dV are also the sequence's, on as many last keys (no earlier query sees them)."""
    dout, q, k, v = seq
    assert q.shape[1] <= k.shape[1]
    stop = min(stop, q.shape[1])
    seen = stop + k.shape[1] - q.shape[1]
    return dout[:, start:stop], q[:, start:stop], k[:, :seen], v[:, :seen]


def _assert_as_close_as_dense(name, g, r, dense):
    """``g`` within 1.5x the dense kernel's error against the float64 ``r``, plus one ulp."""
    err = float(np.abs(g.astype(np.float64) - r).max())
    dense_err = float(np.abs(dense.astype(np.float64) - r).max())
    assert err <= 1.5 * dense_err + result_ulp(r, "bfloat16"), f"{name}: {err:.3e} vs dense {dense_err:.3e}"


@gpu
def test_varlen_backward_long_ragged_batch_against_reference():
    """The long ragged batch (GQA 8:1, causal) against the float64 reference: each gradient within
    1.5x the dense kernel's own error on the sequence plus one ulp. Compared (the rest is checked
    for NaN, and against the dense backward above): dQ of every query on the GQA group's first
    and last heads, and dQ, dK and dV of the last 128 queries and keys on every head."""
    import cupy

    rng = np.random.default_rng(5)
    cu_q, cu_k = _offsets(LONG_Q), _offsets(LONG_K)
    q, dout = (randn(rng, (int(cu_q[-1]), 8, 64), "bfloat16") for _ in range(2))
    k, v = (randn(rng, (int(cu_k[-1]), 1, 64), "bfloat16") for _ in range(2))
    dev = [cupy.asarray(x) for x in (dout, q, k, v)]
    out, lse = cuattn.attention_varlen(*dev[1:], cupy.asarray(cu_q), cupy.asarray(cu_k), causal=True, return_lse=True)
    poison_cupy_pool()
    grads = [g.get() for g in cuattn.attention_varlen_backward(*dev, out, lse, cupy.asarray(cu_q), cupy.asarray(cu_k), causal=True)]
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert not np.isnan(g.astype(np.float32)).any(), f"NaN in {name}"
    out_h, lse_h = out.get(), lse.get()
    heads, tail = group_edge_heads(8, 1), 128
    for b in (0, 4, 5):  # the long sequences
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        seq = [x[None, s] for x, s in ((dout, rows), (q, rows), (k, keys), (v, keys))]
        dense = [x.get()[0] for x in cuattn.attention_backward(*(cupy.asarray(x) for x in seq), cupy.asarray(out_h[None, rows]),
                                                               cupy.asarray(lse_h[None, :, rows]), causal=True)]
        got, sq = (grads[0][rows], grads[1][keys], grads[2][keys]), rows.stop - rows.start
        edge = (seq[0][:, :, heads], seq[1][:, :, heads], *seq[2:])
        edge_dq = np.concatenate([_reference_backward(*_queries(edge, start, start + 256), causal=True)[0][0]
                                  for start in range(0, sq, 256)])  # by blocks of queries: the keys each sees, not all
        _assert_as_close_as_dense(f"sequence {b} dq, heads {heads}", got[0][:, heads], edge_dq, dense[0][:, heads])
        last = _reference_backward(*_queries(seq, sq - tail, sq), causal=True)
        for name, g, r, x in zip(("dq", "dk", "dv"), got, last, dense):
            _assert_as_close_as_dense(f"sequence {b} {name}, last {tail}", g[-tail:], r[0][-tail:], x[-tail:])


def _too_small_bound(path, **bounds):
    """Sequence 0 has 300 queries and keys, sequence 1 has 20; the bound given is 100."""
    import cupy

    rng = np.random.default_rng(0)
    cu = _offsets([300, 20])
    q, k, v, dout = (randn(rng, (320, 2, 64), "bfloat16") for _ in range(4))
    args = [cupy.asarray(x) for x in (q, k, v)]
    with kernel_path(path):
        out, lse = cuattn.attention_varlen(*args, cupy.asarray(cu), cupy.asarray(cu), return_lse=True, causal=True)
        grads = cuattn.attention_varlen_backward(
            cupy.asarray(dout), *args, out, lse, cupy.asarray(cu), cupy.asarray(cu), causal=True,
            deterministic=path == "deterministic", **bounds,
        )
    name = "q" if "max_seqlen_q" in bounds else "k"
    with pytest.raises(ValueError, match=f"cu_seqlens_{name} has sequence 0 longer than max_seqlen_{name}"):
        cuattn.check_varlen_offsets()
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    ref = reference.attention_varlen_backward(dout, q, k, v, ref_out, ref_lse, cu, cu, causal=True)
    return [g.get().astype(np.float64) for g in grads], ref


@gpu
@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_varlen_backward_too_small_max_seqlen_k_marks_nan(path):
    """Keys past max_seqlen_k's grid get NaN dK / dV; on the one-pass kernel, whose dQ then
    misses their terms, the sequence's dQ rows are NaN too. Everything else is exact."""
    (dq, dk, dv), (rq, rk, rv) = _too_small_bound(path, max_seqlen_k=100)
    for g, r in ((dk, rk), (dv, rv)):
        assert np.isnan(g[299]).all() and not np.isnan(g[:100]).any() and not np.isnan(g[300:]).any()
        np.testing.assert_allclose(g[:100], r[:100], atol=3e-2)
        np.testing.assert_allclose(g[300:], r[300:], atol=3e-2)
    from cuattn import loader

    fused = path == "default" and loader.device_arch() == "sm_90a"
    assert np.isnan(dq[:300]).all() == fused
    np.testing.assert_allclose(dq[300:], rq[300:], atol=3e-2)
    if not fused:
        np.testing.assert_allclose(dq, rq, atol=3e-2)


@gpu
@pytest.mark.parametrize("path", ["deterministic", "portable"])
def test_varlen_backward_too_small_max_seqlen_q_marks_nan(path):
    """Query rows past max_seqlen_q's dQ grid get NaN dQ; dK and dV (which loop over every
    query) are exact."""
    (dq, dk, dv), (rq, rk, rv) = _too_small_bound(path, max_seqlen_q=100)
    assert np.isnan(dq[299]).all() and not np.isnan(dq[:100]).any()
    np.testing.assert_allclose(dq[:100], rq[:100], atol=3e-2)
    np.testing.assert_allclose(dq[300:], rq[300:], atol=3e-2)
    np.testing.assert_allclose(dk, rk, atol=3e-2)
    np.testing.assert_allclose(dv, rv, atol=3e-2)


@gpu
def test_varlen_backward_many_short_sequences_torch():
    """70000 sequences (past gridDim.z) as torch tensors: more sequences than 64-row blocks,
    which takes the deterministic kernels (the one-pass kernel's accumulator would be padding).
    A sample of 300 sequences, the last ones included, against the float64 reference."""
    import torch

    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 3, 70000)
    cu_h = _offsets(lengths)
    q, k, v, dout = (torch.randn(int(cu_h[-1]), 2, 32, device="cuda", dtype=torch.float16) for _ in range(4))
    cu = torch.from_numpy(cu_h).cuda()
    out, lse = cuattn.attention_varlen(q, k, v, cu, cu, max_seqlen_q=2, return_lse=True)
    grads = cuattn.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, max_seqlen_q=2, max_seqlen_k=2)
    assert all(isinstance(g, torch.Tensor) for g in grads)
    host = [x.float().cpu().numpy() for x in (dout, q, k, v)]
    grads = [g.float().cpu().numpy() for g in grads]
    for b in [*rng.choice(70000, 290, replace=False), *range(69990, 70000)]:
        rows = slice(cu_h[b], cu_h[b + 1])
        if rows.start == rows.stop:
            continue
        seq = [x[None, rows] for x in host]
        ref_out, ref_lse = reference.attention(*seq[1:], return_lse=True)
        for name, g, r in zip(("dq", "dk", "dv"), grads, reference.attention_backward(*seq, ref_out, ref_lse)):
            np.testing.assert_allclose(g[rows], r[0], atol=1e-2, err_msg=f"sequence {b} {name}")


@gpu
def test_varlen_backward_host_arrays():
    """NumPy in (offsets checked on the host, bounds derived from them), NumPy out."""
    rng = np.random.default_rng(4)
    cu_q, cu_k = _offsets([5, 40, 0, 77]), _offsets([9, 40, 3, 50])
    q, dout = (randn(rng, (122, 4, 64), "float16") for _ in range(2))
    k, v = (randn(rng, (102, 2, 64), "float16") for _ in range(2))
    out, lse = cuattn.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    grads = cuattn.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    for g, r in zip(grads, reference.attention_varlen_backward(dout, q, k, v, ref_out, ref_lse, cu_q, cu_k, causal=True)):
        assert isinstance(g, np.ndarray)
        np.testing.assert_allclose(g.astype(np.float64), r, atol=2e-2)


# --- argument checks (no GPU: NumPy inputs are uploaded only after validation) ---------------


def _host_args(dtype=np.float16):
    cu_q, cu_k = _offsets([3, 0, 4]), _offsets([5, 1, 0])
    q = np.ones((7, 2, 8), dtype)
    k = np.ones((6, 1, 8), dtype)
    return dict(dout=q.copy(), q=q, k=k, v=k.copy(), out=q.copy(), lse=np.zeros((2, 7), np.float32),
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "dout": a["dout"][:, :1]}, ValueError, r"dout has shape"),
    (lambda a: {**a, "dout": a["dout"].astype(np.float32)}, TypeError, r"dout has dtype float32"),
    (lambda a: {**a, "out": a["out"][None]}, ValueError, r"out must have 3 dimensions"),
    (lambda a: {**a, "lse": a["lse"][None]}, ValueError, r"lse must have 2 dimensions"),
    (lambda a: {**a, "lse": a["lse"].T.copy()}, ValueError, r"lse has shape \(7, 2\)"),
    (lambda a: {**a, "lse": a["lse"].astype(np.float16)}, TypeError, r"lse must be float32"),
    (lambda a: {**a, "dlse": np.zeros((2, 6), np.float32)}, ValueError, r"dlse has shape"),
    (lambda a: {**a, "lse": None}, TypeError, r"lse is required"),
    (lambda a: {**a, "cu_seqlens_k": np.array([0, 5, 4, 6], np.int32)}, ValueError, r"cu_seqlens_k must be non-decreasing"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].astype(np.int64)}, ValueError, r"cu_seqlens_q must be int32"),
    (lambda a: {**a, "max_seqlen_k": -2}, ValueError, r"max_seqlen_k must be in \[0, 2\*\*31 - 256\]"),
    (lambda a: {**a, "deterministic": 1}, TypeError, r"deterministic must be a bool"),
    (lambda a: {**a, "window": (1, 2, 3)}, ValueError, r"window must be"),
])
def test_varlen_backward_rejects_bad_arguments(change, error, match):
    args = change(_host_args())
    with pytest.raises(error, match=match):
        cuattn.attention_varlen_backward(**args)


def test_varlen_backward_reference_is_backward_per_sequence():
    rng = np.random.default_rng(3)
    cu_q, cu_k = _offsets([4, 0, 6]), _offsets([2, 5, 3])
    q, dout = (rng.standard_normal((10, 4, 8)) for _ in range(2))
    k, v = (rng.standard_normal((10, 2, 8)) for _ in range(2))
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    dq, dk, dv = reference.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True)
    o, l = reference.attention(q[None, 4:], k[None, 7:], v[None, 7:], causal=True, return_lse=True)
    g = reference.attention_backward(dout[None, 4:], q[None, 4:], k[None, 7:], v[None, 7:], o, l, causal=True)
    np.testing.assert_array_equal(dq[4:], g[0][0])
    np.testing.assert_array_equal(dk[7:], g[1][0])
    assert not dk[2:7].any() and not dv[2:7].any()  # sequence 1 has keys but no queries
