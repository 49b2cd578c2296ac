"""The host fast path on the GPU: replayed calls give the full path's results bit for bit,
bad input gives the full path's errors after good input was cached, and CUDA-graph capture
works through it (CuPy, PyTorch)."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import replay

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from helpers import poison_cupy_pool, randn  # noqa: E402


def _cupy_inputs(rng, shape_q, shape_kv, dtype):
    return [cupy.asarray(randn(rng, s, dtype)) for s in (shape_q, shape_kv, shape_kv)]


def _full_path(monkeypatch, fn):
    """fn() with the fast path off."""
    with monkeypatch.context() as m:
        m.setattr(replay, "enabled", False)
        return fn()


def _same(a, b):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        np.testing.assert_array_equal(cupy.asnumpy(x).view(np.uint8), cupy.asnumpy(y).view(np.uint8))


@pytest.mark.parametrize(
    "shape_q, shape_kv, dtype, options",
    [
        ((2, 113, 8, 64), (2, 300, 2, 64), "bfloat16", {"causal": True}),
        ((1, 1, 4, 128), (1, 1023, 4, 128), "float16", {"window": (100, None), "return_lse": True}),
        ((3, 65, 2, 256), (3, 65, 1, 256), "bfloat16", {"softcap": 20.0, "align": "top_left", "causal": True}),
        ((1, 40, 2, 40), (1, 17, 2, 40), "float32", {"scale": 0.3, "return_lse": True}),
    ],
)
def test_replayed_forward_is_the_full_path_bit_for_bit(monkeypatch, shape_q, shape_kv, dtype, options):
    replay.clear()
    rng = np.random.default_rng(0)
    for call in range(3):  # the first call records; later ones replay with new arrays
        q, k, v = _cupy_inputs(rng, shape_q, shape_kv, dtype)
        poison_cupy_pool()
        before = replay.counters.replays
        got = cuattn.attention(q, k, v, **options)
        assert replay.counters.replays == before + 1
        _same(got, _full_path(monkeypatch, lambda: cuattn.attention(q, k, v, **options)))


@pytest.mark.parametrize("dtype, head_dim", [("bfloat16", 64), ("float16", 128), ("float32", 32)])
def test_replayed_backward_and_merge_are_the_full_path_bit_for_bit(monkeypatch, dtype, head_dim):
    replay.clear()
    rng = np.random.default_rng(1)
    for _ in range(2):
        q, k, v = _cupy_inputs(rng, (2, 77, 4, head_dim), (2, 77, 2, head_dim), dtype)
        dout = cupy.asarray(randn(rng, q.shape, dtype))
        out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
        dlse = cupy.asarray(randn(rng, lse.shape, "float32"))
        poison_cupy_pool()
        grads = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True, dlse=dlse, deterministic=True)
        _same(grads, _full_path(monkeypatch, lambda: cuattn.attention_backward(
            dout, q, k, v, out, lse, causal=True, dlse=dlse, deterministic=True)))
        parts = [cuattn.attention(q, k[:, i::2], v[:, i::2], return_lse=True) for i in range(2)]
        outs, lses = [p[0] for p in parts], [p[1] for p in parts]
        _same(cuattn.merge(outs, lses), _full_path(monkeypatch, lambda: cuattn.merge(outs, lses)))
        stacked, stacked_lse = cupy.stack(outs), cupy.stack(lses)
        _same(cuattn.merge(stacked, stacked_lse), _full_path(monkeypatch, lambda: cuattn.merge(stacked, stacked_lse)))
        acc, acc_lse = outs[0].copy(), lses[0].copy()
        ref = _full_path(monkeypatch, lambda: cuattn.merge(outs, lses))
        assert cuattn.merge_(acc, acc_lse, outs[1], lses[1])[0] is acc
        _same((acc, acc_lse), ref)
    assert replay.counters.replays > 0


def test_bad_input_after_good_input_was_cached_gives_the_full_paths_errors():
    rng = np.random.default_rng(2)
    q, k, v = _cupy_inputs(rng, (1, 64, 4, 64), (1, 64, 4, 64), "float16")
    cuattn.attention(q, k, v)
    cuattn.attention(q, k, v)
    flat = cupy.asarray(randn(rng, (1 + q.size,), "float16"))
    misaligned = flat[1:].reshape(q.shape)  # 2 bytes past a 16-byte boundary
    with pytest.raises(ValueError, match="16 bytes"):
        cuattn.attention(misaligned, k, v)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuattn.attention(q, k, v, causal=1)
    with pytest.raises(TypeError, match="dtype"):
        cuattn.attention(q, k, v.astype(np.float32))
    with pytest.raises(ValueError, match="unit stride"):
        cuattn.attention(q, k, cupy.asarray(randn(rng, (1, 64, 4, 128), "float16"))[..., ::2])
    if cupy.cuda.runtime.getDeviceCount() > 1:
        with cupy.cuda.Device(1):
            k1 = cupy.asarray(k)
        with pytest.raises(ValueError, match="device"):
            cuattn.attention(q, k1, v)


def test_cupy_graph_capture_of_forward_backward_and_merge():
    rng = np.random.default_rng(3)
    q, k, v = _cupy_inputs(rng, (2, 96, 4, 64), (2, 96, 4, 64), "bfloat16")
    dout = cupy.asarray(randn(rng, q.shape, "bfloat16"))
    stream = cupy.cuda.Stream(non_blocking=True)

    def step():
        out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
        grads = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
        return out, lse, grads, cuattn.merge([out, out], [lse, lse])

    with stream:
        step()  # records the plans and warms the pool
        stream.begin_capture()
        captured = step()
        graph = stream.end_capture()
        for x, seed in ((q, 4), (k, 5), (v, 6), (dout, 7)):
            x[...] = cupy.asarray(randn(np.random.default_rng(seed), x.shape, "bfloat16"))
        graph.launch()
        stream.synchronize()
        eager = step()
        stream.synchronize()
    out, lse, grads, merged = captured
    _same((out, lse, *grads, *merged), (eager[0], eager[1], *eager[2], *eager[3]))


def test_torch_graph_capture_and_replay_match_eager():
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        ct.attention(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out, lse = ct.attention(q, k, v, causal=True, return_lse=True)
    for x in (q, k, v):
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
    graph.replay()
    with torch.no_grad():
        ref, ref_lse = ct.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)


def test_torch_direct_and_dispatched_paths_agree(monkeypatch):
    """No-grad eager calls skip the dispatcher; calls that record a gradient go through the op.
    Both give the same values, and the eager backward (direct) matches the op's."""
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 77, 4, 64, device="cuda", dtype=torch.float16, generator=g, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        direct = ct.attention(q, k, v, window=(8, 8))
    dispatched = ct.attention(q, k, v, window=(8, 8))
    assert torch.equal(direct, dispatched) and dispatched.grad_fn is not None
    torch.use_deterministic_algorithms(True)
    try:
        grads = torch.autograd.grad(dispatched.float().square().sum(), (q, k, v))
        with monkeypatch.context() as m:
            m.setattr(ct, "_eager", lambda *t: False)
            again = ct.attention(q, k, v, window=(8, 8))
            op_grads = torch.autograd.grad(again.float().square().sum(), (q, k, v))
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(grads, op_grads):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="causal must be a bool"), torch.no_grad():
        ct.attention(q, k, v, causal=1)
    with pytest.raises(ValueError, match="cuda"), torch.no_grad():
        ct.attention(q.detach().cpu(), k.detach().cpu(), v.detach().cpu())


def test_jax_jit_replays_its_plan_with_new_buffers(monkeypatch):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuattn.jax as cj

    rng = np.random.default_rng(8)
    make = lambda: [jnp.asarray(randn(rng, (2, 50, 4, 64), "float32"), jnp.bfloat16) for _ in range(3)]  # noqa: E731
    forward = jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True, return_lse=True))
    grad = jax.jit(jax.grad(lambda q, k, v: cj.attention(q, k, v, causal=True).astype(jnp.float32).sum(), argnums=(0, 1, 2)))
    before = replay.counters.replays
    for _ in range(3):
        q, k, v = make()
        got = forward(q, k, v), grad(q, k, v)
        with monkeypatch.context() as m:
            m.setattr(replay, "enabled", False)
            full = jax.block_until_ready(jax.jit(lambda q, k, v: cj.attention(q, k, v, causal=True, return_lse=True))(q, k, v))
        for a, b in zip(got[0], full):
            np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))
        assert all(np.isfinite(np.asarray(g.astype(jnp.float32))).all() for g in got[1])
    assert replay.counters.replays >= before + 6


def test_torch_gradient_through_lse_alone_and_jax_call_without_dlse(monkeypatch):
    """An expanded dlse (lse.sum()) is made kernel-ready in the eager backward; a JAX op call
    with an absent optional array (dlse=None) replays."""
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(1, 33, 2, 64, device="cuda", dtype=torch.float16, generator=g, requires_grad=True) for _ in range(3))
    grads = torch.autograd.grad(ct.attention(q, k, v, return_lse=True)[1].sum(), (q, k, v))
    with monkeypatch.context() as m:
        m.setattr(ct, "_eager", lambda *t: False)
        op_grads = torch.autograd.grad(ct.attention(q, k, v, return_lse=True)[1].sum(), (q, k, v))
    for a, b in zip(grads, op_grads):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)

    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuattn.jax as cj

    rng = np.random.default_rng(9)
    jq, jk, jv, jdout = (jnp.asarray(randn(rng, (1, 33, 2, 64), "float32"), jnp.float16) for _ in range(4))
    out, lse = cj.attention(jq, jk, jv, return_lse=True)
    options = dict(causal=False, window_left=-1, window_right=-1, align="bottom_right", scale=0.125, softcap=0.0, deterministic=True)
    run = jax.jit(lambda *a: cj.call("attention_backward", *a, None, **options))
    before = replay.counters.replays
    got = [run(jdout, jq, jk, jv, out, lse) for _ in range(2)]
    assert replay.counters.replays >= before + 2
    ref = cuattn.attention_backward(*(cupy.asarray(np.asarray(x)) for x in (jdout, jq, jk, jv, out, lse)), scale=0.125, deterministic=True)
    for a, b in zip(got[1], ref):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), cupy.asnumpy(b).view(np.uint16))


# (shape_q, shape_kv, dtype, options): the backward's paths whose stores reach given gradients
# differently: backward_small; the default one pass (dQ through an accumulator); the
# deterministic kernels; GQA 16:2, whose TMA backward splits key blocks into fp32 sums rounded
# by sum_rows; sink tokens beside a window (dQ summed over two key ranges); float32; no query
# rows; no query heads.
GIVEN_GRAD_CASES = [
    ((1, 100, 4, 64), (1, 100, 4, 64), "bfloat16", {}),
    ((2, 300, 4, 128), (2, 333, 2, 128), "float16", {"causal": True}),
    ((2, 300, 4, 128), (2, 333, 2, 128), "float16", {"causal": True, "deterministic": True}),
    ((4, 1024, 16, 128), (4, 1024, 2, 128), "bfloat16", {"causal": True}),
    ((1, 300, 4, 64), (1, 300, 2, 64), "bfloat16", {"causal": True, "window": (64, 0), "sink_tokens": 4}),
    ((1, 77, 2, 64), (1, 50, 2, 64), "float32", {}),
    ((2, 0, 4, 64), (2, 5, 2, 64), "float16", {}),
    ((2, 5, 0, 64), (2, 5, 2, 64), "float16", {}),  # no query head: dK / dV zero-filled by the framework (rows apart)
]


@pytest.mark.parametrize("shape_q, shape_kv, dtype, options", GIVEN_GRAD_CASES)
def test_gradients_land_in_given_slices_of_packed_buffers(shape_q, shape_kv, dtype, options):
    """dq= / dk= / dv= as slices of NaN-poisoned packed buffers ((batch, seqlen, 2, heads, d):
    dq in slot 0, dk and dv interleaved): each call, recorded or replayed, writes them (equal to
    the allocating call's gradients, bit for bit on deterministic paths, within two ulps where
    atomics order fp32 sums) and nothing else (dq's slot 1 stays NaN)."""
    from helpers import result_ulp

    replay.clear()
    rng = np.random.default_rng(4)
    q, k, v = _cupy_inputs(rng, shape_q, shape_kv, dtype)
    dout = cupy.asarray(randn(rng, shape_q, dtype))
    mask = {key: x for key, x in options.items() if key != "deterministic"}
    out, lse = cuattn.attention(q, k, v, return_lse=True, **mask)
    expected = [g.get() for g in cuattn.attention_backward(dout, q, k, v, out, lse, **options)]
    replays = replay.counters.replays
    cuattn.attention_backward(dout, q, k, v, out, lse, **options)
    replayed = replay.counters.replays - replays  # 0 where the path is not replayable (a memset)
    exact = options.get("deterministic") or shape_q[1] <= 100 or dtype == "float32"
    for call in range(3):
        dq_buf = cupy.full((shape_q[0], shape_q[1], 2, *shape_q[2:]), np.nan, dtype=q.dtype)
        dkv_buf = cupy.full((shape_kv[0], shape_kv[1], 2, *shape_kv[2:]), np.nan, dtype=q.dtype)
        given = dict(dq=dq_buf[:, :, 0], dk=dkv_buf[:, :, 0], dv=dkv_buf[:, :, 1])
        replays = replay.counters.replays
        grads = cuattn.attention_backward(dout, q, k, v, out, lse, **options, **given)
        assert all(g is given[name] for g, name in zip(grads, ("dq", "dk", "dv")))
        if call:
            assert replay.counters.replays == replays + replayed  # as often as without given gradients
        for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
            got = g.get()
            if exact:
                np.testing.assert_array_equal(got.view(np.uint8), e.view(np.uint8), err_msg=name)
            else:
                assert not np.isnan(got.astype(np.float32)).any(), name
                np.testing.assert_allclose(got.astype(np.float32), e.astype(np.float32), rtol=0, atol=2 * result_ulp(e, dtype), err_msg=name)
        assert bool(cupy.isnan(dq_buf[:, :, 1]).all())


def test_given_gradients_and_out_are_checked_on_every_call():
    """Overlaps, shapes, dtypes and layouts of dq= / dk= / dv= and out= raise the full path's
    errors, also after a good call of the same shapes and strides was cached."""
    rng = np.random.default_rng(5)
    qkv = cupy.asarray(randn(rng, (1, 64, 3, 4, 64), "float16"))
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    dout = cupy.asarray(randn(rng, q.shape, "float16"))
    out, lse = cuattn.attention(q, k, v, return_lse=True)
    spare = cupy.empty_like(qkv)
    good = dict(dq=spare[:, :, 0], dk=spare[:, :, 1], dv=spare[:, :, 2])
    for _ in range(2):  # the second round after good calls of the same signatures were cached
        cuattn.attention_backward(dout, q, k, v, out, lse, **good)
        cuattn.attention(q, k, v, out=spare[:, :, 0])
        with pytest.raises(ValueError, match="dq overlaps q"):
            cuattn.attention_backward(dout, q, k, v, out, lse, **{**good, "dq": qkv[:, :, 0]})
        with pytest.raises(ValueError, match="dv overlaps v"):
            cuattn.attention_backward(dout, q, k, v, out, lse, **{**good, "dv": qkv[:, :, 2]})
        with pytest.raises(ValueError, match="dq overlaps dk"):
            cuattn.attention_backward(dout, q, k, v, out, lse, **{**good, "dk": spare[:, :, 0]})
        with pytest.raises(ValueError, match="out overlaps k"):
            cuattn.attention(q, k, v, out=qkv[:, :, 1])
    assert cuattn.attention(q, k, v, out=q) is q  # the very same array as q is allowed
    with pytest.raises(ValueError, match="dq has shape"):
        cuattn.attention_backward(dout, q, k, v, out, lse, dq=cupy.empty((1, 64, 2, 64), np.float16))
    with pytest.raises(TypeError, match="dk has dtype float32"):
        cuattn.attention_backward(dout, q, k, v, out, lse, dk=cupy.empty(k.shape, np.float32))
    with pytest.raises(ValueError, match="contiguous heads"):
        cuattn.attention_backward(dout, q, k, v, out, lse, dv=cupy.empty((1, 64, 4, 128), np.float16)[..., :64])
    with pytest.raises(ValueError, match="overlapping elements"):
        cuattn.attention_backward(dout, q, k, v, out, lse, dq=cupy.broadcast_to(cupy.empty((1, 1, 4, 64), np.float16), q.shape))
    with pytest.raises(TypeError, match="written in place"):
        cuattn.attention_backward(*(x.get() for x in (dout, q, k, v, out, lse)), dq=np.empty(q.shape, np.float16))


def test_torch_tensors_take_given_gradients():
    torch = pytest.importorskip("torch")
    q, k, v, dout = (torch.randn(2, 50, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = cuattn.attention(q, k, v, causal=True, return_lse=True)
    expected = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True)
    for _ in range(2):
        dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(3))
        grads = cuattn.attention_backward(dout, q, k, v, out, lse, causal=True, deterministic=True, dq=dq, dk=dk, dv=dv)
        assert grads[0] is dq and grads[1] is dk and grads[2] is dv
        for g, e in zip(grads, expected):
            assert torch.equal(g, e)


@pytest.mark.parametrize("heads_q, heads_kv, deterministic", [(4, 2, True), (4, 2, False), (0, 2, True)])
def test_varlen_gradients_land_in_given_slices_and_out_is_replayed(heads_q, heads_kv, deterministic):
    """attention_varlen_backward's dq= / dk= / dv= (slices of packed (total, 2, heads, d)
    buffers, NaN-poisoned) and attention_varlen's out=: written on every call, recorded or
    replayed, as the allocating calls write them (no query head: dK / dV zero-filled)."""
    from helpers import result_ulp

    replay.clear()
    rng = np.random.default_rng(6)
    lengths = [0, 37, 128, 5]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    total = int(sum(lengths))
    q, k, v = (cupy.asarray(randn(rng, (total, h, 64), "bfloat16")) for h in (heads_q, heads_kv, heads_kv))
    dout = cupy.asarray(randn(rng, q.shape, "bfloat16"))
    args = dict(max_seqlen_q=128, max_seqlen_k=128, causal=True)
    out, lse = cuattn.attention_varlen(q, k, v, cu, cu, return_lse=True, **args)
    expected = [g.get() for g in cuattn.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, deterministic=deterministic, **args)]
    for call in range(3):
        dst = cupy.full_like(q, np.nan)
        replays = replay.counters.replays
        assert cuattn.attention_varlen(q, k, v, cu, cu, out=dst, **args) is dst
        np.testing.assert_array_equal(dst.get().view(np.uint16), out.get().view(np.uint16))
        dq_buf = cupy.full((total, 2, heads_q, 64), np.nan, dtype=q.dtype)
        dkv_buf = cupy.full((total, 2, heads_kv, 64), np.nan, dtype=q.dtype)
        given = dict(dq=dq_buf[:, 0], dk=dkv_buf[:, 0], dv=dkv_buf[:, 1])
        grads = cuattn.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, deterministic=deterministic, **args, **given)
        assert all(g is given[name] for g, name in zip(grads, ("dq", "dk", "dv")))
        if call and heads_q:
            assert replay.counters.replays == replays + 2
        for name, g, e in zip(("dq", "dk", "dv"), grads, expected):
            if deterministic:
                np.testing.assert_array_equal(g.get().view(np.uint16), e.view(np.uint16), err_msg=name)
            else:
                np.testing.assert_allclose(g.get().astype(np.float32), e.astype(np.float32), rtol=0, atol=2 * result_ulp(e, "bfloat16"), err_msg=name)
        assert bool(cupy.isnan(dq_buf[:, 1]).all())
    with pytest.raises(ValueError, match="dk overlaps k"):
        cuattn.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, **args, dk=k)
