"""The array boundary on the GPU: CuPy, NumPy, PyTorch, JAX; zero copy, dtypes, streams."""

import numpy as np
import pytest

import cuattn
from cuattn import boundary, reference
from helpers import assert_close_to_rounding, randn, to_host

pytestmark = pytest.mark.gpu


def _host_partials(rng, dtype="float32", n=2, shape=(2, 17, 3, 64)):
    b, s, h, d = shape
    return randn(rng, (n, *shape), dtype), (rng.standard_normal((n, b, h, s)) * 2).astype(np.float32)


def _check(out, lse, outs, lses, dtype):
    ref_out, ref_lse = reference.merge(outs, lses)
    assert_close_to_rounding(to_host(out), ref_out, dtype)
    np.testing.assert_allclose(to_host(lse), ref_lse, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_numpy_in_numpy_out(dtype):
    rng = np.random.default_rng()
    outs, lses = _host_partials(rng, dtype)
    out, lse = cuattn.merge(outs, lses)
    assert type(out) is np.ndarray and out.dtype == outs.dtype
    _check(out, lse, outs, lses, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cupy_zero_copy_and_output_type(dtype):
    import cupy

    rng = np.random.default_rng()
    outs, lses = _host_partials(rng, dtype)
    d = cupy.asarray(outs)
    _, wrapped = boundary.import_arrays(x=d)
    assert wrapped["x"].ptr == d.data.ptr
    out, lse = cuattn.merge(d, cupy.asarray(lses))
    assert isinstance(out, cupy.ndarray) and out.dtype == d.dtype
    _check(out, lse, outs, lses, dtype)


def test_cupy_non_default_stream():
    import cupy

    rng = np.random.default_rng()
    outs, lses = _host_partials(rng, shape=(4, 512, 8, 128))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        d_outs = cupy.empty(outs.shape, outs.dtype)
        d_lses = cupy.asarray(lses)
        cupy.cuda.runtime.memcpyAsync(d_outs.data.ptr, outs.ctypes.data, outs.nbytes, cupy.cuda.runtime.memcpyHostToDevice, stream.ptr)
        out, lse = cuattn.merge(d_outs, d_lses)  # ordered after the copy only if on `stream`
        host = out.get(stream=stream)
    stream.synchronize()
    _check(host, lse.get(), outs, lses, "float32")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_zero_copy_dtypes(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    outs, lses = _host_partials(rng, dtype)
    t_outs = torch.from_numpy(outs.astype(np.float32)).to("cuda", getattr(torch, dtype))
    t_lses = torch.from_numpy(lses).cuda()
    _, wrapped = boundary.import_arrays(x=t_outs)
    assert wrapped["x"].ptr == t_outs.data_ptr()
    out, lse = cuattn.merge(t_outs, t_lses)
    assert isinstance(out, torch.Tensor) and out.dtype == t_outs.dtype and out.device == t_outs.device
    _check(out, lse, outs, lses, dtype)
    acc_out, acc_lse = t_outs[0].clone(), t_lses[0].clone()
    ptr = acc_out.data_ptr()
    cuattn.merge_(acc_out, acc_lse, t_outs[1], t_lses[1])
    assert acc_out.data_ptr() == ptr
    _check(acc_out, acc_lse, outs, lses, dtype)


def test_torch_non_default_stream():
    """The kernel runs on torch's current stream: it must see data written there just before,
    behind a long sleep that the default stream would not wait for."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    outs, lses = _host_partials(rng, shape=(4, 256, 8, 128))
    src_outs, src_lses = torch.from_numpy(outs).cuda(), torch.from_numpy(lses).cuda()
    t_outs, t_lses = torch.zeros_like(src_outs), torch.zeros_like(src_lses)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)
        t_outs.copy_(src_outs)
        t_lses.copy_(src_lses)
        out, lse = cuattn.merge(t_outs, t_lses)
    side.synchronize()
    _check(out, lse, outs, lses, "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_in_jax_out(dtype):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    rng = np.random.default_rng()
    outs, lses = _host_partials(rng, dtype)
    j_outs, j_lses = jnp.asarray(outs), jnp.asarray(lses)
    _, wrapped = boundary.import_arrays(x=j_outs)
    assert wrapped["x"].ptr == j_outs.unsafe_buffer_pointer()
    out, lse = cuattn.merge(j_outs, j_lses)
    assert isinstance(out, jax.Array) and out.dtype == j_outs.dtype
    _check(out, lse, outs, lses, dtype)
    with pytest.raises(TypeError, match="in place"):
        cuattn.merge_(j_outs[0], j_lses[0], j_outs[1], j_lses[1])


def test_mixed_frameworks_and_wrong_devices_are_refused():
    import cupy

    torch = pytest.importorskip("torch")
    rng = np.random.default_rng()
    outs, lses = _host_partials(rng)
    with pytest.raises(TypeError, match=r"lses\[0\] is a numpy array but outs\[0\] is a cupy array"):
        cuattn.merge([cupy.asarray(outs[0]), cupy.asarray(outs[1])], [lses[0], lses[1]])
    with pytest.raises(ValueError, match="on device 'cpu'"):
        cuattn.merge(torch.from_numpy(outs), torch.from_numpy(lses))


def test_non_unit_last_stride_is_refused_on_device():
    import cupy

    outs = cupy.ones((2, 1, 3, 2, 16), np.float32)[..., ::2]
    with pytest.raises(ValueError, match="outs must have unit stride"):
        cuattn.merge(outs, cupy.zeros((2, 1, 2, 3), np.float32))
