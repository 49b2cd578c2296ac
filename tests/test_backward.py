"""cuattn.attention_backward on the GPU against the float64 reference backward."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cuattn
from cuattn import reference
from helpers import assert_attention_accuracy, kernel_path, naive_attention_backward, poison_cupy_pool, randn, result_ulp

pytestmark = pytest.mark.gpu


# The backward's kernel paths: "default" (on Hopper the one-pass kernel, dQ by atomics, for
# float16 / bfloat16 at the wgmma head dims: its TMA form on dense rows), "copying" (the one-pass
# kernel that copies its own tiles), "deterministic" (deterministic=True: the dQ and
# dK/dV kernels), "portable" (the mma.sync kernels on any GPU) and "small" (the one-launch
# kernel where a call is small enough, else the default).
BACKWARD_PATHS = ("default", "copying", "deterministic", "portable", "small")


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
        # float32: a floor relative to the gradients' size, far under tf32's ~1e-3. 16-bit
        # dtypes: dS is rounded to the input dtype for the tensor-core matmuls (as in every
        # FlashAttention kernel), and on a tiny reduction (one visible key, a GQA group of 3)
        # the naive computation's roundings can cancel to well under one ulp of the result, so
        # the floor is one ulp at the gradient's largest magnitude (FlashAttention-3's tests
        # add a like term). Found: bf16, d=8, sq=1, sk=17, causal top-left, dlse: dk off by
        # 1.06 ulp where naive was off by 0.3.
        floor = 1e-5 * max(float(np.abs(r).max()), 1e-30) if dtype == "float32" else 1e-4 + result_ulp(r, dtype)
        try:
            assert_attention_accuracy(g, r, n, factor=3.0, floor=floor)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
    return grads, lse.get()


# Masks and options drawn for every case: (causal, window, align, softcap, dlse, seed).
_OPTIONS = dict(
    causal=st.booleans(),
    window=st.sampled_from([None, None, (16, 0), (40, 8), (None, 5), (0, 0), (2**31 - 1, None), (None, 2**31 - 1)]),
    align=st.sampled_from(["bottom_right", "top_left"]),
    softcap=st.sampled_from([None, None, 5.0]),
    with_dlse=st.booleans(),
    path=st.sampled_from(BACKWARD_PATHS),
    seed=st.integers(0, 2**32 - 1),
)


def _run_drawn(batch, sq, sk, heads, d, dtype, causal, window, align, softcap, with_dlse, path, seed):
    _run(np.random.default_rng(seed), batch, sq, sk, *heads, d, dtype, with_dlse=with_dlse,
         causal=causal, window=window, align=align, softcap=softcap, path=path)


@settings(max_examples=60, deadline=None)
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
    d=st.sampled_from([40, 64, 72, 96, 104, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    **{**_OPTIONS, "path": st.sampled_from(["default", "copying", "deterministic"])},
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
    """Above head_dim 128 the dK/dV columns are split over two CTAs (portable kernels) or two
    warpgroups (Hopper's one-pass kernel)."""
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


@pytest.mark.parametrize("path", BACKWARD_PATHS)
@pytest.mark.parametrize("seed, softcap", [(23, 5.0), (181, 5.0), (181, None)])
def test_backward_one_visible_key_with_dlse(seed, softcap, path):
    """One query that sees one key, a GQA group of 3, a gradient into lse: dK is three products
    of a rounded dS, the case where naive's error cancels below one ulp (helpers.result_ulp)."""
    _run(np.random.default_rng(seed), 1, 1, 17, 6, 2, 8, "bfloat16", with_dlse=True, causal=True, align="top_left",
         softcap=softcap, path=path)


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


@pytest.mark.parametrize("d", [64, 128])
def test_hopper_default_backward_runs_the_fused_kernel(monkeypatch, d):
    """On Hopper the default backward is one pass (dQ by atomics) plus the dQ conversion, the
    pass by TMA (backward_tma.cu; CUATTN_TMA=0: the kernel that copies its own tiles, whose dK
    and dV sums run in the same order: the same bits); deterministic=True runs the dQ and dK/dV
    kernels. Other GPUs run the portable kernels."""
    import cupy

    from cuattn import loader

    launched = []
    load = loader.load_kernel
    monkeypatch.setattr(loader, "load_kernel", lambda variant: launched.append(variant.kernel) or load(variant))
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    rng = np.random.default_rng()
    q, do = (cupy.asarray(randn(rng, (2, 300, 4, d), "bfloat16")) for _ in range(2))
    k, v = (cupy.asarray(randn(rng, (2, 300, 2, d), "bfloat16")) for _ in range(2))  # GQA 4:2
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    hopper = loader.device_arch() == "sm_90a"
    backward_loads = lambda: [f for f in dict.fromkeys(launched) if f.startswith("backward")]  # noqa: E731 (a plan is recorded twice)
    tma_grads = cuattn.attention_backward(do, q, k, v, out, lse, causal=True)
    expected = ["backward_prep", "backward_tma", "backward_dq_finish"] if hopper else ["backward_prep", "backward_dq", "backward_dkdv"]
    assert backward_loads() == expected
    for _ in range(3):  # dK and dV: each CTA sums its keys' steps in one order
        again = cuattn.attention_backward(do, q, k, v, out, lse, causal=True)
        for grad, first in zip(again[1:], tma_grads[1:]):
            cupy.testing.assert_array_equal(grad, first)
    monkeypatch.setenv("CUATTN_TMA", "0")
    launched.clear()
    grads = cuattn.attention_backward(do, q, k, v, out, lse, causal=True)
    assert backward_loads() == (["backward_prep", "backward_wgmma_fused", "backward_dq_finish"] if hopper else expected)
    for grad, tma_grad in zip(grads[1:], tma_grads[1:]):
        cupy.testing.assert_array_equal(grad, tma_grad)
    monkeypatch.delenv("CUATTN_TMA")
    launched.clear()
    cuattn.attention_backward(do, q, k, v, out, lse, deterministic=True)
    assert backward_loads() == (["backward_prep", "backward_wgmma_dq", "backward_wgmma_dkdv"] if hopper else expected)


@pytest.mark.parametrize("d, tile", [(160, 192), (192, 192), (200, 256), (256, 256)])
def test_hopper_backward_above_d128_splits_gradient_columns_over_warpgroups(monkeypatch, d, tile):
    """Above head_dim 128 the default Hopper backward is the one-pass kernel at the 192 or 256
    tile, whose two warpgroups share a CTA's 64 keys, each forming the scores of half of a step's
    queries and its share of dK, dV and dQ's columns (128 + 128, or 128 + 64 with the second
    share's dQ staged apart); the portable kernels elsewhere, and for deterministic=True. Its
    gradients match the float64 reference within the bound of the other paths, on a GQA causal
    call with ragged lengths and dlse."""
    from cuattn import loader

    launched = []
    load = loader.load_kernel
    monkeypatch.setattr(loader, "load_kernel", lambda variant: launched.append(variant.uri) or load(variant))
    rng = np.random.default_rng()
    _run(rng, 2, 300, 333, 6, 2, d, "bfloat16", causal=True, with_dlse=True)
    fused = [u for u in dict.fromkeys(launched) if u.startswith("backward_wgmma_fused")]
    assert fused == ([f"backward_wgmma_fused/bf16/d{tile}/s64wg2c1"] if loader.device_arch() == "sm_90a" else [])


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_query_backward_split_over_ctas_matches_reference(monkeypatch, d, causal):
    """GQA 8:1 over 1k query rows: few (key block, KV head) CTAs, so the TMA backward splits
    each key block's query steps over several CTAs (kernels/backward.py tma_query_splits),
    which add dK / dV into fp32 sums by atomics, rounded once; on Hopper the split is taken."""
    from cuattn import loader
    from cuattn.kernels import backward as backward_kernels

    chosen = []
    rule = backward_kernels.tma_query_splits
    monkeypatch.setattr(backward_kernels, "tma_query_splits", lambda *args: chosen.append(rule(*args)) or chosen[-1])
    _run(np.random.default_rng(d + causal), 2, 1024, 1000, 8, 1, d, "bfloat16", with_dlse=True, causal=causal)
    if loader.device_arch() == "sm_90a":
        assert chosen and max(chosen) > 1, chosen


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_without_a_plan_holds_its_accumulator_until_the_launch(monkeypatch, d, causal):
    """The path without a replayed plan (NumPy or other DLPack inputs, replay off): the dQ
    accumulator, planned first, stays allocated until the launches are queued. It was dropped
    at once, and CuPy's pool handed its memory to the fp32 dK / dV sums of the TMA backward's
    split key blocks allocated next, which the same kernel then added into."""
    from cuattn import replay

    monkeypatch.setattr(replay, "enabled", False)
    _run(np.random.default_rng(2 * d + causal), 2, 1024, 1000, 8, 1, d, "bfloat16", with_dlse=True, causal=causal)


def _serves_small(batch, sq, sk, hq, hk, d, dtype) -> bool:
    import cupy

    from cuattn import loader
    from cuattn.kernels import backward
    from cuattn.kernels.backward import BackwardGrid

    c_type = {"float16": "f16", "bfloat16": "bf16", "float32": "float"}[dtype]
    grid = BackwardGrid("dense", batch, sq, sk, hq, hk, d, batch * sq, batch * sk)
    return backward.small_serves(grid, c_type, False, False, False, lambda: loader.device_sm_count(cupy.cuda.Device().id))


@settings(max_examples=40, deadline=None)
@given(
    batch=st.integers(1, 2),
    sq=st.sampled_from([1, 17, 64, 113, 200, 256]),
    sk=st.sampled_from([1, 40, 65, 128, 256]),
    heads=st.sampled_from([(1, 1), (4, 1), (3, 3), (6, 2)]),
    d=st.sampled_from([8, 32, 40, 64, 72, 96, 128]),
    dtype=st.sampled_from(["float16", "bfloat16"]),
    causal=st.booleans(),
    window=st.sampled_from([None, None, (16, 0), (40, 8), (None, 5), (0, 0)]),
    align=st.sampled_from(["bottom_right", "top_left"]),
    softcap=st.sampled_from([None, None, 5.0]),
    with_dlse=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_small_backward_matches_reference(batch, sq, sk, heads, d, dtype, seed, **options):
    """The one-launch kernel of small calls (every draw here is one on a GPU of 96 SMs or
    more) against float64: the delta it sums itself, dQ and dK / dV CTAs side by side, GQA,
    masks, softcap, dlse."""
    assume(_serves_small(batch, sq, sk, *heads, d, dtype))
    _run_drawn(batch, sq, sk, heads, d, dtype, path="small", seed=seed, **options)


def test_small_backward_is_one_launch(monkeypatch):
    """A small call is one launch of backward_small, replayed as one, bit-identical across runs
    whether or not deterministic is asked; past its bounds (rows, one wave of CTAs, a sink)
    the kernels of larger calls run."""
    import cupy

    from cuattn import loader, replay

    launched = []
    load = loader.load_kernel
    monkeypatch.setattr(loader, "load_kernel", lambda variant: launched.append(variant.kernel) or load(variant))
    monkeypatch.delenv("CUATTN_SMALL_BACKWARD", raising=False)
    rng = np.random.default_rng()

    def kernels(shape, **kw):
        launched.clear()
        q, k, v, do = (cupy.asarray(randn(rng, shape, "bfloat16")) for _ in range(4))
        out, lse = cuattn.attention(q, k, v, return_lse=True, **kw)
        launched.clear()
        first = [g.get() for g in cuattn.attention_backward(do, q, k, v, out, lse, **kw)]
        loads = [f for f in dict.fromkeys(launched) if f.startswith("backward")]
        before = replay.counters.launches
        again = [g.get() for g in cuattn.attention_backward(do, q, k, v, out, lse, deterministic=True, **kw)]
        return loads, replay.counters.launches - before, first, again

    loads, replays, first, again = kernels((1, 128, 4, 64))
    assert loads == ["backward_small"] and replays == 1
    for name, a, b in zip(("dq", "dk", "dv"), first, again):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
    assert "backward_small" not in kernels((1, 257, 4, 64))[0]
    sms = loader.device_sm_count(cupy.cuda.Device().id)
    assert "backward_small" not in kernels((sms, 64, 1, 64))[0]  # 2 CTAs per (sequence, head): two waves
    assert kernels((sms // 2, 64, 1, 64))[0] == ["backward_small"]
    sink = cupy.asarray(rng.standard_normal(4).astype(np.float32))
    assert "backward_small" not in kernels((1, 128, 4, 64), sink=sink)[0]
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    assert "backward_small" not in kernels((1, 128, 4, 64))[0]


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
    gradients, one fp32 value per row and (the default on Hopper) one per element of q, and
    where the TMA backward splits its key blocks over CTAs (one head: few of them) fp32 sums of
    dK and dV; torch tensors in and out."""
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
    # out, dq, dk, dv; lse, delta; the fused backward's fp32 dQ accumulator; fp32 dK / dV sums; slack.
    allowed = 4 * q.nbytes + 2 * lse.nbytes + 2 * q.nbytes + 2 * (k.nbytes + v.nbytes) + (1 << 20)
    assert torch.cuda.max_memory_allocated() - base <= allowed
    rows = slice(0, 64)  # causal: the first rows only see the first keys
    qs, ks, vs, dos = (x[:, rows].float().cpu().numpy() for x in (q, k, v, do))
    ref_out, ref_lse = reference.attention(qs, ks, vs, causal=True, return_lse=True)
    ref_dq, _, _ = reference.attention_backward(dos, qs, ks, vs, ref_out, ref_lse, causal=True)
    naive_dq, _, _ = naive_attention_backward(dos, qs, ks, vs, "bfloat16", causal=True)
    assert_attention_accuracy(dq[:, rows].float().cpu().numpy(), ref_dq, naive_dq, factor=3.0, floor=1e-4)


def _check_backward_batches(grads, dout, q, k, v, out, lse, batches, **kw):
    dtype = np.dtype(q.dtype).name
    for b in batches:
        qb, kb, vb, dob = (x[b:b + 1].get() for x in (q, k, v, dout))
        ref_out, ref_lse = reference.attention(qb, kb, vb, return_lse=True, **kw)
        ref = reference.attention_backward(dob, qb, kb, vb, ref_out, ref_lse, **kw)
        naive = naive_attention_backward(dob, qb, kb, vb, dtype, **kw)
        for name, g, r, n in zip(("dq", "dk", "dv"), grads, ref, naive):
            try:
                assert_attention_accuracy(g[b:b + 1].get(), r, n, factor=3.0, floor=1e-4)
            except AssertionError as exc:
                raise AssertionError(f"batch {b} {name}: {exc}") from None


@pytest.mark.parametrize("dtype, d, path", [("bfloat16", 64, "default"), ("float16", 128, "deterministic"), ("bfloat16", 256, "portable"), ("float32", 64, "default")])
def test_backward_batches_past_the_grid_limit(dtype, d, path):
    """batch > 65535: every backward kernel launches in slices of gridDim.z."""
    import cupy

    rng = np.random.default_rng()
    batch = 70000  # 70 copies of 1000 drawn batches (batch b holds drawn batch b % 1000)
    q, dout = (cupy.asarray(np.tile(randn(rng, (1000, 8, 2, d), dtype), (70, 1, 1, 1))) for _ in range(2))
    k, v = (cupy.asarray(np.tile(randn(rng, (1000, 8, 1, d), dtype), (70, 1, 1, 1))) for _ in range(2))
    with kernel_path(path):
        out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
        poison_cupy_pool()
        grads = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=path == "deterministic")
    _check_backward_batches(grads, dout, q, k, v, out, lse, [0, 65534, 65535, batch - 1], causal=True)


@pytest.mark.parametrize("path", BACKWARD_PATHS)
def test_backward_windows_past_the_sequences_are_unbounded(path):
    """window=(2^31 - 1, None) gave dK = dV = 0; any bound past both sequences is unbounded."""
    for window in [(2**31 - 1, None), (None, 2**31 - 1), (10**12, 10**12)]:
        grads, _ = _run(np.random.default_rng(), 1, 113, 200, 4, 2, 64, "bfloat16", path=path, window=window)
        assert all(np.abs(g.astype(np.float32)).max() > 0 for g in grads)
    _run(np.random.default_rng(), 1, 113, 200, 4, 2, 64, "float32", window=(2**31 - 1, None))


def test_no_query_heads_give_zero_kv_gradients():
    """heads_q = 0 with heads_kv > 0: dK and dV are zeros (they were never written)."""
    import cupy

    k = cupy.asarray(randn(np.random.default_rng(), (2, 7, 2, 64), "bfloat16"))
    q = cupy.empty((2, 5, 0, 64), k.dtype)
    out, lse = cuattn.attention(q, k, k, return_lse=True)
    poison_cupy_pool(k.nbytes * 4)
    dq, dk, dv = cuattn.attention_backward(out, q, k, k, out, lse)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    assert bool((dk == 0).all()) and bool((dv == 0).all())


def test_no_query_rows_give_zero_kv_gradients_when_replayed():
    """seqlen_q = 0 with keys: every scratch array (delta) is empty, and the replayed plan of the
    second call still has an address for it (the dK/dV kernel's parameters name it)."""
    import cupy

    k = cupy.asarray(randn(np.random.default_rng(), (2, 7, 2, 64), "bfloat16"))
    q = cupy.empty((2, 0, 4, 64), k.dtype)
    out, lse = cuattn.attention(q, k, k, return_lse=True)
    for _ in range(2):
        poison_cupy_pool(k.nbytes * 4)
        dq, dk, dv = cuattn.attention_backward(out, q, k, k, out, lse)
        assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
        assert bool((dk == 0).all()) and bool((dv == 0).all())


@pytest.mark.parametrize("d", [128, 160, 192, 224, 256])
def test_backward_tiles_fit_a_99kb_device(monkeypatch, d):
    """RTX 30xx / 40xx, A10, L4, L40S opt in to 99 KB of shared memory per block: the portable
    backward picks smaller streamed blocks there (and, at head_dim 256, reads dK/dV's row
    statistics from global memory). Run here under that limit and checked like any other."""
    from cuattn import backward, loader
    from cuattn.kernels import backward as backward_plan
    from cuattn.kernels.variant import head_dim_bucket

    monkeypatch.setattr(backward, "device_smem_limit", lambda device_id: 101376)
    launched = []
    load = loader.load_kernel
    monkeypatch.setattr(loader, "load_kernel", lambda variant: launched.append(variant) or load(variant))
    _run(np.random.default_rng(), 1, 200, 333, 4, 2, d, "bfloat16", path="portable", causal=True, with_dlse=True)
    _run(np.random.default_rng(), 2, 113, 65, 2, 1, d, "float16", path="portable", window=(40, 8), softcap=5.0)
    tiled = [v for v in launched if v.kernel in ("backward_dq", "backward_dkdv")]
    assert tiled and all(v.dynamic_smem <= 101376 for v in tiled)
    bucket = head_dim_bucket(d)
    defaults = [backward_plan.variant(f, "bf16", bucket, False) for f in ("backward_dq", "backward_dkdv")]
    assert any(v.dynamic_smem > 101376 for v in defaults) == (d != 160)  # the limit changed the tiles
