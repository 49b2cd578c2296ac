"""Bad arguments raise TypeError / ValueError naming the argument, before any launch
(these run without a GPU: NumPy inputs are only uploaded after validation)."""

import numpy as np
import pytest

import cuattn
from cuattn import boundary


def _merge_inputs(n=2, b=1, s=3, h=2, d=8, dtype=np.float32):
    return [np.ones((b, s, h, d), dtype) for _ in range(n)], [np.zeros((b, h, s), np.float32) for _ in range(n)]


def test_merge_rejects_wrong_rank():
    outs, lses = _merge_inputs()
    outs[1] = outs[1][0]
    with pytest.raises(ValueError, match=r"outs\[1\] must have 4 dimensions"):
        cuattn.merge(outs, lses)


def test_merge_rejects_mismatched_shapes():
    outs, lses = _merge_inputs()
    lses[1] = np.zeros((1, 2, 4), np.float32)
    with pytest.raises(ValueError, match=r"lses\[1\] has shape"):
        cuattn.merge(outs, lses)


def test_merge_rejects_unsupported_dtype():
    outs, lses = _merge_inputs(dtype=np.float64)
    with pytest.raises(TypeError, match=r"outs\[0\] has dtype float64"):
        cuattn.merge(outs, lses)


def test_merge_rejects_mixed_dtypes():
    outs, lses = _merge_inputs()
    outs[1] = outs[1].astype(np.float16)
    with pytest.raises(TypeError, match=r"outs\[1\] has dtype float16 but outs\[0\]"):
        cuattn.merge(outs, lses)


def test_merge_rejects_non_float32_lse():
    outs, lses = _merge_inputs()
    lses[0] = lses[0].astype(np.float16)
    with pytest.raises(TypeError, match=r"lses\[0\] must be float32"):
        cuattn.merge(outs, lses)


def test_merge_rejects_non_unit_last_stride():
    outs, lses = _merge_inputs()
    outs[0] = np.ones((1, 3, 2, 16), np.float32)[..., ::2]
    with pytest.raises(ValueError, match=r"outs\[0\] must have unit stride"):
        cuattn.merge(outs, lses)


def test_merge_rejects_mismatched_counts_and_forms():
    outs, lses = _merge_inputs()
    with pytest.raises(ValueError, match="equal length"):
        cuattn.merge(outs, lses[:1])
    with pytest.raises(TypeError, match="both be sequences"):
        cuattn.merge(np.stack(outs), lses)
    with pytest.raises(ValueError, match="outs holds 2 partials but lses holds 3"):
        cuattn.merge(np.stack(outs), np.zeros((3, 1, 2, 3), np.float32))
    with pytest.raises(ValueError, match=r"outs must have 5 dimensions"):
        cuattn.merge(np.stack(outs)[0], np.stack(lses))


def test_merge_in_place_rejects_numpy():
    outs, lses = _merge_inputs()
    with pytest.raises(TypeError, match="in place"):
        cuattn.merge_(outs[0], lses[0], outs[1], lses[1])


def test_unknown_array_types_are_refused():
    with pytest.raises(TypeError, match="expected a CuPy, NumPy, PyTorch or JAX array"):
        cuattn.merge([[1.0]], [[0.0]])


def test_boundary_reads_numpy_metadata_without_a_gpu():
    x = np.ones((2, 5, 3, 8), np.float16)[:, ::2]
    ctx, arrays = boundary.import_arrays(x=x, y=None)
    assert ctx.framework == boundary.NUMPY and arrays["y"] is None
    a = arrays["x"]
    assert a.ptr is None and a.shape == (2, 3, 3, 8) and a.strides == (120, 48, 8, 1)


def _qkv(b=1, sq=4, sk=5, hq=4, hk=2, d=64, dtype=np.float16):
    return np.ones((b, sq, hq, d), dtype), np.ones((b, sk, hk, d), dtype), np.ones((b, sk, hk, d), dtype)


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must have 4 dimensions"),
        (lambda q, k, v: (q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)), ValueError, "multiple of heads_kv"),
        (lambda q, k, v: (q, k, v[:, :3]), ValueError, "v has shape"),
        (lambda q, k, v: (q, k[..., :32], v[..., :32]), ValueError, "k has shape"),
        (lambda q, k, v: (q.astype(np.float64), k, v), TypeError, "q has dtype float64"),
        (lambda q, k, v: (q, k.astype(np.float32), v), TypeError, "k has dtype float32 but q"),
        (lambda q, k, v: (q[..., :12], k[..., :12], v[..., :12]), ValueError, "head_dim 12 is not supported"),
        (lambda q, k, v: (np.ones((1, 4, 4, 264), np.float16), np.ones((1, 5, 2, 264), np.float16), np.ones((1, 5, 2, 264), np.float16)), ValueError, "head_dim 264"),
        (lambda q, k, v: (np.ones((1, 4, 4, 128), np.float16)[..., ::2], k, v), ValueError, "q must have unit stride"),
    ],
)
def test_attention_rejects_bad_tensors(change, exc, match):
    with pytest.raises(exc, match=match):
        cuattn.attention(*change(*_qkv()))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"align": "center"}, ValueError, "align must be"),
        ({"window": (3,)}, ValueError, "window must be"),
        ({"window": (-4, 2)}, ValueError, "window bounds"),
        ({"causal": "yes"}, TypeError, "causal must be a bool"),
        ({"softcap": -1.0}, ValueError, "softcap must be positive"),
        ({"scale": -0.5}, ValueError, "scale must be positive"),
        ({"scale": float("nan")}, ValueError, "scale must be positive"),
        ({"out": np.ones((1, 4, 4, 64), np.float16)}, TypeError, "out= is written in place"),
    ],
)
def test_attention_rejects_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cuattn.attention(*_qkv(), **kwargs)


def _backward_args(d=64, dtype=np.float16):
    q, k, v = _qkv(d=d, dtype=dtype)
    return q, q, k, v, q, np.zeros((1, 4, 4), np.float32)  # dout, q, k, v, out, lse


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (lambda a: (a[0][:, :3], *a[1:]), ValueError, "dout has shape"),
        (lambda a: (a[0].astype(np.float32), *a[1:]), TypeError, "dout has dtype"),
        (lambda a: (*a[:5], a[5][:, :2]), ValueError, "lse has shape"),
        (lambda a: (*a[:5], a[5].astype(np.float64)), TypeError, "lse must be float32"),
        (lambda a: (*a[:5], a[5][0]), ValueError, "lse must have 3 dimensions"),
        (lambda a: _backward_args(d=264), ValueError, "head_dim 264 is not supported"),
    ],
)
def test_backward_rejects_bad_arguments(change, exc, match):
    with pytest.raises(exc, match=match):
        cuattn.attention_backward(*change(_backward_args()))


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"dlse": np.zeros((1, 4, 5), np.float32)}, ValueError, "dlse has shape"),
        ({"deterministic": "yes"}, TypeError, "deterministic must be a bool"),
        ({"scale": -1.0}, ValueError, "scale must be positive"),
        ({"window": (-3, 0)}, ValueError, "window bounds"),
    ],
)
def test_backward_rejects_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cuattn.attention_backward(*_backward_args(), **kwargs)


class _Meta:
    """An argument known by shape and dtype only, as a JAX tracer is."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, np.dtype(dtype)


def test_validation_only_runs_report_allocations_and_errors_without_a_gpu(monkeypatch):
    """What the JAX adapter relies on: the op's checks run on shapes alone, and the arrays it
    would allocate (outputs, then scratch) come back in order; nothing is launched. (A
    pre-Hopper target: the next test covers the fused backward's extra scratch.)"""
    from cuattn import boundary, ops

    monkeypatch.setattr(boundary._ValidationContext, "arch", lambda self: "sm_80")

    q, kv = _Meta((2, 5, 4, 64), np.float16), _Meta((2, 7, 2, 64), np.float16)
    options = ops.flat_mask_options(causal=True, head_dim=64)
    assert boundary.validate(ops.OPS["attention"].call, q, kv, kv, **options) == [((2, 5, 4, 64), np.float16), ((2, 4, 5), np.float32)]
    lse = _Meta((2, 4, 5), np.float32)
    allocations = boundary.validate(ops.OPS["attention_backward"].call, q, q, kv, kv, q, lse, None, deterministic=False, **options)
    assert allocations == [((2, 5, 4, 64), np.float16), ((2, 7, 2, 64), np.float16), ((2, 7, 2, 64), np.float16), ((2, 4, 5), np.float32)]
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        boundary.validate(ops.OPS["attention"].call, q, _Meta((2, 7, 3, 64), np.float16), _Meta((2, 7, 3, 64), np.float16), **options)


def test_validation_reports_the_fused_backward_scratch_on_hopper(monkeypatch):
    """On a Hopper device the default backward also allocates its fp32 dQ accumulator (batch,
    heads_q, seqlen_q rounded up to 64, head-dim bucket), which XLA must then provide;
    deterministic=True does not."""
    from cuattn import boundary, ops

    monkeypatch.setattr(boundary._ValidationContext, "arch", lambda self: "sm_90a")
    monkeypatch.delenv("CUATTN_WGMMA", raising=False)
    q, kv, lse = _Meta((2, 5, 4, 40), np.float16), _Meta((2, 7, 2, 40), np.float16), _Meta((2, 4, 5), np.float32)
    options = ops.flat_mask_options(causal=True, head_dim=40)
    run = lambda deterministic: boundary.validate(  # noqa: E731
        ops.OPS["attention_backward"].call, q, q, kv, kv, q, lse, None, deterministic=deterministic, **options)
    assert run(False)[4:] == [((2, 4, 64, 64), np.float32)]
    assert len(run(True)) == 4
