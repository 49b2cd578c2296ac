"""Dropout on the attention probabilities (``dropout_p``, ``dropout_seed``): the host twin of
the kernels' draws, the argument checks and the kernel selection (no GPU needed); the kernels'
masks against the host draws, forward and backward against float64 with the same mask, the
kept fraction, seeds, graph capture and the adapters (GPU)."""

import numpy as np
import pytest

import cuattn
from cuattn import reference
from helpers import (
    DTYPES, KERNEL_PATHS, assert_attention_accuracy, assert_every_kernel_path_has_form, kernel_path, max_err, naive_attention, naive_attention_backward, poison_cupy_pool, randn,
    torch_attention_grads,
)

gpu = pytest.mark.gpu
SEED = 0xDEADBEEF12345678  # both key words nonzero


def test_philox_matches_the_published_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0), (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
    ]
    for counter, key, expected in cases:
        assert tuple(int(x) for x in reference.philox4x32_10(np.array(counter, np.uint64), key)) == expected


def test_host_draws_follow_the_documented_byte():
    """Element (i=25, j=42) of head 1 of sequence 2: byte 8*1 + 4*1 + 2*1 + 0 = 14 of the draw
    with counter (42 & ~9, 25 & ~9, 2 * 3 + 1, 0), kept when it is at least round(256 p)."""
    words = reference.philox4x32_10(np.array([42 & ~9, 25 & ~9, 7, 0], np.uint64), (SEED & 0xFFFFFFFF, SEED >> 32))
    byte = (int(words[14 // 4]) >> (8 * (14 % 4))) & 0xFF
    for p in (byte / 256, (byte + 1) / 256):
        assert reference.dropout_keep(3, 2, [25], [42], p, SEED)[1, 0, 0] == (byte >= reference.dropout_threshold(p))


def test_host_draws_depend_only_on_coordinates_and_seed():
    full = reference.dropout_keep(3, 1, np.arange(70), np.arange(90), 0.3, SEED)
    rows, cols = np.array([5, 8, 13, 64, 69]), np.array([0, 1, 8, 9, 17, 88])
    np.testing.assert_array_equal(reference.dropout_keep(3, 1, rows, cols, 0.3, SEED), full[:, rows][:, :, cols])
    assert not np.array_equal(full, reference.dropout_keep(3, 1, np.arange(70), np.arange(90), 0.3, SEED + 1))
    assert not np.array_equal(full, reference.dropout_keep(3, 2, np.arange(70), np.arange(90), 0.3, SEED))  # another sequence
    assert not np.array_equal(full[0], full[1])  # heads differ


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_host_kept_fraction_is_binomial(p):
    keep = reference.dropout_keep(4, 0, np.arange(256), np.arange(512), p, 7)
    kept = reference.dropout_kept_fraction(p)
    sigma = np.sqrt(kept * (1 - kept) / keep.size)
    assert abs(keep.mean() - kept) < 6 * sigma


def test_reference_applies_the_mask_after_the_softmax():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 9, 2, 8)), rng.standard_normal((1, 20, 2, 8)), rng.standard_normal((1, 20, 2, 8))
    s = np.einsum("bmhd,bnhd->bhmn", q, k) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    z = reference.dropout_keep(2, 0, np.arange(9), np.arange(20), 0.25, 3) / reference.dropout_kept_fraction(0.25)
    out, lse = reference.attention(q, k, v, dropout_p=0.25, dropout_seed=3, return_lse=True)
    np.testing.assert_allclose(out, np.einsum("bhmn,bnhd->bmhd", p * z[None], v), atol=1e-12)
    np.testing.assert_allclose(lse, reference.attention(q, k, v, return_lse=True)[1])  # lse ignores dropout
    np.testing.assert_array_equal(reference.attention(q, k, v, dropout_p=0.0, dropout_seed=3), reference.attention(q, k, v))


def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(1)
    q, k, v, w = (rng.standard_normal(s) for s in ((1, 5, 2, 8), (1, 7, 1, 8), (1, 7, 1, 8), (1, 5, 2, 8)))
    kw = {"dropout_p": 0.4, "dropout_seed": 11, "causal": True}
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    grads = reference.attention_backward(w, q, k, v, out, lse, **kw)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        for idx in [(0, 2, 0, 3), (0, 4, 0, 1), (0, 1, 0, 5)]:
            if idx[2] >= x.shape[2]:
                continue
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args = lambda y: [y if a is x else a for a in (q, k, v)]  # noqa: E731
            numeric = ((reference.attention(*args(xp), **kw) - reference.attention(*args(xm), **kw)) * w).sum() / (2 * eps)
            assert abs(numeric - g[idx]) < 1e-6


@pytest.mark.parametrize("value, exc", [(-0.1, ValueError), (1.0, ValueError), (float("nan"), ValueError), (True, TypeError), ("0.1", TypeError)])
def test_bad_dropout_p_is_refused_before_any_launch(value, exc):
    q = np.ones((1, 3, 2, 64), np.float16)
    with pytest.raises(exc, match="dropout_p"):
        cuattn.attention(q, q, q, dropout_p=value, dropout_seed=1)
    with pytest.raises(exc, match="dropout_p"):
        cuattn.attention_backward(q, q, q, q, q, np.zeros((1, 2, 3), np.float32), dropout_p=value, dropout_seed=1)


@pytest.mark.parametrize("seed, exc", [(None, ValueError), (-1, ValueError), (2**64, ValueError), (True, TypeError),
                                       (np.zeros(3, np.uint32), ValueError), (np.zeros(2, np.float32), TypeError), (np.zeros((1, 2), np.uint32), ValueError)])
def test_bad_dropout_seed_is_refused_before_any_launch(seed, exc):
    q = np.ones((1, 3, 2, 64), np.float16)
    with pytest.raises(exc, match="dropout_seed"):
        cuattn.attention(q, q, q, dropout_p=0.1, dropout_seed=seed)
    with pytest.raises(exc, match="dropout_seed"):
        cuattn.attention_backward(q, q, q, q, q, np.zeros((1, 2, 3), np.float32), dropout_p=0.1, dropout_seed=seed)


@pytest.mark.parametrize("window", [(1, 0), None])  # two key ranges, and one (no left bound): refused alike
def test_dropout_with_sink_tokens_is_refused(window):
    q = np.ones((1, 3, 2, 64), np.float16)
    with pytest.raises(ValueError, match="dropout"):
        cuattn.attention(q, q, q, window=window, sink_tokens=1, dropout_p=0.1, dropout_seed=1)
    with pytest.raises(ValueError, match="dropout"):
        cuattn.attention_backward(q, q, q, q, q, np.zeros((1, 2, 3), np.float32), window=window, sink_tokens=1, dropout_p=0.1, dropout_seed=1)


def test_every_kernel_path_has_a_dropout_form():
    assert_every_kernel_path_has_form("/dropout", ", true>", dropout=True)


def _keeps(batch, heads, sq, sk, p, seed):
    """The host draws of every sequence: (batch, heads, sq, sk) booleans."""
    return np.stack([reference.dropout_keep(heads, b, np.arange(sq), np.arange(sk), p, seed) for b in range(batch)])


def _weights(batch, heads, sq, sk, p, seed):
    """What dropout multiplies each probability by: 1 / kept fraction, or 0."""
    return _keeps(batch, heads, sq, sk, p, seed) / reference.dropout_kept_fraction(p)


def _host(x):
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _one_hot_values(batch, seqlen_k, heads_kv, head_dim, dtype):
    """v[b, j, h] = e_j: then out[b, i, h, j] = P_ij * (dropout weight), nonzero iff kept."""
    v = np.zeros((batch, seqlen_k, heads_kv, head_dim), np.float32)
    v[:, np.arange(seqlen_k), :, np.arange(seqlen_k)] = 1.0
    return v.astype(DTYPES[dtype])


MASK_CASES = [  # dtype, head_dim, sq, sk, causal
    ("bfloat16", 256, 300, 250, False),
    ("float16", 128, 200, 128, True),
    ("bfloat16", 64, 130, 64, False),
    ("float32", 64, 70, 60, True),
]


@gpu
@pytest.mark.parametrize("dtype, d, sq, sk, causal", MASK_CASES)
def test_kernel_masks_are_the_host_draws(dtype, d, sq, sk, causal):
    """With one-hot values the output shows the forward's mask element by element, and with
    one-hot output gradients dV shows the dK / dV kernels' (transposed) mask: both equal the
    host draws, on every kernel path."""
    import cupy

    rng = np.random.default_rng(sq)
    b, h, p = 2, 3, 0.3
    q, k = randn(rng, (b, sq, h, d), dtype, 0.3), randn(rng, (b, sk, h, d), dtype, 0.3)
    v = _one_hot_values(b, sk, h, d, dtype)
    dout = np.zeros((b, sq, h, d), np.float32)
    rows = np.arange(min(sq, d))
    dout[:, rows, :, rows] = 1.0
    dout = dout.astype(q.dtype)
    left, right = reference.window_bounds(causal, None)
    visible = reference.visible(np.arange(sq), np.arange(sk), sk - sq, left, right)
    expected = _keeps(b, h, sq, sk, p, SEED) & visible
    for path in KERNEL_PATHS:
        with kernel_path(path):
            dev = [cupy.asarray(x) for x in (q, k, v, dout)]
            out, lse = cuattn.attention(*dev[:3], causal=causal, dropout_p=p, dropout_seed=SEED, return_lse=True)
            shown = _host(out).astype(np.float32)[..., :sk].transpose(0, 2, 1, 3) != 0  # (b, h, sq, sk)
            np.testing.assert_array_equal(shown, expected, err_msg=f"{path} forward")
            for deterministic in (False, True):
                _, _, dv = cuattn.attention_backward(dev[3], *dev[:3], out, lse, causal=causal, dropout_p=p, dropout_seed=SEED,
                                                     deterministic=deterministic)
                shown = _host(dv).astype(np.float32)[..., : len(rows)].transpose(0, 2, 3, 1) != 0  # (b, h, rows, sk)
                np.testing.assert_array_equal(shown, expected[:, :, rows], err_msg=f"{path} dV")


CASES = [  # dtype, sq, sk, hq, hk, d, p, kw
    ("bfloat16", 513, 600, 4, 2, 128, 0.1, {"causal": True}),
    ("float16", 113, 1023, 4, 4, 64, 0.5, {"window": (64, 64), "softcap": 30.0}),
    ("float32", 37, 70, 4, 2, 64, 0.2, {"causal": True, "align": "top_left"}),
    ("bfloat16", 1, 300, 8, 1, 256, 0.3, {}),
    ("float16", 150, 333, 4, 2, 192, 0.3, {"causal": True, "softcap": 30.0}),  # the 192 tile's unequal column shares
    ("bfloat16", 200, 500, 4, 2, 96, 0.9, {"causal": True}),
]


@gpu
@pytest.mark.parametrize("dtype, sq, sk, hq, hk, d, p, kw", CASES)
def test_forward_and_backward_match_the_reference(dtype, sq, sk, hq, hk, d, p, kw):
    """Both kernel paths against float64 with the same mask, within 2x (forward) / 3x
    (gradients) the error of naive attention in the input precision."""
    import cupy

    rng = np.random.default_rng(sq * 7 + sk)
    q, k, v = randn(rng, (2, sq, hq, d), dtype), randn(rng, (2, sk, hk, d), dtype), randn(rng, (2, sk, hk, d), dtype)
    dout = randn(rng, (2, sq, hq, d), dtype)
    dlse = rng.standard_normal((2, hq, sq)).astype(np.float32)
    kw = {**kw, "dropout_p": p, "dropout_seed": SEED}
    weights = _weights(2, hq, sq, sk, p, SEED)
    plain = {key: value for key, value in kw.items() if not key.startswith("dropout")}
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    naive_out = naive_attention(q, k, v, dtype, dropout=weights, **plain)
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, dlse=dlse, **kw)
    naive = naive_attention_backward(dout, q, k, v, dtype, dlse=dlse, dropout=weights, **plain)
    for path in KERNEL_PATHS:
        with kernel_path(path):
            poison_cupy_pool()
            dev = [cupy.asarray(x) for x in (q, k, v, dout, dlse)]
            out, lse = cuattn.attention(*dev[:3], return_lse=True, **kw)
            assert_attention_accuracy(_host(out), ref_out, naive_out)
            np.testing.assert_allclose(_host(lse), ref_lse, rtol=1e-5, atol=1e-5)
            for deterministic in (False, True):
                poison_cupy_pool()
                grads = cuattn.attention_backward(dev[3], *dev[:3], out, lse, dlse=dev[4], deterministic=deterministic, **kw)
                for name, g, r, nv in zip(("dq", "dk", "dv"), grads, ref, naive):
                    g = _host(g)
                    assert not np.isnan(g.astype(np.float32)).any(), f"{path} {name}"
                    bound = 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))
                    assert max_err(g, r) <= bound, f"{path} {name}: {max_err(g, r):.3e} > {bound:.3e}"


@gpu
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_over_many_draws_is_binomial(p):
    import cupy

    b, h, sq, sk, d = 4, 16, 1024, 256, 256
    rng = np.random.default_rng(5)
    q, k = (cupy.asarray(randn(rng, (b, s, h, d), "bfloat16", 0.1)) for s in (sq, sk))
    v = cupy.asarray(_one_hot_values(b, sk, h, d, "bfloat16"))
    kept = (cupy.asarray(cuattn.attention(q, k, v, dropout_p=p, dropout_seed=SEED))[..., :sk] != 0).mean().item()
    expected = reference.dropout_kept_fraction(p)
    assert abs(kept - expected) < 6 * np.sqrt(expected * (1 - expected) / (b * h * sq * sk))


@gpu
def test_seeds_repeat_and_differ_and_arrays_serve_graph_replays():
    """One seed gives bit-identical results, another a different mask; a seed array on the
    device equals its int, and a captured graph reads it at each replay."""
    import cupy

    rng = np.random.default_rng(9)
    q, k, v = (cupy.asarray(randn(rng, (2, 257, 4, 64), "bfloat16")) for _ in range(3))
    first = cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=SEED)
    assert cupy.array_equal(first, cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=SEED))
    assert not cupy.array_equal(first, cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=SEED ^ 1))
    seed = cupy.asarray(np.array([SEED & 0xFFFFFFFF, SEED >> 32], np.uint32))
    assert cupy.array_equal(first, cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=seed))
    assert cupy.array_equal(first, cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=cupy.asarray(np.array([SEED], np.uint64))))

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=seed)  # record the plan before capturing
        stream.begin_capture()
        captured = cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=seed)
        graph = stream.end_capture()
    for value in (SEED, 12345, SEED ^ 0xFF00):
        with stream:  # the new seed written before the replay reads it (the stream is non-blocking)
            seed[...] = cupy.asarray(np.array([value & 0xFFFFFFFF, value >> 32], np.uint32))
            graph.launch(stream)
        stream.synchronize()
        assert cupy.array_equal(captured, cuattn.attention(q, k, v, dropout_p=0.2, dropout_seed=value))


@gpu
def test_torch_gradients_match_the_reference_and_manual_seed_repeats():
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    rng = np.random.default_rng(6)
    q, k, v = randn(rng, (2, 300, 8, 64), "bfloat16"), randn(rng, (2, 300, 2, 64), "bfloat16"), randn(rng, (2, 300, 2, 64), "bfloat16")
    w = randn(rng, (2, 300, 8, 64), "bfloat16").astype(np.float32)
    kw = {"causal": True, "dropout_p": 0.25, "dropout_seed": SEED}
    weights = _weights(2, 8, 300, 300, 0.25, SEED)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    ref = reference.attention_backward(w, q, k, v, ref_out, ref_lse, **kw)
    naive_out = naive_attention(q, k, v, "bfloat16", causal=True, dropout=weights)
    naive = naive_attention_backward(w, q, k, v, "bfloat16", causal=True, dropout=weights)

    for fn in (lambda q, k, v: ct.attention(q, k, v, **kw), torch.compile(lambda q, k, v: ct.attention(q, k, v, **kw), fullgraph=True)):
        out, grads = torch_attention_grads(fn, q, k, v, w)
        assert_attention_accuracy(out, ref_out, naive_out)
        for g, r, nv in zip(grads, ref, naive):
            assert max_err(g, r) <= 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))

    xs = [torch.from_numpy(x.astype(np.float32)).cuda().bfloat16() for x in (q, k, v)]
    sdpa = lambda: ct.scaled_dot_product_attention(*(x.transpose(1, 2) for x in xs), dropout_p=0.3, is_causal=True, enable_gqa=True)  # noqa: E731
    torch.manual_seed(3)
    a = sdpa()
    torch.manual_seed(3)
    assert torch.equal(a, sdpa())
    assert not torch.equal(a, sdpa())  # the generator moved on
    torch.manual_seed(3)
    compiled = torch.compile(lambda q, k, v: ct.attention(q, k, v, causal=True, dropout_p=0.3), fullgraph=True)
    tiny = [x[:, :64] for x in xs]
    assert not torch.equal(compiled(*tiny), compiled(*tiny))  # traced: the seed is drawn per call, not baked in

    seed = torch.tensor([7], dtype=torch.int64, device="cuda")
    leaf = xs[0].detach().requires_grad_()
    out = ct.attention(leaf, xs[1], xs[2], dropout_p=0.3, dropout_seed=seed)
    seed.add_(1)  # the backward would draw another mask: autograd refuses
    with pytest.raises(RuntimeError, match="inplace"):
        out.float().sum().backward()

    small = [x[:, :40].detach().requires_grad_() for x in xs]
    seed = torch.tensor([SEED - 2**64], dtype=torch.int64, device="cuda")
    options = dict(causal=True, window_left=-1, window_right=-1, align="bottom_right", scale=0.125, softcap=0.0, sink_tokens=0, dropout_p=0.25)
    torch.library.opcheck(ct.op("attention_dropout"), (*small, seed), options)
    out, lse = ct.op("attention_dropout")(*(x.detach() for x in small), seed, **options)
    torch.library.opcheck(ct.op("attention_dropout_backward"), (torch.randn_like(out), *(x.detach() for x in small), out, lse, None, seed),
                          {**options, "deterministic": True})


@gpu
def test_jax_gradients_match_the_reference():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuattn.jax as cj

    rng = np.random.default_rng(3)
    q, k, v = randn(rng, (2, 150, 4, 64), "bfloat16"), randn(rng, (2, 160, 2, 64), "bfloat16"), randn(rng, (2, 160, 2, 64), "bfloat16")
    w = randn(rng, (2, 150, 4, 64), "bfloat16").astype(np.float32)
    key = jax.random.key(42)
    seed = cj.dropout_seed(key)
    kw = {"causal": True, "dropout_p": 0.2}

    def loss(q, k, v, key):
        return (cj.attention(q, k, v, dropout_rng=key, **kw).astype(jnp.float32) * w).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*map(jnp.asarray, (q, k, v)), key)
    weights = _weights(2, 4, 150, 160, 0.2, seed)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, dropout_seed=seed, **kw)
    ref = reference.attention_backward(w, q, k, v, ref_out, ref_lse, dropout_seed=seed, **kw)
    naive = naive_attention_backward(w, q, k, v, "bfloat16", causal=True, dropout=weights)
    for g, r, nv in zip(grads, ref, naive):
        assert max_err(np.asarray(g).astype(np.float32), r) <= 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))


def _varlen_case(rng, lengths, hq, hk, d, dtype):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, dout = (randn(rng, (int(cu[-1]), h, d), dtype) for h in (hq, hk, hk, hq))
    return cu, q, k, v, dout


def _varlen_naive(cu, q, k, v, dout, dtype, p, **kw):
    """Naive attention in the input precision, sequence by sequence with its dropout weights."""
    outs, grads = [], [[], [], []]
    for b in range(len(cu) - 1):
        rows = slice(cu[b], cu[b + 1])
        if cu[b + 1] == cu[b]:  # an empty sequence has no rows
            continue
        weights = np.stack([reference.dropout_keep(q.shape[1], b, np.arange(cu[b + 1] - cu[b]), np.arange(cu[b + 1] - cu[b]), p, SEED)])
        weights = weights / reference.dropout_kept_fraction(p)
        args = (q[None, rows], k[None, rows], v[None, rows])
        outs.append(naive_attention(*args, dtype, dropout=weights, **kw)[0])
        for acc, g in zip(grads, naive_attention_backward(dout[None, rows], *args, dtype, dropout=weights, **kw)):
            acc.append(g[0])
    return np.concatenate(outs), [np.concatenate(g) for g in grads]


@gpu
def test_varlen_draws_per_sequence_and_matches_the_reference():
    """Packed sequences draw as sequence b of a dense batch (equal lengths: the same result as
    the dense call, bit for bit), and ragged ones match float64 on both kernel paths."""
    import cupy

    rng = np.random.default_rng(11)
    p, kw = 0.2, {"causal": True}
    cu, q, k, v, dout = _varlen_case(rng, [300, 0, 1, 700, 113], 8, 2, 128, "bfloat16")
    ref_out, ref_lse = reference.attention_varlen(q, k, v, cu, cu, return_lse=True, dropout_p=p, dropout_seed=SEED, **kw)
    ref = reference.attention_varlen_backward(dout, q, k, v, ref_out, ref_lse, cu, cu, dropout_p=p, dropout_seed=SEED, **kw)
    naive_out, naive = _varlen_naive(cu, q, k, v, dout, "bfloat16", p, **kw)
    for path in KERNEL_PATHS:
        with kernel_path(path):
            dev = [cupy.asarray(x) for x in (q, k, v, dout, cu)]
            out, lse = cuattn.attention_varlen(*dev[:3], dev[4], dev[4], return_lse=True, dropout_p=p, dropout_seed=SEED, **kw)
            assert_attention_accuracy(_host(out), ref_out, naive_out)
            for deterministic in (False, True):
                grads = cuattn.attention_varlen_backward(dev[3], *dev[:3], out, lse, dev[4], dev[4], dropout_p=p, dropout_seed=SEED,
                                                         deterministic=deterministic, **kw)
                for g, r, nv in zip(grads, ref, naive):
                    assert max_err(_host(g), r) <= 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))

    dense = [cupy.asarray(randn(rng, (2, 256, 4, 64), "bfloat16")) for _ in range(3)]
    packed = [x.reshape(512, 4, 64) for x in dense]
    cu = cupy.asarray(np.array([0, 256, 512], np.int32))
    want = cuattn.attention(*dense, causal=True, dropout_p=p, dropout_seed=SEED)
    assert cupy.array_equal(cuattn.attention_varlen(*packed, cu, cu, causal=True, dropout_p=p, dropout_seed=SEED), want.reshape(512, 4, 64))


@gpu
def test_varlen_adapters_take_dropout():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuattn.jax as cj
    import cuattn.torch as ct

    rng = np.random.default_rng(12)
    p = 0.25
    cu, q, k, v, w = _varlen_case(rng, [100, 3, 150], 4, 2, 64, "bfloat16")
    w = w.astype(np.float32)
    key = jax.random.key(5)
    for seed, run in (
        (SEED, lambda: _torch_varlen_grads(torch, ct, cu, q, k, v, w, p)),
        (cj.dropout_seed(key), lambda: [np.asarray(g, np.float32) for g in jax.jit(jax.grad(
            lambda q, k, v: (cj.attention_varlen(q, k, v, jnp.asarray(cu), jnp.asarray(cu), dropout_p=p, dropout_rng=key)
                             .astype(jnp.float32) * w).sum(), argnums=(0, 1, 2)))(*map(jnp.asarray, (q, k, v)))]),
    ):
        out, lse = reference.attention_varlen(q, k, v, cu, cu, return_lse=True, dropout_p=p, dropout_seed=seed)
        ref = reference.attention_varlen_backward(w, q, k, v, out, lse, cu, cu, dropout_p=p, dropout_seed=seed)
        for g, r in zip(run(), ref):
            assert max_err(g, r) <= 0.05 * max(1.0, float(np.abs(r).max()))  # a wrong mask errs by O(|r|)


def _torch_varlen_grads(torch, ct, cu, q, k, v, w, p):
    xs = [torch.from_numpy(x.astype(np.float32)).cuda().bfloat16().requires_grad_() for x in (q, k, v)]
    cu_t = torch.from_numpy(cu).cuda()
    out = ct.attention_varlen(*xs, cu_t, cu_t, dropout_p=p, dropout_seed=SEED)
    (out.float() * torch.from_numpy(w).cuda()).sum().backward()
    return [x.grad.float().cpu().numpy() for x in xs]


def test_an_array_dropout_p_is_named_before_the_fast_path():
    """A dropout_p that is no plain number takes the full path, whose checks name it (an array
    of two gave NumPy's 'truth value of an array is ambiguous' from the fast path's test)."""
    q = np.ones((1, 8, 2, 16), np.float16)
    with pytest.raises(TypeError, match="dropout_p must be a float in"):
        cuattn.attention(q, q, q, dropout_p=np.array([0.1, 0.2]), dropout_seed=1)
