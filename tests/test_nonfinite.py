"""A NaN or +inf score makes its row's out and lse NaN on every path, as the float64
reference does: the paths that merge partial results by their lse (K/V streamed in chunks,
sink tokens beside a window, the split decode) once weighed a partial whose sum was NaN 0,
and the NaN vanished with every finite key of that part."""

import numpy as np
import pytest

import cuattn
from cuattn import reference
from helpers import KERNEL_PATHS, kernel_path, randn

pytestmark = pytest.mark.gpu

BAD = [np.nan, np.inf]


def _inputs(dtype, value, key, seqlen_q=64, seqlen_k=300):
    """q with a positive first component (a key component of +inf gives +inf scores) and K/V
    whose key ``key`` of head 1 holds ``value``."""
    rng = np.random.default_rng(key)
    q, k, v = (randn(rng, (1, n, h, 64), dtype) for n, h in ((seqlen_q, 4), (seqlen_k, 2), (seqlen_k, 2)))
    q[..., 0] = np.abs(q[..., 0]) + 0.25
    k[0, key, 1, 0] = value
    return q, k, v


def _check(out, lse, ref_out, ref_lse):
    """NaN exactly in the rows the reference makes NaN (some, not all), the rest close to it."""
    out, lse = np.asarray(out).astype(np.float64), np.asarray(lse)
    undefined = np.isnan(ref_lse)
    assert undefined.any() and not undefined.all()
    np.testing.assert_array_equal(np.isnan(lse), undefined)
    rows = undefined.transpose(0, 2, 1)
    assert np.isnan(out[rows]).all() and not np.isnan(out[~rows]).any()
    np.testing.assert_allclose(out[~rows], ref_out[~rows], atol=2e-2)
    np.testing.assert_allclose(lse[~undefined], ref_lse[~undefined], atol=1e-3)


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_launch(value, path, dtype):
    import cupy

    q, k, v = _inputs(dtype, value, 20)
    kw = dict(causal=True, align="top_left")
    with kernel_path(path):
        out, lse = cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), return_lse=True, **kw)
    _check(out.get(), lse.get(), *reference.attention(q, k, v, return_lse=True, **kw))


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("key", [3, 200])  # in the first chunk, in a later one
@pytest.mark.parametrize("path", KERNEL_PATHS + ("copying",))
def test_streamed_chunks(value, key, path):
    import cupy

    q, k, v = _inputs("bfloat16", value, key, seqlen_q=300)
    kw = dict(causal=True, align="top_left")
    with kernel_path(path):
        out, lse = cuattn.attention_chunked(cupy.asarray(q), (k, v), chunk_tokens=128, return_lse=True, **kw)
    _check(out.get(), lse.get(), *reference.attention(q, k, v, return_lse=True, **kw))


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("key", [1, 250])  # a sink token, a key of the window
def test_sink_tokens_beside_a_window(value, key):
    import cupy

    q, k, v = _inputs("bfloat16", value, key, seqlen_q=300)
    kw = dict(causal=True, window=(32, 0), sink_tokens=4)
    out, lse = cuattn.attention(cupy.asarray(q), cupy.asarray(k), cupy.asarray(v), return_lse=True, **kw)
    _check(out.get(), lse.get(), *reference.attention(q, k, v, return_lse=True, **kw))


@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("page_size", [None, 16])
def test_split_decode(value, num_splits, page_size):
    """Two sequences, the bad key in the second's first split: the first stays finite."""
    import cupy

    rng = np.random.default_rng(7)
    q = randn(rng, (2, 1, 4, 64), "bfloat16")
    q[..., 0] = np.abs(q[..., 0]) + 0.25
    k, v = (randn(rng, (2, 512, 2, 64), "bfloat16") for _ in range(2))
    k[1, 5, 1, 0] = value
    lengths = np.array([400, 500], np.int32)
    table = None
    k_cache, v_cache = k, v
    if page_size is not None:
        table = np.arange(2 * 512 // page_size, dtype=np.int32).reshape(2, -1)
        k_cache, v_cache = (x.reshape(-1, page_size, 2, 64) for x in (k, v))
    out, lse = cuattn.attention_with_kvcache(
        cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), cache_seqlens=cupy.asarray(lengths),
        block_table=None if table is None else cupy.asarray(table), num_splits=num_splits, return_lse=True,
    )
    ref_out, ref_lse = reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table, return_lse=True)
    _check(out.get(), lse.get(), ref_out, ref_lse)
