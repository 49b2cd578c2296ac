"""cuattn.attention_varlen: packed sequences against the float64 reference and against the dense
kernel on each sequence alone (GPU), and its argument checks (no GPU needed)."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuattn
from cuattn import reference
from helpers import (
    KERNEL_PATHS, VARLEN_HEADS, assert_attention_accuracy, group_edge_heads, kernel_path, naive_attention, poison_cupy_pool,
    ragged_lengths, randn,
)

gpu = pytest.mark.gpu


def _offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def _packed_inputs(rng, lengths_q, lengths_k, hq, hk, d, dtype):
    q = randn(rng, (int(sum(lengths_q)), hq, d), dtype)
    k = randn(rng, (int(sum(lengths_k)), hk, d), dtype)
    v = randn(rng, (int(sum(lengths_k)), hk, d), dtype)
    return q, k, v, _offsets(lengths_q), _offsets(lengths_k)


def _run(rng, lengths_q, lengths_k, hq, hk, d, dtype, path="default", give_max=True, **kw):
    """Packed call on CuPy arrays (device offsets) of fresh inputs, checked by :func:`_check`."""
    inputs = _packed_inputs(rng, lengths_q, lengths_k, hq, hk, d, dtype)
    heads = group_edge_heads(hq, hk)
    return _check(inputs, heads, _references(inputs, heads, dtype, **kw), dtype, path, give_max, **kw)


def _references(inputs, heads, dtype, **kw):
    """Per sequence, on query heads ``heads``: the float64 (out, lse) and the naive out (None
    without keys); None for a sequence without rows."""
    q, k, v, cu_q, cu_k = inputs
    refs = []
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.start == rows.stop:
            refs.append(None)
            continue
        qb, kb, vb = q[None, rows][:, :, heads], k[None, keys], v[None, keys]
        ref_out, ref_lse = reference.attention(qb, kb, vb, return_lse=True, **kw)
        refs.append((ref_out, ref_lse, naive_attention(qb, kb, vb, dtype, **kw) if keys.start < keys.stop else None))
    return refs


def _check(inputs, heads, refs, dtype, path, give_max, **kw):
    """Every output element written (no NaN from the poisoned pool); every sequence against
    cuattn.attention on that sequence alone (bit-identical) and, on query heads ``heads`` (each
    KV group's first and last), against the float64 reference ``refs`` (2x naive)."""
    import cupy

    q, k, v, cu_q, cu_k = inputs
    hq = q.shape[1]
    maxes = dict(max_seqlen_q=int(np.diff(cu_q).max()), max_seqlen_k=int(np.diff(cu_k).max())) if give_max else {}
    poison_cupy_pool()
    with kernel_path(path):
        out, lse = cuattn.attention_varlen(
            cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), cupy.asarray(cu_q), cupy.asarray(cu_k), return_lse=True, **maxes, **kw,
        )
        out, lse = out.get(), lse.get()
        assert out.dtype == q.dtype and out.shape == q.shape and lse.shape == (hq, q.shape[0])
        assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
        for b, ref in enumerate(refs):
            if ref is None:
                continue
            rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
            ref_out, ref_lse, naive = ref
            if naive is None:  # no keys: zeros (naive attention has no max to take)
                assert not out[rows].astype(np.float32).any()
            else:
                assert_attention_accuracy(out[None, rows][:, :, heads], ref_out, naive, floor=1e-6 if dtype == "float32" else 1e-5)
            fin = np.isfinite(ref_lse[0])
            np.testing.assert_array_equal(np.isneginf(lse[heads][:, rows]), ~fin)
            np.testing.assert_allclose(lse[heads][:, rows][fin], ref_lse[0][fin], rtol=1e-5, atol=1e-5)
            qb, kb, vb = q[None, rows], k[None, keys], v[None, keys]
            # Bit for bit against the dense call on the kernel packed sequences run (on Hopper the
            # copying one: the dense call's TMA kernel sums in other blocks).
            with kernel_path("copying" if path == "default" else path):
                dense_out, dense_lse = cuattn.attention(cupy.asarray(qb), cupy.asarray(kb), cupy.asarray(vb), return_lse=True, **kw)
            np.testing.assert_array_equal(out[rows], dense_out.get()[0])
            np.testing.assert_array_equal(lse[:, rows], dense_lse.get()[0])
    return out, lse


@gpu
@settings(max_examples=60, deadline=None)
@given(
    lengths=ragged_lengths([0, 1, 2, 17, 64, 113, 128, 300, 1000], max_size=5),
    heads=st.sampled_from(VARLEN_HEADS),
    d=st.sampled_from([8, 32, 40, 64, 96, 128, 160, 192, 224, 256]),
    dtype=st.sampled_from(["float16", "bfloat16", "float32"]),
    causal=st.booleans(),
    window=st.sampled_from([None, None, (16, 0), (40, 8), (None, 5), (0, 0), (2**31 - 1, None)]),
    align=st.sampled_from(["bottom_right", "top_left"]),
    softcap=st.sampled_from([None, None, 5.0]),
    path=st.sampled_from(KERNEL_PATHS),
    give_max=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_varlen_matches_reference_and_dense(lengths, heads, d, dtype, causal, window, align, softcap, path, give_max, seed):
    lengths_q, lengths_k = lengths
    _run(np.random.default_rng(seed), lengths_q, lengths_k, *heads, d, dtype, path=path, give_max=give_max,
         causal=causal, window=window, align=align, softcap=softcap)


LONG_Q, LONG_K = [2000, 0, 1, 2, 700, 1023, 5], [2000, 3, 0, 2, 1500, 1023, 64]


@functools.cache
def _long_ragged_batch(d, align):
    """The long ragged batch (GQA 8:1, causal) and its float64 references: drawn once for both
    kernel paths, the references being most of the test's time."""
    inputs = _packed_inputs(np.random.default_rng(), LONG_Q, LONG_K, 8, 1, d, "bfloat16")
    heads = group_edge_heads(8, 1)
    return inputs, heads, _references(inputs, heads, "bfloat16", causal=True, align=align)


@gpu
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_long_ragged_batch(d, path):
    """Lengths 0, 1, 2 .. 2000 mixed, GQA 8:1, both causal alignments."""
    for align in ("bottom_right", "top_left"):
        inputs, heads, refs = _long_ragged_batch(d, align)
        _check(inputs, heads, refs, "bfloat16", path, give_max=True, causal=True, align=align)


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_varlen_too_small_max_seqlen_marks_rows_nan(dtype):
    """Rows past max_seqlen_q are NaN (out and lse), the rest exact, nothing else written."""
    import cupy

    rng = np.random.default_rng(0)
    q, k, v, cu_q, cu_k = _packed_inputs(rng, [300, 20], [300, 20], 2, 2, 64, dtype)
    out, lse = cuattn.attention_varlen(*map(cupy.asarray, (q, k, v, cu_q, cu_k)), max_seqlen_q=100, return_lse=True, causal=True)
    with pytest.raises(ValueError, match=r"cu_seqlens_q has sequence 0 longer than max_seqlen_q"):
        cuattn.check_varlen_offsets()
    out, lse = out.get().astype(np.float64), lse.get()
    block = 128 if dtype == "bfloat16" else 16  # rows per CTA: the covered rows are whole blocks
    covered = -(-100 // block) * block
    assert np.isnan(out[covered:300]).all() and np.isnan(lse[:, covered:300]).all()
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    good = np.r_[0:covered, 300:320]
    np.testing.assert_allclose(out[good], ref_out[good], atol=2e-2 if dtype == "bfloat16" else 1e-5)


@gpu
def test_varlen_host_arrays_and_offsets_change_between_calls():
    """NumPy in, NumPy out (offsets checked on the host); then CuPy calls of one signature with
    different offsets: the replayed plan reads the new ones."""
    import cupy

    rng = np.random.default_rng(1)
    q, k, v, cu_q, cu_k = _packed_inputs(rng, [5, 40, 0, 77], [9, 40, 3, 50], 4, 2, 64, "float16")
    out = cuattn.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert isinstance(out, np.ndarray)
    ref = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=5e-3)
    dq, dk, dv = map(cupy.asarray, (q, k, v))
    for lengths_q, lengths_k in (([5, 40, 0, 77], [9, 40, 3, 50]), ([100, 2, 20, 0], [1, 1, 100, 0])):
        cq, ck = _offsets(lengths_q), _offsets(lengths_k)
        got = cuattn.attention_varlen(dq, dk, dv, cupy.asarray(cq), cupy.asarray(ck), max_seqlen_q=128, causal=True).get()
        np.testing.assert_allclose(got.astype(np.float64), reference.attention_varlen(q, k, v, cq, ck, causal=True), atol=5e-3)


@gpu
def test_varlen_torch_tensors_and_many_sequences():
    """Torch tensors through the core call; 70000 sequences (past gridDim.z's 65535)."""
    import torch

    lengths = np.random.default_rng(2).integers(0, 3, 70000)
    total = int(lengths.sum())
    q, k, v = (torch.randn(total, 1, 8, device="cuda", dtype=torch.float16) for _ in range(3))
    cu = torch.from_numpy(_offsets(lengths)).cuda()
    out = cuattn.attention_varlen(q, k, v, cu, cu, max_seqlen_q=2)
    assert isinstance(out, torch.Tensor)
    ref = reference.attention_varlen(q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(), cu.cpu().numpy(), cu.cpu().numpy())
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=5e-3)


# --- argument checks (no GPU: NumPy inputs are uploaded only after validation) ---------------


def _host_args(lengths_q=(3, 0, 4), lengths_k=(5, 1, 0), dtype=np.float16):
    q = np.ones((sum(lengths_q), 2, 8), dtype)
    k = np.ones((sum(lengths_k), 1, 8), dtype)
    return q, k, k.copy(), _offsets(lengths_q), _offsets(lengths_k)


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "q": a["q"][None]}, ValueError, r"q must have 3 dimensions"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].astype(np.int64)}, ValueError, r"cu_seqlens_q must be int32, got int64"),
    (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][None]}, ValueError, r"cu_seqlens_k must have 1 dimension"),
    (lambda a: {**a, "cu_seqlens_k": a["cu_seqlens_k"][:-1]}, ValueError, r"cu_seqlens_q has 4 offsets and cu_seqlens_k 3"),
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"] + 1}, ValueError, r"cu_seqlens_q must start at 0, got 1"),
    (lambda a: {**a, "cu_seqlens_k": np.array([0, 5, 4, 6], np.int32)}, ValueError, r"cu_seqlens_k must be non-decreasing"),
    (lambda a: {**a, "cu_seqlens_q": np.array([0, 3, 3, 6], np.int32)}, ValueError, r"cu_seqlens_q must end at the number of rows \(7\)"),
    (lambda a: {**a, "cu_seqlens_q": np.array([0], np.int32), "cu_seqlens_k": np.array([0], np.int32)}, ValueError, r"no sequences"),
    (lambda a: {**a, "cu_seqlens_q": np.zeros(0, np.int32), "cu_seqlens_k": np.zeros(0, np.int32)}, ValueError, r"batch \+ 1 >= 1"),
    (lambda a: {**a, "max_seqlen_q": -1}, ValueError, r"max_seqlen_q must be in \[0, 2\*\*31 - 256\], got -1"),
    (lambda a: {**a, "max_seqlen_q": 2**31}, ValueError, r"max_seqlen_q must be in \[0, 2\*\*31 - 256\]"),
    (lambda a: {**a, "max_seqlen_k": 2**31 - 255}, ValueError, r"max_seqlen_k must be in \[0, 2\*\*31 - 256\]"),  # was an OverflowError at packing
    (lambda a: {**a, "max_seqlen_q": 3}, ValueError, r"max_seqlen_q \(3\) is below the longest sequence \(4\)"),
    (lambda a: {**a, "max_seqlen_k": 2.0}, TypeError, r"max_seqlen_k must be an int"),
    (lambda a: {**a, "max_seqlen_q": True}, TypeError, r"max_seqlen_q must be an int"),
    (lambda a: {**a, "v": a["v"][:, :, :4]}, ValueError, r"v has shape"),
    (lambda a: {**a, "k": a["k"].astype(np.float32), "v": a["v"].astype(np.float32)}, TypeError, r"k has dtype float32"),
    (lambda a: {**a, "cu_seqlens_q": None}, TypeError, r"cu_seqlens_q is required"),
    (lambda a: {**a, "causal": 1}, TypeError, r"causal must be a bool"),
    (lambda a: {**a, "align": "left"}, ValueError, r"align must be"),
])
def test_varlen_rejects_bad_arguments(change, error, match):
    q, k, v, cu_q, cu_k = _host_args()
    args = change({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k})
    with pytest.raises(error, match=match):
        cuattn.attention_varlen(**args)


def test_varlen_reference_is_attention_per_sequence():
    rng = np.random.default_rng(3)
    q, k, v, cu_q, cu_k = _packed_inputs(rng, [4, 0, 6], [2, 5, 0], 4, 2, 8, "float32")
    out, lse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True)
    o, l = reference.attention(q[None, 4:], k[None, 7:7], v[None, 7:7], causal=True, return_lse=True)
    np.testing.assert_array_equal(out[4:], o[0])
    np.testing.assert_array_equal(lse[:, 4:], l[0])
    o, l = reference.attention(q[None, :4], k[None, :2], v[None, :2], causal=True, return_lse=True)
    np.testing.assert_array_equal(out[:4], o[0])


@gpu
@pytest.mark.parametrize("which", ["q", "k"])
@pytest.mark.parametrize("offsets, message", [
    ([1, 3, 7, 7], "does not start at 0"),
    ([0, 5, 3, 7], "decreases at entry 2"),
    ([0, 3, 3, 6], r"does not end at the number of rows \(entry 3, its last, differs\)"),
])
def test_bad_device_offsets_are_reported_without_reading_out_of_bounds(which, offsets, message):
    """Device offsets are checked on the GPU: the kernels clamp them (every row outside the
    arrays stays untouched: poison around the outputs survives), the next varlen call raises
    the ValueError naming the argument, once; check_varlen_offsets raises it at once."""
    import cupy

    rng = np.random.default_rng(5)
    q, k, v, cu_q, cu_k = _packed_inputs(rng, [3, 0, 4], [3, 0, 4], 2, 1, 64, "float16")
    bad = np.array(offsets, np.int32)
    cu = {"q": cupy.asarray(bad if which == "q" else cu_q), "k": cupy.asarray(bad if which == "k" else cu_k)}
    poisoned = cupy.full((9, 2, 64), np.nan, np.float16)  # a row of poison on either side of out
    qd, kd, vd = map(cupy.asarray, (q, k, v))
    cuattn.attention_varlen(qd, kd, vd, cu["q"], cu["k"], out=poisoned[1:8])
    assert cupy.isnan(poisoned[0]).all() and cupy.isnan(poisoned[8]).all()
    cupy.cuda.runtime.deviceSynchronize()
    name = f"cu_seqlens_{which}"
    with pytest.raises(ValueError, match=f"{name} {message}: found on the GPU"):
        cuattn.attention_varlen(qd, kd, vd, *map(cupy.asarray, (cu_q, cu_k)))
    cuattn.attention_varlen(qd, kd, vd, *map(cupy.asarray, (cu_q, cu_k)))  # reported once; good offsets pass
    cuattn.check_varlen_offsets()
    cuattn.attention_varlen(qd, kd, vd, cu["q"], cu["k"])
    with pytest.raises(ValueError, match=f"{name} {message}"):
        cuattn.check_varlen_offsets()


def test_offset_reports_name_the_argument_and_the_rule():
    from cuattn.packed import describe_report

    assert describe_report((1 << 32) | 0).startswith("cu_seqlens_q does not start at 0")
    assert describe_report((6 << 32) | 4).startswith("cu_seqlens_k decreases at entry 4")
    assert describe_report((3 << 32) | 9).startswith("cu_seqlens_q does not end at the number of rows (entry 9, its last, differs)")
    assert describe_report((8 << 32) | 2).startswith("cu_seqlens_k has sequence 1 longer than max_seqlen_k")


@pytest.mark.parametrize("side", ["q", "k"])
def test_packed_totals_past_int32_are_a_value_error(side):
    """2**31 packed rows (32 GB of q at one head of head_dim 8) passed the checks and raised an
    OverflowError while the int32 totals were packed. Totals stay a row block below 2**31 (a grid
    sized from them counts its rows in int32): 2**31 - 255 are refused, 2**31 - 256 pass
    (address-only arrays)."""
    from types import SimpleNamespace

    from cuattn import boundary

    spec = lambda shape, dtype: SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))  # noqa: E731
    cu = spec((3,), np.int32)
    for total, refused in ((2**31, True), (2**31 - 255, True), (2**31 - 256, False)):
        q = spec((total if side == "q" else 64, 1, 8), np.float16)
        k = spec((total if side == "k" else 64, 1, 8), np.float16)
        if refused:
            with pytest.raises(ValueError, match=rf"{side} holds {total} rows \(total_{side}\)"):
                boundary.trace(cuattn.attention_varlen, q, k, k, cu, cu)
        else:
            boundary.trace(cuattn.attention_varlen, q, k, k, cu, cu)


def test_sequences_past_int32_are_a_value_error():
    """Empty sequences let the count of sequences pass the row totals: (2**31 + 10) offsets
    passed the checks and raised an OverflowError where the int32 batch was packed."""
    from types import SimpleNamespace

    from cuattn import boundary

    spec = lambda shape, dtype: SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))  # noqa: E731
    q = spec((64, 1, 8), np.float16)
    with pytest.raises(ValueError, match="sequences; at most 2\\*\\*31 - 256"):
        boundary.trace(cuattn.attention_varlen, q, q, q, spec((2**31 + 10,), np.int32), spec((2**31 + 10,), np.int32))
