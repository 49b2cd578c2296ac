"""Bad arguments raise TypeError / ValueError naming the argument, before any launch
(these run without a GPU: NumPy inputs are only uploaded after validation)."""

import numpy as np
import pytest

import cuattn
from cuattn import boundary, loader, validation
from cuattn.kernels import forward
from cuattn.kernels.variant import MAX_GRID_YZ, Variant, tile_launches
from cuattn.options import LOG2E, AttnOptions, score_factors


def flat_mask_options(**user) -> dict:
    """The op table's options from the public keywords, as the adapters form them."""
    return AttnOptions.from_user(**user).flat()


def _kernel_bounds(causal, window, seqlen_q, seqlen_k) -> tuple[int, int, int]:
    """(window_left, window_right, diagonal_offset) as AttnParams gets them."""
    fields = AttnOptions.from_user(causal, window, head_dim=64).kernel_fields(seqlen_q, seqlen_k)
    return fields["window_left"], fields["window_right"], fields["diagonal_offset"]


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
    with pytest.raises(TypeError, match="must be a CuPy, NumPy, PyTorch or JAX array"):
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
    monkeypatch.setattr(boundary._ValidationContext, "device_index", lambda self: 0)
    monkeypatch.setattr(loader, "device_sm_count", lambda device_id: 132)
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")

    q, kv = _Meta((2, 5, 4, 64), np.float16), _Meta((2, 7, 2, 64), np.float16)
    options = flat_mask_options(causal=True, head_dim=64)
    assert boundary.validate(ops.OPS["attention"].call, q, kv, kv, **options) == [((2, 5, 4, 64), np.float16), ((2, 4, 5), np.float32)]
    lse = _Meta((2, 4, 5), np.float32)
    backward = lambda: boundary.validate(ops.OPS["attention_backward"].call, q, q, kv, kv, q, lse, None, deterministic=False, **options)  # noqa: E731
    grads = [((2, 5, 4, 64), np.float16), ((2, 7, 2, 64), np.float16), ((2, 7, 2, 64), np.float16)]
    assert backward() == grads + [((2, 4, 5), np.float32)]  # and delta
    monkeypatch.delenv("CUATTN_SMALL_BACKWARD")
    assert backward() == grads  # the one-launch kernel of small calls sums its own delta
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        boundary.validate(ops.OPS["attention"].call, q, _Meta((2, 7, 3, 64), np.float16), _Meta((2, 7, 3, 64), np.float16), **options)


def test_validation_reports_the_fused_backward_scratch_on_hopper(monkeypatch):
    """On a Hopper device the default backward also allocates its fp32 dQ accumulator (batch,
    heads_q, seqlen_q rounded up to 64, head-dim bucket), which XLA must then provide;
    deterministic=True does not."""
    from cuattn import boundary, ops

    monkeypatch.setattr(boundary._ValidationContext, "arch", lambda self: "sm_90a")
    monkeypatch.delenv("CUATTN_WGMMA", raising=False)
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")  # a call this small would take backward_small
    q, kv, lse = _Meta((2, 5, 4, 40), np.float16), _Meta((2, 7, 2, 40), np.float16), _Meta((2, 4, 5), np.float32)
    options = flat_mask_options(causal=True, head_dim=40)
    run = lambda deterministic: boundary.validate(  # noqa: E731
        ops.OPS["attention_backward"].call, q, q, kv, kv, q, lse, None, deterministic=deterministic, **options)
    assert run(False)[4:] == [((2, 4, 64, 64), np.float32)]
    assert len(run(True)) == 4


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"window": (1.5, 2)}, TypeError, "window bounds must be integers"),
        ({"window": (3, 2.0)}, TypeError, "window bounds must be integers"),
        ({"window": (True, None)}, TypeError, "window bounds must be integers"),
        ({"softcap": float("inf")}, ValueError, "softcap must be positive, finite"),
        ({"softcap": 1e39}, ValueError, "softcap must be positive, finite"),
        ({"softcap": 1e3, "scale": 1e-36}, ValueError, "scale / softcap"),
        ({"scale": 1e-50}, ValueError, "scale must be positive, finite"),
        ({"scale": 1e39}, ValueError, "scale must be positive, finite"),
        ({"scale": "a"}, TypeError, "scale must be a real number"),
        ({"softcap": "a"}, TypeError, "softcap must be a real number"),
        ({"return_lse": "x"}, TypeError, "return_lse must be a bool"),
        ({"return_lse": 1}, TypeError, "return_lse must be a bool"),
    ],
)
def test_attention_options_are_checked_as_the_kernels_use_them(kwargs, exc, match):
    """Window bounds are integers; scale and softcap are float32 in the kernels, so they are
    checked in float32 (a value that rounds to 0 or inf there is refused)."""
    with pytest.raises(exc, match=match):
        cuattn.attention(*_qkv(), **kwargs)


def test_float32_options_reach_the_kernels_unchanged():
    assert score_factors(None, None, 64) == (0.125, 0.0)
    assert score_factors(2.0, 30.0, 64) == (2.0, 30.0)
    assert score_factors(np.float32(0.5), None, 64) == (0.5, 0.0)


@pytest.mark.parametrize(
    "window, causal, expected",
    [
        ((None, 2**31 - 1), False, (-1, -1)),  # past both sequences: unbounded
        ((2**31 - 1, None), False, (-1, -1)),
        ((2**40, 2**40), True, (-1, 0)),
        ((9, 9), False, (9, 9)),  # seqlen_q + seqlen_k = 9: still a bound
        ((10, 3), False, (-1, 3)),
    ],
)
def test_window_bounds_are_clamped_to_the_sequences(window, causal, expected):
    """What reaches the kernels' int32 index arithmetic is at most seqlen_q + seqlen_k."""
    assert _kernel_bounds(causal, window, 4, 5)[:2] == expected


def test_positive_window_bounds_over_more_than_2_30_positions_are_refused():
    """Such a bound added to a position could pass int32 in the kernels (a paged KV cache makes
    capacities near 2**31 cheap); a causal mask, a zero bound or an unbounded side still pass."""
    with pytest.raises(ValueError, match=r"window bounds over 1 query and 1073741824 key positions are not supported"):
        _kernel_bounds(False, (None, 2**30 - 5), 1, 2**30)
    with pytest.raises(ValueError, match=r"not supported"):
        _kernel_bounds(False, (2**30 - 5, None), 1, 2**30)
    assert _kernel_bounds(True, None, 1, 2**31 - 2)[:2] == (-1, 0)
    assert _kernel_bounds(False, (None, 2**31 - 1), 1, 2**31 - 10)[:2] == (-1, -1)  # past both: unbounded
    assert _kernel_bounds(False, (5, None), 1, 2**29 - 6)[:2] == (5, -1)


def test_backward_names_missing_arguments():
    args = _backward_args()
    for i, name in enumerate(("dout", "q", "k", "v", "out", "lse")):
        with pytest.raises(TypeError, match=f"{name} is required"):
            cuattn.attention_backward(*args[:i], None, *args[i + 1:])


def test_launch_plans_slice_large_batches():
    """gridDim.z holds at most 65535: larger batches launch in slices with a batch offset."""
    v = forward.variant("f16", 64, False)
    launches = tile_launches(v, 16, 1, 70000)
    assert [(grid, offset) for grid, _, offset in launches] == [((1, 1, 65535), 0), ((1, 1, 4465), 65535)]
    assert all(grid[1] <= 65535 and grid[2] <= 65535 for grid, _, _ in tile_launches(v, 1000, 40, 200000))
    assert sum(grid[2] for grid, _, _ in tile_launches(v, 1000, 40, 200000)) == 200000


class _Dev:
    """A device array's metadata (no memory), as the boundary describes one."""

    def __init__(self, ptr, shape, strides, dtype=np.float16):
        from cuattn.boundary import DeviceArray

        self.array = DeviceArray(ptr, shape, strides, np.dtype(dtype), None)


def test_out_may_not_overlap_k_v_or_itself():
    base, shape = 1 << 40, (2, 16, 4, 64)
    packed = (16 * 3 * 4 * 64, 3 * 4 * 64, 64, 1)  # q, k, v interleaved in one (b, s, 3, h, d) buffer
    q, k, v = (_Dev(base + i * 4 * 64 * 2, shape, packed).array for i in range(3))
    inputs = {"q": q, "k": k, "v": v}
    separate = _Dev(base + (1 << 30), shape, (16 * 256, 256, 64, 1)).array
    validation.check_writable_output("out", separate, inputs, same_as_ok="q")
    validation.check_writable_output("out", q, inputs, same_as_ok="q")  # out=q: each CTA reads its rows first
    for bad, match in [
        (k, "out overlaps k"), (v, "out overlaps v"),
        (_Dev(base + 2, shape, packed).array, "out overlaps q"),  # q shifted by one element
        (_Dev(base + (1 << 30), shape, (0, 256, 64, 1)).array, "overlapping elements"),
        (_Dev(base + (1 << 30), shape, (16 * 256, 128, 64, 1)).array, "overlapping elements"),
    ]:
        with pytest.raises(ValueError, match=match):
            validation.check_writable_output("out", bad, inputs, same_as_ok="q")


def test_adapter_options_are_checked_not_coerced():
    """The torch / JAX adapters flatten options through AttnOptions.from_user: bad values are
    refused there as in the core API, never truncated or cast."""

    with pytest.raises(TypeError, match="window bounds must be integers"):
        flat_mask_options(window=(1.5, 2), head_dim=64)
    with pytest.raises(TypeError, match="causal must be a bool"):
        flat_mask_options(causal="yes", head_dim=64)
    with pytest.raises(ValueError, match="softcap"):
        flat_mask_options(softcap=float("inf"), head_dim=64)
    with pytest.raises(TypeError, match="align must be a str"):
        flat_mask_options(align=None, head_dim=64)


# Drawn edge cases, all checked without a GPU: big batches, extreme bounds and scales, aliasing.
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 10**6), heads=st.integers(1, 2000), batch=st.integers(0, 10**6), block_m=st.sampled_from([16, 64, 128]))
def test_drawn_launch_plans_cover_every_batch_once(rows, heads, batch, block_m):
    v = Variant("test", "k", "k", "test/k", block_m=block_m, threads=128)
    launches = tile_launches(v, rows, heads, batch)
    offsets = [offset for _, _, offset in launches]
    assert offsets == list(range(0, batch, MAX_GRID_YZ))
    assert sum(grid[2] for grid, _, _ in launches) == batch
    assert all(grid == (-(-rows // block_m), heads, grid[2]) and 1 <= grid[2] <= MAX_GRID_YZ for grid, _, _ in launches)


@settings(max_examples=200, deadline=None)
@given(
    left=st.one_of(st.none(), st.integers(-1, 2**62)), right=st.one_of(st.none(), st.integers(-1, 2**62)),
    causal=st.booleans(), sq=st.integers(0, 10**6), sk=st.integers(0, 10**6),
)
def test_drawn_window_bounds_fit_int32_and_keep_their_meaning(left, right, causal, sq, sk):
    """Whatever integers are given, the kernels get bounds in [-1, seqlen_q + seqlen_k] that see
    the same keys as the reference's unclamped ones."""
    from cuattn import reference
    l, r, offset = _kernel_bounds(causal, (left, right), sq, sk)
    assert -1 <= l <= sq + sk and -1 <= r <= sq + sk
    ref_l, ref_r = reference.window_bounds(causal, (left, right))
    rows, cols = np.array([0, sq // 2, max(sq - 1, 0)]), np.array([0, sk // 3, sk // 2, max(sk - 1, 0)])
    np.testing.assert_array_equal(reference.visible(rows, cols, offset, l, r), reference.visible(rows, cols, offset, ref_l, ref_r))


@settings(max_examples=200, deadline=None)
@given(value=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10, 10**40)), which=st.sampled_from(["scale", "softcap"]))
def test_drawn_scales_are_accepted_only_where_float32_holds_them(value, which):
    kwargs = {"scale": None, "softcap": None, which: value}
    largest = float(np.finfo(np.float32).max)
    fits = float(np.finfo(np.float32).tiny) <= float(value) <= largest
    fits = fits and (which != "scale" or float(value) * LOG2E <= largest)  # the kernels use scale * log2(e) too
    fits = fits or (which == "softcap" and value == 0)  # no softcap
    try:
        scale, softcap = score_factors(kwargs["scale"], kwargs["softcap"], 64)
    except ValueError:
        assert not fits or (which == "softcap" and not 1.4e-38 < 0.125 / float(value))
        return
    assert fits and np.isfinite(np.float32(scale)) and np.float32(scale) > 0 and np.isfinite(np.float32(softcap))


@settings(max_examples=300, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 3), st.sampled_from([1, 2, 8])),
    out_strides=st.tuples(st.integers(0, 200), st.integers(0, 60), st.integers(0, 20)),
    offset=st.integers(-300, 300),
)
def test_drawn_output_overlap_matches_brute_force(shape, out_strides, offset):
    """check_writable_output refuses exactly the outputs whose element addresses collide with
    an input's or with each other (a nested layout check: it may also refuse some exotic
    non-overlapping interleavings, never accept an overlap)."""
    import itertools

    from cuattn import validation
    from cuattn.boundary import DeviceArray

    base = 1 << 20
    k_strides = (shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1)
    k = DeviceArray(base * 2, shape, k_strides, np.dtype(np.float16), None)
    out = DeviceArray(base * 2 + 2 * offset, shape, (*out_strides, 1), np.dtype(np.float16), None)

    def addresses(a):
        return [a.ptr + 2 * sum(i * s for i, s in zip(idx, a.strides)) for idx in itertools.product(*(range(n) for n in a.shape))]

    out_addr = addresses(out)
    overlapping = len(set(out_addr)) < len(out_addr) or bool(set(out_addr) & set(addresses(k)))
    try:
        validation.check_writable_output("out", out, {"k": k})
    except ValueError:
        return
    assert not overlapping


def test_missing_arrays_are_named():
    q, k, v = _qkv()
    for args, name in [((None, k, v), "q"), ((q, None, v), "k"), ((q, k, None), "v")]:
        with pytest.raises(TypeError, match=f"{name} is required"):
            cuattn.attention(*args)
    lse = np.zeros((1, 4, 4), np.float32)
    with pytest.raises(TypeError, match=r"outs\[1\] is required"):
        cuattn.merge([q, None], [lse, lse])
    with pytest.raises(TypeError, match="outs is required"):
        cuattn.merge(None, None)


def test_head_counts_past_the_grid_are_refused_before_launch():
    q = np.ones((1, 1, 65536, 8), np.float16)
    kv = np.ones((1, 1, 1, 8), np.float16)
    with pytest.raises(ValueError, match="at most 65535 query heads"):
        cuattn.attention(q, kv, kv)


def test_op_table_options_keep_their_checks():
    """The flat options of the torch / JAX ops: -1 is the only 'unbounded'; anything else
    below it is refused by the core API, not turned into 'unbounded'; huge bounds fit int64."""
    from cuattn import ops

    q, k, v = _qkv()
    options = flat_mask_options(head_dim=64)
    with pytest.raises(ValueError, match="window bounds"):
        ops.OPS["attention"].call(q, k, v, **{**options, "window_left": -7})
    assert flat_mask_options(window=(10**20, None), head_dim=64)["window_left"] == 2**62



@pytest.mark.parametrize("missing", range(4))
def test_merge_in_place_names_a_missing_array(missing):
    """merge_ checks its arguments as merge does: None is a TypeError naming it (it was an
    AttributeError from the shape checks)."""
    from types import SimpleNamespace

    from cuattn import boundary
    from cuattn.merge import merge_

    out = SimpleNamespace(shape=(1, 4, 2, 8), dtype=np.dtype(np.float16))
    lse = SimpleNamespace(shape=(1, 2, 4), dtype=np.dtype(np.float32))
    args = [out, lse, out, lse]
    args[missing] = None
    with pytest.raises(TypeError, match=f"{('out', 'lse', 'out_b', 'lse_b')[missing]} is required"):
        boundary.trace(merge_, *args)


def test_sequences_past_int32_rows_are_named_before_anything_runs():
    """The kernels count rows and keys in int32: 2**31 rows raised NumPy's OverflowError while
    packing (after the inputs were staged), and a few rows fewer wrapped inside the kernels."""
    long = np.broadcast_to(np.ones((1, 1, 1, 8), np.float16), (1, 2**31 - 255, 1, 8))  # no memory: stride 0
    one = np.ones((1, 1, 1, 8), np.float16)
    with pytest.raises(ValueError, match="k has seqlen_k = 2147483393; at most 2\\*\\*31 - 256"):
        cuattn.attention(one, long, long)
    with pytest.raises(ValueError, match="q has seqlen_q = 2147483393"):
        cuattn.attention(long, one, one)


def test_softcap_zero_is_no_softcap_as_in_flash_attention():
    """FlashAttention's default softcap is 0.0 (off); it was a ValueError here."""
    assert score_factors(None, 0.0, 64) == score_factors(None, None, 64)
    assert score_factors(0.5, 0, 64) == (0.5, 0.0)
    assert AttnOptions.from_user(True, None, "bottom_right", None, 0.0, head_dim=64) == AttnOptions.from_user(
        True, None, "bottom_right", None, None, head_dim=64)
    with pytest.raises(ValueError, match="softcap must be positive"):
        score_factors(None, -0.0001, 64)


@pytest.mark.parametrize("seed", [True, 1.5, "x", 2.0])
def test_a_seed_that_is_neither_int_nor_array_is_named(seed):
    """It was refused as 'not a CuPy, NumPy, PyTorch or JAX array', not saying an int is allowed."""
    one = np.ones((1, 1, 1, 8), np.float16)
    with pytest.raises(TypeError, match=r"dropout_seed must be an int in \[0, 2\*\*64\) or an 8-byte array, got"):
        cuattn.attention(one, one, one, dropout_p=0.1, dropout_seed=seed)
