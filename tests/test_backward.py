"""cuattn.attention_backward on the GPU against the float64 reference backward."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuattn
from cuattn import reference
from helpers import assert_attention_accuracy, kernel_path, naive_attention_backward, poison_cupy_pool, randn

pytestmark = pytest.mark.gpu


# The backward's kernel paths: "default" (on Hopper the one-pass kernel, dQ by atomics, for
# float16 / bfloat16 at the wgmma head dims), "deterministic" (deterministic=True: the dQ and
# dK/dV kernels) and "portable" (the mma.sync kernels on any GPU).
BACKWARD_PATHS = ("default", "deterministic", "portable")


def _run(rng, batch, sq, sk, hq, hk, d, dtype, with_dlse=False, scale_inputs=1.0, path="default", **kw):
    """Forward with cuattn, then backward; each gradient within 3x the naive error."""
    with kernel_path(path):
        return _run_on_path(rng, batch, sq, sk, hq, hk, d, dtype, with_dlse, scale_inputs, deterministic=path == "deterministic", **kw)


def _run_on_path(rng, batch, sq, sk, hq, hk, d, dtype, with_dlse, scale_inputs, deterministic, **kw):
    import cupy

    q = randn(rng, (batch, sq, hq, d), dtype, scale_inputs)
    k = randn(rng, (batch, sk, hk, d), dtype, scale_inputs)
    v = randn(rng, (batch, sk, hk, d), dtype)
    dout = randn(rng, (batch, sq, hq, d), dtype)
    dlse = rng.standard_normal((batch, hq, sq)).astype(np.float32) if with_dlse else None
    dq_, dk_, dv_, do_ = (cupy.asarray(x) for x in (q, k, v, dout))
    out, lse = cuattn.attention(dq_, dk_, dv_, return_lse=True, **kw)
    poison_cupy_pool()
    grads = cuattn.attention_backward(
        do_, dq_, dk_, dv_, out, lse, dlse=None if dlse is None else cupy.asarray(dlse), deterministic=deterministic, **kw,
    )
    grads = [g.get() for g in grads]
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, **kw)
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, dlse=dlse, **kw)
    naive = naive_attention_backward(dout, q, k, v, dtype, dlse=dlse, **kw)
    for name, g, r, n, x in zip(("dq", "dk", "dv"), grads, ref, naive, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, name
        assert not np.isnan(g.astype(np.float32)).any(), f"NaN in {name}"
        try:
            assert_attention_accuracy(g, r, n, factor=3.0, floor=1e-4)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    return grads, lse.get()


# Masks and options drawn for every case: (causal, window, align, softcap, dlse, seed).
_OPTIONS = dict(
    causal=st.booleans(),
    window=st.sampled_from([None, None, (16, 0), (40, 8), (None, 5), (0, 0)]),
    align=st.sampled_from(["bottom_right", "top_left"]),
    softcap=st.sampled_from([None, None, 5.0]),
    with_dlse=st.booleans(),
    path=st.sampled_from(BACKWARD_PATHS),
    seed=st.integers(0, 2**32 - 1),
)


def _run_drawn(batch, sq, sk, heads, d, dtype, causal, window, align, softcap, with_dlse, path, seed):
    _run(np.random.default_rng(seed), batch, sq, sk, *heads, d, dtype, with_dlse=with_dlse,
         causal=causal, window=window, align=align, softcap=softcap, path=path)


@settings(max_examples=50, deadline=None)
@given(
    batch=st.integers(1, 2),
    sq=st.sampled_from([1, 17, 113, 128, 300]),
    sk=st.sampled_from([1, 17, 113, 256, 333]),
    heads=st.sampled_from([(1, 1), (4, 1), (4, 4), (6, 2)]),
    d=st.sampled_from([8, 32, 40, 64, 96, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    **_OPTIONS,
)
def test_backward_matches_reference(**drawn):
    _run_drawn(**drawn)


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    sq=st.sampled_from([1, 17, 64, 113, 129, 300]),
    sk=st.sampled_from([1, 17, 113, 128, 256, 333]),
    heads=st.sampled_from([(1, 1), (4, 1), (6, 2)]),
    d=st.sampled_from([40, 64, 104, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    **{**_OPTIONS, "path": st.sampled_from(["default", "deterministic"])},
)
def test_hopper_kernel_buckets_backward_matches_reference(**drawn):
    """The head dims the wgmma kernels serve on Hopper (both of their paths), drawn densely."""
    _run_drawn(**drawn)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.just(1),
    sq=st.sampled_from([1, 17, 113, 200]),
    sk=st.sampled_from([1, 17, 113, 256]),
    heads=st.sampled_from([(1, 1), (4, 1), (6, 2)]),
    d=st.sampled_from([136, 160, 192, 200, 224, 256]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    **_OPTIONS,
)
def test_large_head_dim_backward_matches_reference(**drawn):
    """Above head_dim 128 the dK/dV columns are split over two CTAs."""
    _run_drawn(**drawn)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 2),
    sq=st.sampled_from([1, 17, 113, 200]),
    sk=st.sampled_from([1, 17, 113, 256]),
    heads=st.sampled_from([(1, 1), (4, 1), (6, 2)]),
    d=st.sampled_from([8, 40, 64, 128, 136, 256]),
    dtype=st.just("float32"),
    **_OPTIONS,
)
def test_float32_backward_matches_reference(**drawn):
    """float32 runs on the CUDA cores: judged against naive float32 autograd, not a 16-bit one."""
    _run_drawn(**drawn)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_backward_long_sequences_large_head_dim(dtype):
    _run(np.random.default_rng(), 1, 1023, 1023, 2, 1, 256, dtype, causal=True)
    _run(np.random.default_rng(), 1, 300, 1023, 2, 2, 200, dtype, window=(100, 20), with_dlse=True)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_long_awkward_sequences(d, causal, path):
    _run(np.random.default_rng(), 1, 1023, 1023, 4, 2, d, "bfloat16", causal=causal, path=path)
    _run(np.random.default_rng(), 1, 113, 1023, 2, 1, d, "float16", causal=causal, align="top_left", with_dlse=True, path=path)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_backward_large_scores(dtype, path):
    _run(np.random.default_rng(), 1, 128, 200, 2, 2, 64, dtype, scale_inputs=6.0, causal=True, path=path)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_fully_masked_rows_get_zero_gradients(path):
    """Bottom-right causal with seqlen_q > seqlen_k: the first rows see no key; keys past a
    top-left causal band's reach get no gradient either."""
    grads, lse = _run(np.random.default_rng(), 1, 100, 40, 2, 2, 64, "bfloat16", causal=True, path=path)
    dead = np.isneginf(lse[0, 0])
    assert dead.sum() == 60
    assert np.all(grads[0].astype(np.float32)[0, dead] == 0)
    grads, _ = _run(np.random.default_rng(), 1, 20, 90, 2, 1, 128, "float16", causal=True, align="top_left", path=path)
    assert np.all(grads[1].astype(np.float32)[0, 20:] == 0) and np.all(grads[2].astype(np.float32)[0, 20:] == 0)
    grads, lse = _run(np.random.default_rng(), 1, 100, 40, 2, 1, 40, "float32", causal=True)
    assert np.all(grads[0][0, np.isneginf(lse[0, 0])] == 0)


def test_hopper_default_backward_runs_the_fused_kernel(monkeypatch):
    """On Hopper the default backward is one pass (dQ by atomics) plus the dQ conversion;
    deterministic=True runs the dQ and dK/dV kernels. Other GPUs run the portable kernels."""
    import cupy

    from cuattn import backward, loader

    launched = []
    load = backward.load_kernel
    monkeypatch.setattr(backward, "load_kernel", lambda variant: launched.append(variant.family) or load(variant))
    rng = np.random.default_rng()
    q, k, v, do = (cupy.asarray(randn(rng, (1, 70, 2, 128), "bfloat16")) for _ in range(4))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    hopper = loader.device_arch() == "sm_90a"
    cuattn.attention_backward(do, q, k, v, out, lse)
    expected = ["backward_prep", "backward_wgmma_fused", "backward_dq_finish"] if hopper else ["backward_prep", "backward_dq", "backward_dkdv"]
    assert launched == expected
    launched.clear()
    cuattn.attention_backward(do, q, k, v, out, lse, deterministic=True)
    assert launched == (["backward_prep", "backward_wgmma_dq", "backward_wgmma_dkdv"] if hopper else expected)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype, d", [("bfloat16", 64), ("bfloat16", 128), ("bfloat16", 256), ("float32", 64)])
def test_gradients_are_bit_identical_across_runs(deterministic, dtype, d):
    """deterministic=True: every gradient bit-identical over 5 runs. The default sums dQ with
    atomics on Hopper (its last bits may vary; within a few ulps of the first run) but dK and
    dV in registers (bit-identical)."""
    import cupy

    rng = np.random.default_rng()
    q, do = (cupy.asarray(randn(rng, (2, 333, 8, d), dtype)) for _ in range(2))
    k, v = (cupy.asarray(randn(rng, (2, 333, 2, d), dtype)) for _ in range(2))
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    runs = [[g.get() for g in cuattn.attention_backward(do, q, k, v, out, lse, causal=True, deterministic=deterministic)] for _ in range(5)]
    for later in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], later):
            if deterministic or name != "dq":
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
            else:
                np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), rtol=2e-2, atol=1e-3 * np.abs(a.astype(np.float32)).max())


def test_torch_tensors_and_memory_is_linear_in_seqlen():
    """Forward + backward at seqlen 65536 (one head) allocate O(seqlen): out, lse, the
    gradients, one fp32 value per row and (the default on Hopper) one per element of q;
    torch tensors in and out."""
    import torch

    s, d = 65536, 64
    q, k, v, do = (torch.randn(1, s, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuattn.attention_backward(do, q, k, v, out, lse, causal=True)
    torch.cuda.synchronize()
    assert all(isinstance(g, torch.Tensor) and g.shape == q.shape for g in (dq, dk, dv))
    # out, dq, dk, dv; lse, delta; the fused backward's fp32 dQ accumulator; slack.
    allowed = 4 * q.nbytes + 2 * lse.nbytes + 2 * q.nbytes + (1 << 20)
    assert torch.cuda.max_memory_allocated() - base <= allowed
    rows = slice(0, 64)  # causal: the first rows only see the first keys
    qs, ks, vs, dos = (x[:, rows].float().cpu().numpy() for x in (q, k, v, do))
    ref_out, ref_lse = reference.attention(qs, ks, vs, causal=True, return_lse=True)
    ref_dq, _, _ = reference.attention_backward(dos, qs, ks, vs, ref_out, ref_lse, causal=True)
    naive_dq, _, _ = naive_attention_backward(dos, qs, ks, vs, "bfloat16", causal=True)
    assert_attention_accuracy(dq[:, rows].float().cpu().numpy(), ref_dq, naive_dq, factor=3.0, floor=1e-4)
