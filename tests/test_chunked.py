"""K/V streamed from host memory in chunks (cuattn.attention_chunked and its backward): the
results against the float64 reference with masks across chunk borders, GQA, every dtype and
both forward kernel paths, the device memory held at any moment, iterables of host and device
chunks, chunks that no row sees (GPU); which keys a mask leaves visible and the argument
checks (no GPU needed)."""

from types import SimpleNamespace

import numpy as np
import pytest

import cuattn
from cuattn import boundary, chunked, reference
from cuattn.options import AttnOptions, shifted
from helpers import (
    KERNEL_PATHS, assert_attention_accuracy, kernel_path, max_err, naive_attention, naive_attention_backward, poison_cupy_pool, randn,
)

gpu = pytest.mark.gpu


@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 40), (40, 5), (113, 1023)])
@pytest.mark.parametrize(
    "kw", [{}, {"causal": True}, {"causal": True, "align": "top_left"}, {"window": (7, 2)}, {"window": (3, None), "align": "top_left"}],
)
def test_visible_keys_bound_what_the_mask_shows(sq, sk, kw):
    options = AttnOptions.from_user(**kw, head_dim=64)
    fields = options.kernel_fields(sq, sk)
    first, last = chunked.visible_keys(sq, sk, fields)
    left, right = reference.window_bounds(kw.get("causal", False), kw.get("window"))
    seen = reference.visible(np.arange(sq), np.arange(sk), reference.diagonal_offset(sq, sk, kw.get("align", "bottom_right")), left, right).any(0)
    cols = np.flatnonzero(seen)
    if cols.size:
        assert (first, last) == (cols[0], cols[-1])
    else:
        assert last < first
    for start in range(0, sk, 16):  # the chunk's own mask, moved by its start, shows the same keys
        stop = min(start + 16, sk)
        local = shifted(fields, start)
        ok = reference.visible(np.arange(sq), np.arange(stop - start), local["diagonal_offset"], local["window_left"], local["window_right"])
        full = reference.visible(np.arange(sq), np.arange(sk), fields["diagonal_offset"], fields["window_left"], fields["window_right"])
        np.testing.assert_array_equal(ok, full[:, start:stop])


def test_split_keys_and_default_chunk_size():
    assert chunked.split_keys(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunked.split_keys(0, 4) == []
    tokens = chunked.default_chunk_tokens(2, 8, 128, 2)
    assert tokens % 128 == 0 and 2 * 2 * 8 * 128 * 2 * tokens <= chunked.DEFAULT_CHUNK_BYTES


def _q(shape=(2, 5, 4, 64), dtype=np.float16):
    """q's metadata as the kernels see it (no device needed for the checks)."""
    strides = tuple(int(s) for s in np.cumprod((1,) + shape[::-1][:-1])[::-1])
    return boundary.DeviceArray(0, shape, strides, np.dtype(dtype), None)


@pytest.mark.parametrize(
    "kv, kw, exc, match",
    [
        ((np.ones((2, 9, 2, 64), np.float16), np.ones((2, 9, 2, 32), np.float16)), {}, ValueError, r"kv_chunks\[1\] has shape"),
        ((np.ones((2, 9, 2, 64), np.float32), np.ones((2, 9, 2, 64), np.float32)), {}, TypeError, "dtype float32 but q"),
        ((np.ones((2, 9, 3, 64), np.float16), np.ones((2, 9, 3, 64), np.float16)), {}, ValueError, "multiple of heads_kv"),
        ((np.ones((3, 9, 2, 64), np.float16), np.ones((3, 9, 2, 64), np.float16)), {}, ValueError, "expected \\(batch=2"),
        ((np.ones((2, 2, 9, 64), np.float16).transpose(0, 2, 1, 3),) * 2, {}, ValueError, "must be contiguous"),
        ((np.ones((2, 9, 2, 64), np.float16),) * 2, {"chunk_tokens": 0}, ValueError, "chunk_tokens must be positive"),
        ((np.ones((2, 9, 2, 64), np.float16),) * 2, {"chunk_tokens": 2.0}, TypeError, "chunk_tokens must be an int"),
        ((np.ones((2, 9, 2, 64), np.float16),) * 2, {"seqlen_k": 8}, ValueError, "seqlen_k \\(8\\) differs"),
        ((np.ones((2, 9, 2, 64), np.float16),) * 2, {"seqlen_k": 9.0}, TypeError, "seqlen_k must be an int"),
        ((np.ones((2, 9, 2, 64), np.float16),) * 2, {"seqlen_k": "9"}, TypeError, "seqlen_k must be an int"),
        ((np.ones((2, 9, 2, 64), np.float16), [1]), {}, TypeError, "must be a host array"),
        ((np.ones((2, 9, 2, 64), np.float16), np.ones((2, 2, 9, 64), np.float16).transpose(0, 2, 1, 3)), {}, ValueError,
         r"kv_chunks\[1\] has strides .* must be contiguous"),
        ((np.ones((2, 9, 2, 64), np.float16), np.ones((2, 9, 2, 64), np.float32)), {}, TypeError, r"kv_chunks\[1\] has dtype float32"),
        ((np.ones((2, 9, 2, 64), np.float16), np.ones((2, 9, 2, 64), np.float16)[::-1]), {}, ValueError, "batches apart"),
    ],
)
def test_bad_pairs_are_refused(kv, kw, exc, match):
    with pytest.raises(exc, match=match):
        chunked._Source(kv, _q(), None, kw.get("chunk_tokens"), kw.get("seqlen_k"), needs_total=False)


def test_iterables_need_their_length_under_a_mask_and_well_formed_chunks():
    k = np.ones((2, 9, 2, 64), np.float16)
    with pytest.raises(ValueError, match="seqlen_k .* is required"):
        chunked._Source(iter([(k, k)]), _q(), None, None, None, needs_total=True)
    with pytest.raises(ValueError, match="chunk_tokens applies to a"):
        chunked._Source([(k, k), (k, k)], _q(), None, 4, None, needs_total=False)
    with pytest.raises(TypeError, match=r"kv_chunks\[1\] must be a \(k, v\) pair"):
        list(chunked._Source([(k, k), k], _q(), None, None, None, needs_total=False))
    with pytest.raises(TypeError, match=r"kv_chunks\[0\]\[1\] has dtype float32"):
        list(chunked._Source([(k, k.astype(np.float32))], _q(), None, None, None, needs_total=False))
    with pytest.raises(ValueError, match=r"kv_chunks\[0\]\[1\] has strides"):
        list(chunked._Source([(k, np.ones((2, 2, 9, 64), np.float16).transpose(0, 2, 1, 3))], _q(), None, None, None, needs_total=False))
    with pytest.raises(ValueError, match="KV heads but the earlier chunks"):
        list(chunked._Source([(k, k), (k[:, :, :1], k[:, :, :1])], _q(), None, None, None, needs_total=False))
    with pytest.raises(ValueError, match="the chunks hold 18 keys but seqlen_k is 20"):
        list(chunked._Source([(k, k), (k, k)], _q(), None, None, 20, needs_total=True))
    with pytest.raises(ValueError, match=r"more than seqlen_k \(10\)"):
        list(chunked._Source([(k, k), (k, k)], _q(), None, None, 10, needs_total=True))
    with pytest.raises(TypeError, match="tuple of two lists"):  # (k chunks, v chunks) read as chunks (k0, k1), (v0, v1)
        chunked._Source(([k, k], [k, k]), _q(), None, None, None, needs_total=False)
    chunks = list(chunked._Source([(k, k), (k[:, :4], k[:, :4])], _q(), None, None, None, needs_total=False))
    assert [(c.start, c.length, c.index, c.on_host) for c in chunks] == [(0, 9, 0, True), (9, 4, 1, True)]


def test_host_q_is_refused():
    k = np.ones((1, 9, 2, 64), np.float16)
    with pytest.raises(TypeError, match="q must be a device array"):
        cuattn.attention_chunked(np.ones((1, 3, 2, 64), np.float16), (k, k))


def test_a_progress_that_is_not_callable_is_named_first():
    """It failed at its first call, after kernels had run, with a TypeError naming nothing."""
    k = np.ones((1, 9, 2, 64), np.float16)
    q = np.ones((1, 3, 2, 64), np.float16)  # would be refused next: the check comes first
    with pytest.raises(TypeError, match="progress must be a callable"):
        cuattn.attention_chunked(q, (k, k), progress=5)
    with pytest.raises(TypeError, match="progress must be a callable"):
        cuattn.attention_chunked_backward(q, q, (k, k), q, q, progress="x")


def _pinned(x):
    import cupyx

    p = cupyx.empty_pinned(x.shape, x.dtype)
    p[...] = x
    return p


def _inputs(rng, dtype, b, sq, sk, hq, hk, d):
    q, k, v = randn(rng, (b, sq, hq, d), dtype), randn(rng, (b, sk, hk, d), dtype), randn(rng, (b, sk, hk, d), dtype)
    return q, k, v, randn(rng, (b, sq, hq, d), dtype), rng.standard_normal((b, hq, sq)).astype(np.float32)


def _check_grads(grads, dout, q, k, v, ref_out, ref_lse, dtype, dlse, kw):
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, dlse=dlse, **kw)
    naive = naive_attention_backward(dout, q, k, v, dtype, dlse=dlse, **kw)
    for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert g.shape == r.shape, name
        assert_attention_accuracy(g, r, n, factor=3.0, floor=1e-4)


CASES = [  # dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, chunk_tokens, mask
    ("bfloat16", 2, 113, 1023, 4, 2, 64, 256, {"causal": True}),
    ("float16", 1, 300, 700, 8, 1, 128, 128, {}),
    ("bfloat16", 2, 64, 500, 2, 2, 128, 100, {"window": (60, 5)}),
    ("float16", 1, 1023, 113, 2, 1, 64, 32, {"causal": True}),  # bottom-right: most rows see no key
    ("bfloat16", 2, 1, 1, 2, 1, 64, 1, {}),
    ("float16", 1, 200, 600, 2, 2, 256, 256, {"causal": True, "align": "top_left"}),  # chunks past the last row's keys are skipped
    ("float32", 1, 37, 300, 4, 2, 64, 64, {"window": (20, 20), "align": "top_left"}),
    ("bfloat16", 1, 96, 400, 2, 1, 96, 128, {"softcap": 15.0, "causal": True}),
]


@gpu
@pytest.mark.parametrize("path", KERNEL_PATHS + ("copying",))  # on Hopper: the TMA and the copying wgmma forward's fold
@pytest.mark.parametrize("dtype, b, sq, sk, hq, hk, d, chunk, kw", CASES)
def test_streamed_forward_and_backward_match_the_reference(path, dtype, b, sq, sk, hq, hk, d, chunk, kw):
    import cupy

    rng = np.random.default_rng(sq * 31 + sk)
    q, k, v, dout, dlse = _inputs(rng, dtype, b, sq, sk, hq, hk, d)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    pinned = sk % 2 == 1  # page-locked and pageable host memory both
    kv = (_pinned(k), _pinned(v)) if pinned else (k, v)
    with kernel_path(path):
        poison_cupy_pool()
        qd, doutd, dlsed = cupy.asarray(q), cupy.asarray(dout), cupy.asarray(dlse)
        out, lse = cuattn.attention_chunked(qd, kv, chunk_tokens=chunk, return_lse=True, **kw)
        assert_attention_accuracy(out.get(), ref_out, naive_attention(q, k, v, dtype, **kw))
        np.testing.assert_allclose(lse.get(), ref_lse, rtol=1e-5, atol=1e-5)
        poison_cupy_pool()
        dq, dk, dv = cuattn.attention_chunked_backward(doutd, qd, kv, out, lse, dlse=dlsed, chunk_tokens=chunk, **kw)
        assert isinstance(dk, np.ndarray) and dk.dtype == k.dtype
        _check_grads((dq.get(), dk, dv), dout, q, k, v, ref_out, ref_lse, dtype, dlse, kw)


@gpu
def test_one_chunk_is_bit_identical_to_attention():
    """With one chunk the fold takes the partial as it is: the same bits as cuattn.attention."""
    import cupy

    rng = np.random.default_rng(3)
    q, k, v, dout, _ = _inputs(rng, "bfloat16", 2, 200, 300, 4, 2, 128)
    qd = cupy.asarray(q)
    out, lse = cuattn.attention(qd, cupy.asarray(k), cupy.asarray(v), causal=True, return_lse=True)
    out_c, lse_c = cuattn.attention_chunked(qd, (k, v), chunk_tokens=300, causal=True, return_lse=True)
    assert cupy.array_equal(out.view(cupy.uint16), out_c.view(cupy.uint16)) and cupy.array_equal(lse, lse_c)
    grads = cuattn.attention_backward(cupy.asarray(dout), qd, cupy.asarray(k), cupy.asarray(v), out, lse, causal=True, deterministic=True)
    grads_c = cuattn.attention_chunked_backward(cupy.asarray(dout), qd, (k, v), out, lse, chunk_tokens=300, causal=True, deterministic=True)
    for g, g_c in zip(grads, grads_c):
        np.testing.assert_array_equal(g.get().view(np.uint16) if hasattr(g, "get") else g, np.asarray(g_c.get() if hasattr(g_c, "get") else g_c).view(np.uint16))


@gpu
def test_error_does_not_grow_with_the_number_of_chunks():
    """Partials are folded in fp32 and rounded once, and the kernels add each chunk's dQ into
    an fp32 sum: 64 chunks err like one, forward and dQ (dK / dV are per chunk anyway)."""
    import cupy

    rng = np.random.default_rng(4)
    q, k, v, dout, _ = _inputs(rng, "bfloat16", 1, 128, 4096, 4, 1, 64)
    ref, ref_lse = reference.attention(q, k, v, return_lse=True)
    ref_dq = reference.attention_backward(dout, q, k, v, ref, ref_lse)[0]
    qd, doutd = cupy.asarray(q), cupy.asarray(dout)
    errors = []
    for chunk in (4096, 64):
        out, lse = cuattn.attention_chunked(qd, (k, v), chunk_tokens=chunk, return_lse=True)
        dq = cuattn.attention_chunked_backward(doutd, qd, (k, v), out, lse, chunk_tokens=chunk)[0]
        errors.append((max_err(out.get(), ref), max_err(dq.get(), ref_dq)))
    (out_one, dq_one), (out_many, dq_many) = errors
    assert out_many <= 1.1 * out_one and dq_many <= 1.1 * dq_one, errors


class _PeakPool:
    """CuPy's allocator through a memory pool whose largest use is recorded."""

    def __init__(self):
        import cupy

        self.pool = cupy.cuda.MemoryPool()
        self.peak = 0

    def malloc(self, size):
        mem = self.pool.malloc(size)
        self.peak = max(self.peak, self.pool.used_bytes())
        return mem


@gpu
def test_device_memory_stays_two_chunks_whatever_the_key_length():
    import cupy

    rng = np.random.default_rng(6)
    b, sq, sk, hq, hk, d, chunk = 1, 64, 1 << 15, 2, 2, 64, 1024
    q, k, v, dout, _ = _inputs(rng, "float16", b, sq, sk, hq, hk, d)
    kv = (_pinned(k), _pinned(v))
    kv_bytes = 2 * k.nbytes
    tracker = _PeakPool()
    cupy.cuda.set_allocator(tracker.malloc)
    try:
        qd, doutd = cupy.asarray(q), cupy.asarray(dout)
        base = tracker.pool.used_bytes()
        out, lse = cuattn.attention_chunked(qd, kv, chunk_tokens=chunk, causal=True, return_lse=True)
        dq, dk, dv = cuattn.attention_chunked_backward(doutd, qd, kv, out, lse, chunk_tokens=chunk, causal=True)
        cupy.cuda.get_current_stream().synchronize()
        peak = tracker.peak - base
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    chunk_bytes = kv_bytes * chunk // sk
    q_size = q.nbytes
    # two slots of K, V, dK, dV; out, lse, the fp32 accumulators, dQ and its pieces, delta, lse
    assert peak <= 2 * 2 * chunk_bytes + 16 * q_size, (peak, chunk_bytes, q_size)
    assert peak < kv_bytes / 4
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert_attention_accuracy(out.get(), ref_out, naive_attention(q, k, v, "float16", causal=True))
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, causal=True)
    assert max_err(dk, ref[1]) < 1e-2 and max_err(dv, ref[2]) < 1e-2


@gpu
def test_iterables_of_host_and_device_chunks():
    """Chunks of uneven lengths (one empty), some on the host and some on the device; a causal
    mask needs seqlen_k; gradients come back per chunk, where each chunk was."""
    import cupy

    rng = np.random.default_rng(7)
    q, k, v, dout, dlse = _inputs(rng, "bfloat16", 2, 150, 777, 4, 2, 64)
    kw = {"causal": True}
    bounds = [0, 100, 100, 400, 650, 777]
    pieces = [(k[:, a:b], v[:, a:b]) for a, b in zip(bounds, bounds[1:])]
    chunks = [(cupy.asarray(kc), cupy.asarray(vc)) if i % 2 else (_pinned(kc), np.ascontiguousarray(vc)) for i, (kc, vc) in enumerate(pieces)]
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    qd = cupy.asarray(q)
    seen = []
    out, lse = cuattn.attention_chunked(qd, iter(chunks), seqlen_k=777, return_lse=True, progress=lambda d, t: seen.append((d, t)), **kw)
    assert_attention_accuracy(out.get(), ref_out, naive_attention(q, k, v, "bfloat16", **kw))
    assert seen[-1] == (777, 777) and [s[0] for s in seen] == sorted(s[0] for s in seen)
    dq, dks, dvs = cuattn.attention_chunked_backward(cupy.asarray(dout), qd, iter(chunks), out, lse, dlse=cupy.asarray(dlse), seqlen_k=777, **kw)
    assert [type(x).__module__.split(".")[0] for x in dks] == ["numpy", "cupy", "numpy", "cupy", "numpy"]
    to_np = lambda xs: np.concatenate([x.get() if hasattr(x, "get") else x for x in xs], axis=1)  # noqa: E731
    _check_grads((dq.get(), to_np(dks), to_np(dvs)), dout, q, k, v, ref_out, ref_lse, "bfloat16", dlse, kw)
    with pytest.raises(ValueError, match="seqlen_k"):
        cuattn.attention_chunked(qd, iter(chunks), **kw)
    out_nomask = cuattn.attention_chunked(qd, (c for c in chunks))  # no mask: the length is not needed
    assert_attention_accuracy(out_nomask.get(), reference.attention(q, k, v), naive_attention(q, k, v, "bfloat16"))


@gpu
def test_chunks_no_row_sees_are_skipped_with_zero_gradients():
    """A window near the start (top-left): the later chunks are never uploaded (their host
    memory may be anything) and get zero gradients."""
    import cupy

    rng = np.random.default_rng(8)
    q, k, v, dout, _ = _inputs(rng, "float16", 1, 50, 1000, 2, 2, 64)
    kw = {"window": (10, 10), "align": "top_left"}
    kh, vh = _pinned(k), _pinned(v)
    assert chunked.host_array(kh).pinned and not chunked.host_array(k).pinned  # page-locked input takes the direct copy
    kh[:, 64:], vh[:, 64:] = np.nan, np.nan  # never read: keys 60.. are seen by no row, chunks from 64 are skipped
    qd = cupy.asarray(q)
    out, lse = cuattn.attention_chunked(qd, (kh, vh), chunk_tokens=64, return_lse=True, **kw)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    assert_attention_accuracy(out.get(), ref_out, naive_attention(q, k, v, "float16", **kw))
    dq, dk, dv = cuattn.attention_chunked_backward(cupy.asarray(dout), qd, (kh, vh), out, lse, chunk_tokens=64, **kw)
    assert not np.isnan(dk.astype(np.float32)).any() and np.all(dk[:, 64:] == 0) and np.all(dv[:, 64:] == 0)
    _check_grads((dq.get(), dk, dv), dout, q, k, v, ref_out, ref_lse, "float16", None, kw)


@gpu
@pytest.mark.parametrize("where", ["pinned", "device"])
def test_a_producer_may_refill_one_buffer(where):
    """An iterable that reads every chunk into the same buffer (from disk, say): each chunk is
    read before the next is drawn."""
    import cupy

    rng = np.random.default_rng(12)
    q, k, v, dout, _ = _inputs(rng, "bfloat16", 1, 64, 1024, 4, 2, 64)
    buf = [(_pinned(k[:, :256]), _pinned(v[:, :256])), (cupy.empty((1, 256, 2, 64), k.dtype), cupy.empty((1, 256, 2, 64), k.dtype))][
        where == "device"]

    def chunks():
        for s in range(0, 1024, 256):
            if where == "device":
                buf[0].set(k[:, s:s + 256]), buf[1].set(v[:, s:s + 256])
            else:
                buf[0][...], buf[1][...] = k[:, s:s + 256], v[:, s:s + 256]
            yield buf

    qd = cupy.asarray(q)
    out, lse = cuattn.attention_chunked(qd, chunks(), return_lse=True)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True)
    assert_attention_accuracy(out.get(), ref_out, naive_attention(q, k, v, "bfloat16"))
    dq, dks, dvs = cuattn.attention_chunked_backward(cupy.asarray(dout), qd, chunks(), out, lse)
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse)
    naive = naive_attention_backward(dout, q, k, v, "bfloat16")
    assert_attention_accuracy(dq.get(), ref[0], naive[0], factor=3.0, floor=1e-4)


@gpu
def test_an_error_midway_leaves_nothing_in_flight():
    """A chunk refused after others were launched: the error names it, the copies are waited
    for, and the next call works."""
    import cupy

    rng = np.random.default_rng(13)
    q, k, v, _, _ = _inputs(rng, "float16", 1, 32, 512, 2, 2, 64)
    qd = cupy.asarray(q)

    def chunks():
        yield _pinned(k[:, :256]), _pinned(v[:, :256])
        yield k[:, 256:], v[:, 256:].astype(np.float32)

    with pytest.raises(TypeError, match=r"kv_chunks\[1\]\[1\] has dtype float32"):
        cuattn.attention_chunked(qd, chunks())
    out = cuattn.attention_chunked(qd, (k, v), chunk_tokens=128)
    assert_attention_accuracy(out.get(), reference.attention(q, k, v), naive_attention(q, k, v, "float16"))


@gpu
def test_no_keys_gives_zero_out_and_minus_inf_lse():
    import cupy

    q = cupy.asarray(randn(np.random.default_rng(9), (1, 7, 2, 64), "float16"))
    empty = np.ones((1, 0, 2, 64), np.float16)
    out, lse = cuattn.attention_chunked(q, (empty, empty), return_lse=True)
    assert out.shape == q.shape and cupy.all(out == 0) and cupy.all(lse == -cupy.inf)
    dq, dk, dv = cuattn.attention_chunked_backward(q, q, (empty, empty), out, lse)
    assert cupy.all(dq == 0) and dk.shape == (1, 0, 2, 64)


@gpu
def test_torch_tensors_cross_in_and_out():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    q, k, v, dout, _ = _inputs(rng, "float16", 1, 80, 500, 4, 2, 64)
    kt, vt = torch.from_numpy(k), torch.from_numpy(v).pin_memory()
    qt, doutt = torch.from_numpy(q).cuda(), torch.from_numpy(dout).cuda()
    out, lse = cuattn.attention_chunked(qt, (kt, vt), chunk_tokens=128, causal=True, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.is_cuda
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, return_lse=True)
    assert_attention_accuracy(out.cpu().numpy(), ref_out, naive_attention(q, k, v, "float16", causal=True))
    dq, dk, dv = cuattn.attention_chunked_backward(doutt, qt, (kt, vt), out, lse, chunk_tokens=128, causal=True)
    assert isinstance(dk, torch.Tensor) and dk.device.type == "cpu" and dk.is_pinned()
    _check_grads((dq.cpu().numpy(), dk.numpy(), dv.numpy()), dout, q, k, v, ref_out, ref_lse, "float16", None, {"causal": True})


def test_an_unmasked_pair_of_more_than_2_to_the_31_keys_streams():
    """Without a mask any number of keys streams; the limit of 2**31 - 256 rows per sequence
    is on what one kernel sees (a chunk): the pair's whole length was checked against it."""
    base = np.zeros(16, np.float16)
    keys = 2**31
    k = np.lib.stride_tricks.as_strided(base, (1, keys, 1, 8), (keys * 16, 16, 16, 2))
    q = SimpleNamespace(shape=(1, 16, 1, 8), dtype=np.dtype(np.float16))
    boundary.trace(chunked.attention_chunked, q, (k, k))
    with pytest.raises(ValueError, match="seqlen_k = 2147483648"):
        boundary.trace(chunked.attention_chunked, q, (k, k), chunk_tokens=keys)


@gpu
def test_a_consumed_iterator_in_the_backward_is_an_error():
    """The forward's iterator, handed to the backward again, yields nothing: the gradients were
    dq = 0 and no dk / dv, silently."""
    import cupy

    rng = np.random.default_rng(12)
    q, k, v, dout, _ = _inputs(rng, "bfloat16", 1, 40, 96, 2, 2, 64)
    chunks = iter([(k[:, :48], v[:, :48]), (k[:, 48:], v[:, 48:])])
    qd = cupy.asarray(q)
    out, lse = cuattn.attention_chunked(qd, chunks, return_lse=True)
    with pytest.raises(ValueError, match="yielded no chunk, but lse has rows that saw keys"):
        cuattn.attention_chunked_backward(cupy.asarray(dout), qd, chunks, out, lse)
    empty_lse = cupy.full(lse.shape, -np.inf, np.float32)  # a forward over no key: zero gradients, no error
    dq, dks, dvs = cuattn.attention_chunked_backward(cupy.asarray(dout), qd, iter([]), out, empty_lse)
    assert not bool(dq.any()) and dks == [] and dvs == []


@gpu
def test_jax_device_chunks_made_and_dropped_by_a_generator():
    """Device chunks that only the generator references (JAX frees a buffer once its DLPack
    view is dropped): each is held until the kernels that read it have run, and the result
    equals the reference's."""
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU")
    rng = np.random.default_rng(13)
    q, k, v, _, _ = _inputs(rng, "float16", 1, 64, 1000, 4, 2, 64)
    generated = ((jax.device_put(k[:, s:s + 100]), jax.device_put(v[:, s:s + 100])) for s in range(0, 1000, 100))
    out = cuattn.attention_chunked(jax.device_put(q), generated, causal=True, seqlen_k=1000)
    scratch = [jax.device_put(np.full(k[:, :100].shape, np.nan, np.float16)) for _ in range(8)]  # would take freed chunks
    assert_attention_accuracy(np.asarray(out), reference.attention(q, k, v, causal=True), naive_attention(q, k, v, "float16", causal=True))
    del scratch


def test_host_staging_copies_every_byte_of_strided_runs():
    """The threads that stage pageable rows copy runs split into pieces, none lost or shifted."""
    rng = np.random.default_rng(11)
    src = rng.integers(0, 255, size=(3, 5 << 20), dtype=np.uint8)  # runs of 3 MiB cut into pieces of 1.125 MiB
    dst = np.zeros((3, 3 << 20), np.uint8)
    base_s, base_d = src.__array_interface__["data"][0], dst.__array_interface__["data"][0]
    chunked._parallel_copy([(base_d + b * dst.shape[1], base_s + b * src.shape[1] + 1000, dst.shape[1]) for b in range(3)])
    np.testing.assert_array_equal(dst, src[:, 1000:1000 + dst.shape[1]])
    big = rng.integers(0, 255, size=20 << 20, dtype=np.uint8)
    out = np.zeros_like(big)
    chunked._parallel_copy([(out.__array_interface__["data"][0], big.__array_interface__["data"][0], big.nbytes)])
    np.testing.assert_array_equal(out, big)


def test_backward_refuses_an_out_its_kernels_cannot_load(monkeypatch):
    """out is read 16 bytes at a time (backward_prep): a view 2 elements into a wider array was
    accepted and faulted on the device; attention_backward refused it. Address-only arrays
    (boundary.trace), out shifted by 4 bytes."""
    imported = boundary.import_arrays

    def shifted_out(**arrays):
        ctx, a = imported(**arrays)
        if a.get("out") is not None:
            o = a["out"]
            a["out"] = boundary.DeviceArray(o.ptr + 4, o.shape, (o.strides[0] * 2, o.strides[1] * 2, o.strides[2] + 4, 1), o.dtype, None)
        return ctx, a

    monkeypatch.setattr(boundary, "import_arrays", shifted_out)
    q = SimpleNamespace(shape=(1, 16, 2, 64), dtype=np.dtype(np.float16))
    lse = SimpleNamespace(shape=(1, 2, 16), dtype=np.dtype(np.float32))
    k = np.zeros((1, 32, 2, 64), np.float16)
    with pytest.raises(ValueError, match=r"out strides .* not multiples of 16 bytes"):
        boundary.trace(chunked.attention_chunked_backward, q, q, (k, k.copy()), q, lse)


def test_copies_of_rows_2_gb_apart_go_row_by_row(monkeypatch):
    """cudaMemcpy2DAsync refuses a pitch past 2**31 - 1 bytes: a pinned (k, v) pair of batch 2
    whose sequences are 4 GB apart made the upload fail midway. Such copies go one row each;
    smaller pitches stay one 2-D copy."""
    import cupy

    calls = []
    rt = cupy.cuda.runtime
    monkeypatch.setattr(rt, "memcpy2DAsync", lambda *args: calls.append(("2d", args)))
    monkeypatch.setattr(rt, "memcpyAsync", lambda *args: calls.append(("1d", args)))
    stream = SimpleNamespace(ptr=7)
    row = 2**20 * 8 * 128  # a million keys of 8 heads of head_dim 128, in elements
    chunked._copy_rows(1 << 40, 4096 * 8 * 128, 1 << 20, row, 4096 * 8 * 128, 2, 2, "h2d", stream)
    assert [c[0] for c in calls] == ["1d", "1d"]
    assert [c[1][:3] for c in calls] == [(1 << 40, 1 << 20, 4096 * 8 * 128 * 2), ((1 << 40) + 4096 * 8 * 128 * 2, (1 << 20) + row * 2, 4096 * 8 * 128 * 2)]
    calls.clear()
    chunked._copy_rows(1 << 40, 4096 * 8 * 128, 1 << 20, 2**16 * 8 * 128, 4096 * 8 * 128, 2, 2, "d2h", stream)
    assert [c[0] for c in calls] == ["2d"]



def test_without_a_mask_any_number_of_keys_streams():
    """Unmasked, key positions do not matter: a (k, v) pair of 2**30 keys was refused
    (seqlen_q + seqlen_k past 2**30), and an iterable's chunk starting at 2**31 moved the
    diagonal out of int32 (OverflowError when its fields were packed). With a mask the limit
    stays. Shape-only host arrays (never read)."""
    from cuattn.attention import set_mask

    base = np.zeros(16, np.float16)
    keys = 2**30
    k = np.lib.stride_tricks.as_strided(base, (1, keys, 1, 8), (keys * 16, 16, 16, 2))
    q = SimpleNamespace(shape=(1, 16, 1, 8), dtype=np.dtype(np.float16))
    boundary.trace(chunked.attention_chunked, q, (k, k))
    with pytest.raises(ValueError, match=r"with a mask, seqlen_q \+ seqlen_k must be at most"):
        boundary.trace(chunked.attention_chunked, q, (k, k), causal=True)
    unmasked = chunked._mask_fields(AttnOptions.from_user(head_dim=8), 16, None)
    assert chunked._at_chunk(unmasked, 2**31) == unmasked
    fields = np.zeros((), [("window_left", np.int32), ("window_right", np.int32), ("diagonal_offset", np.int32)])[()]
    set_mask(fields, chunked._at_chunk(unmasked, 2**31))
    causal = chunked._mask_fields(AttnOptions.from_user(causal=True, head_dim=8), 16, 4096)
    assert chunked._at_chunk(causal, 1024)["diagonal_offset"] == causal["diagonal_offset"] - 1024


@gpu
def test_progress_reaches_every_key_and_gives_no_total_where_none_is_known():
    """A chunk past every row's keys is skipped, but its keys count as done: the last report
    is (seqlen_k, seqlen_k), forward and backward (it stopped at the last chunk computed). An
    iterable of unknown length reports a total of None to the end (the last report had the
    count once the iterable was read)."""
    import cupy

    rng = np.random.default_rng(9)
    q, k, v, dout, _ = _inputs(rng, "float16", 1, 200, 600, 2, 2, 64)
    qd = cupy.asarray(q)
    kw = {"causal": True, "align": "top_left"}  # keys 256.. lie past row 199's: the last two chunks are skipped
    seen = []
    out, lse = cuattn.attention_chunked(qd, (_pinned(k), _pinned(v)), chunk_tokens=128, return_lse=True,
                                        progress=lambda d, t: seen.append((d, t)), **kw)
    assert seen[-1] == (600, 600) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    seen.clear()
    cuattn.attention_chunked_backward(cupy.asarray(dout), qd, (_pinned(k), _pinned(v)), out, lse, chunk_tokens=128,
                                      progress=lambda d, t: seen.append((d, t)), **kw)
    assert seen[-1] == (600, 600)
    seen.clear()
    chunks = [(_pinned(k[:, a:a + 150]), _pinned(v[:, a:a + 150])) for a in range(0, 600, 150)]
    cuattn.attention_chunked(qd, (c for c in chunks), progress=lambda d, t: seen.append((d, t)))
    assert [d for d, _ in seen] == [150, 300, 450, 600] and all(t is None for _, t in seen)
