"""Block-sparse attention (``block_mask=``): the mask builders, their checks and the reference
(no GPU needed); the kernels against float64 on both kernel paths and both backward modes,
skipped blocks never read, and the adapters (GPU)."""

import dataclasses
import random

import numpy as np
import pytest

import cuattn
from cuattn import block_mask as bm, reference
from helpers import (
    KERNEL_PATHS, assert_attention_accuracy, assert_every_kernel_path_has_form, kernel_path, max_err, naive_attention, naive_attention_backward, poison_cupy_pool, randn,
    to_host,
)

gpu = pytest.mark.gpu
B = bm.BLOCK_SIZE


def _random_mask(rng, sq, sk, batch=1, heads=1, density=0.4, empty_row=True):
    keep = rng.random((batch, heads, bm.blocks(sq), bm.blocks(sk))) < density
    if empty_row and keep.shape[2] > 1:
        keep[0, 0, 1] = False  # a query block that keeps nothing
    return bm.from_dense(keep, sq, sk)


def _elements(mask, sq, sk):
    """The element mask (B, H, sq, sk) of a block mask."""
    keep = mask.to_dense()
    return keep[:, :, np.arange(sq) // B][..., np.arange(sk) // B]


# --- builders and checks (host) ------------------------------------------------------------------


def test_from_dense_lists_both_ways_ascending():
    keep = np.array([[True, False, True], [False, False, False], [True, True, True]])
    m = bm.from_dense(keep, 300, 257)
    np.testing.assert_array_equal(m.kv_counts[0, 0], [2, 0, 3])
    np.testing.assert_array_equal(m.kv_indices[0, 0, 0, :2], [0, 2])
    np.testing.assert_array_equal(m.q_counts[0, 0], [2, 1, 2])
    np.testing.assert_array_equal(m.q_indices[0, 0, 2, :2], [0, 2])
    np.testing.assert_array_equal(m.to_dense()[0, 0], keep)
    assert m.kv_counts.dtype == np.int32 and m.kv_indices.dtype == np.int32
    assert m.density() == pytest.approx(5 / 9)
    m.check()


def test_from_callable_vectorized_scalar_and_per_entry():
    vectorized = bm.from_callable(lambda i, j: (i >= j) & (i - j < 2), 1000, 1000)
    scalar = bm.from_callable(lambda i, j: i >= j and i - j < 2, 1000, 1000)
    np.testing.assert_array_equal(vectorized.to_dense(), scalar.to_dense())
    assert vectorized.to_dense()[0, 0].sum() == 8 + 7
    per_entry = bm.from_callable(lambda b, h, i, j: (i + j + h + b) % 2 == 0, 256, 384, batch=2, heads=3)
    assert per_entry.shape == (2, 3, 2, 3)
    assert per_entry.to_dense()[1, 2, 0, 1] and not per_entry.to_dense()[1, 1, 0, 1]
    per_entry.check()


def test_pattern_builders():
    lg = bm.local_global(1024, 1024, window_blocks=1, global_blocks=1).to_dense()[0, 0]
    assert lg[0].all() and lg[:, 0].all() and lg[5, 4:7].all() and not lg[5, 2] and not lg[5, 7]
    causal = bm.local_global(1024, 1024, window_blocks=1, global_blocks=1, causal=True).to_dense()[0, 0]
    assert not np.triu(causal, 1).any() and causal[5, 4] and not causal[5, 3] and causal[5, 0]
    st = bm.strided(2048, 2048, local_blocks=2, stride=4).to_dense()[0, 0]
    assert st[8, 7] and st[8, 9] and st[8, 4] and st[8, 0] and st[8, 12] and not st[8, 6] and not st[8, 10]
    ids = np.repeat(np.arange(4), [100, 300, 56, 200])  # documents at 0, 100, 400, 456
    doc = bm.document(ids).to_dense()[0, 0]
    expected = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1],
                         [0, 0, 0, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(doc, expected)
    aligned = bm.document(np.repeat([3, 1], 256), causal=True).to_dense()[0, 0]
    np.testing.assert_array_equal(aligned, np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]], dtype=bool))


def test_check_finds_malformed_masks():
    good = bm.from_dense(np.tril(np.ones((3, 3), bool)), 384, 384)
    good.check()
    for field, change, match in (
        ("kv_counts", lambda a: a.__setitem__((0, 0, 0), 4), "kv_counts"),
        ("kv_indices", lambda a: a.__setitem__((0, 0, 2, slice(0, 3)), [0, 2, 1]), "ascending"),
        ("kv_indices", lambda a: a.__setitem__((0, 0, 2, 2), 3), "kv_indices"),
        ("q_indices", lambda a: a.__setitem__((0, 0, 2, 0), 1), "transposed"),
    ):
        bad = good.to({"kv_counts": np.copy, "kv_indices": np.copy, "q_counts": np.copy, "q_indices": np.copy}[field])
        change(getattr(bad, field))
        with pytest.raises(ValueError, match=match):
            bad.check()
    with pytest.raises(ValueError, match="shape"):
        bm.from_dense(np.ones((2, 2), bool), 384, 384)
    with pytest.raises(TypeError, match="bool"):
        bm.from_dense(np.ones((3, 3), np.int32), 384, 384)


def test_reference_masks_whole_blocks():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, n, 4, 16)) for n in (300, 260, 260))
    mask = _random_mask(rng, 300, 260, batch=2, heads=4)
    out, lse = reference.attention(q, k, v, block_mask=mask, causal=True, return_lse=True)
    keep = _elements(mask, 300, 260) & reference.visible(np.arange(300), np.arange(260), -40, -1, 0)[None, None]
    s = np.einsum("bmhd,bnhd->bhmn", q, k) / 4.0
    s = np.where(keep, s, -np.inf)
    m = np.where(np.isfinite(s.max(-1, keepdims=True)), s.max(-1, keepdims=True), 0)
    p = np.exp(s - m)
    den = p.sum(-1, keepdims=True)
    expected = np.einsum("bhmn,bnhd->bmhd", p / np.where(den > 0, den, 1), v)
    np.testing.assert_allclose(out, expected, atol=1e-12)
    assert np.isneginf(lse[0, 0, 128:256]).all() and (out[0, 128:256, 0] == 0).all()  # the empty query block


def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, n, 2, 8)) for n in (150, 200, 200))
    mask = bm.from_dense(np.array([[True, False], [True, True]]), 150, 200)
    w = rng.standard_normal((1, 150, 2, 8))
    out, lse = reference.attention(q, k, v, block_mask=mask, return_lse=True)
    grads = reference.attention_backward(w, q, k, v, out, lse, block_mask=mask)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        for idx in [(0, 3, 1, 2), (0, 140, 0, 5), (0, 199 if x.shape[1] == 200 else 149, 1, 7)]:
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args = lambda y: [y if a is x else a for a in (q, k, v)]  # noqa: E731
            numeric = ((reference.attention(*args(xp), block_mask=mask) - reference.attention(*args(xm), block_mask=mask)) * w).sum() / (2 * eps)
            assert abs(numeric - g[idx]) < 1e-6


# --- argument checks (before any launch) ---------------------------------------------------------


def _call_both(mask, exc, match, q=None, **kw):
    q = np.ones((2, 300, 4, 64), np.float16) if q is None else q
    k = np.ones((2, 260, 2, 64), np.float16)
    with pytest.raises(exc, match=match):
        cuattn.attention(q, k, k, block_mask=mask, **kw)
    with pytest.raises(exc, match=match):
        cuattn.attention_backward(q, q, k, k, q, np.zeros((2, 4, 300), np.float32), block_mask=mask, **kw)


def test_bad_block_masks_are_refused_before_any_launch():
    good = bm.from_dense(np.ones((3, 3), bool), 300, 260)
    _call_both(np.ones((3, 3), bool), TypeError, "block_mask must be")
    _call_both(bm.from_dense(np.ones((3, 3), bool), 300, 300), ValueError, "seqlen_k 300")
    _call_both(bm.from_dense(np.ones((1, 3, 3, 3), bool), 300, 260), ValueError, "heads_q")
    _call_both(bm.from_dense(np.ones((3, 1, 3, 3), bool), 300, 260), ValueError, "batch")
    _call_both(good.to(lambda a: a.astype(np.int64)), TypeError, "int32")
    _call_both(good.to(lambda a: np.asfortranarray(np.broadcast_to(a, (2, 4) + a.shape[2:]))), ValueError, "contiguous")
    _call_both(good, ValueError, "dropout", dropout_p=0.1, dropout_seed=1)
    _call_both(good, ValueError, "sink_tokens", window=(8, 0), sink_tokens=4)


def test_incomplete_masks_are_named():
    """A mask missing an array is a TypeError naming it, one length without the other a
    ValueError (each was an AttributeError / a TypeError from the block arithmetic)."""
    good = bm.from_dense(np.ones((3, 3), bool), 300, 260)
    with pytest.raises(TypeError, match="block_mask.kv_counts is required"):
        cuattn.attention(np.ones((2, 300, 4, 64), np.float16), *[np.ones((2, 260, 2, 64), np.float16)] * 2,
                         block_mask=bm.BlockMask(None, None, None, None, 300, 260))
    with pytest.raises(ValueError, match="seqlen_q and seqlen_k go together"):
        bm.BlockMask(*good.arrays, 300, None).check()


def test_a_wider_numpy_mask_moves_as_the_int32_it_was_checked_as():
    """BlockMask.to checked an int64 NumPy mask as int32 but handed convert the int64 arrays,
    which the call then refused (block_mask.kv_counts must be int32)."""
    mask = bm.local_global(300, 260, window_blocks=1)
    wide = mask.to(lambda a: a.astype(np.int64))
    moved = wide.to(np.copy)
    assert all(a.dtype == np.int32 for a in moved.arrays)
    assert all(np.array_equal(a, b) for a, b in zip(moved.arrays, mask.arrays))


def _edited(mask, name, edit):
    """A copy of ``mask`` with ``edit`` applied to the host array ``name``."""
    m = mask.to(np.copy)
    edit(getattr(m, name))
    return m


def test_host_masks_with_bad_values_are_refused_before_any_launch():
    """A host mask's values are checked with the call (they were checked only by
    BlockMask.check, which no call ran): a repeated block would count twice in the softmax, a
    transpose that lists another mask would make dK / dV disagree with the forward."""
    good = bm.from_dense(np.ones((3, 3), bool), 300, 260)
    _call_both(_edited(good, "kv_counts", lambda a: a.__setitem__((0, 0, 0), 4)), ValueError, r"kv_counts must be in \[0, 3\]")
    _call_both(_edited(good, "kv_counts", lambda a: a.__setitem__((0, 0, 1), -1)), ValueError, r"kv_counts must be in")
    _call_both(_edited(good, "kv_indices", lambda a: a.__setitem__((0, 0, 0, 2), 1000)), ValueError, r"kv_indices must be block indices")
    _call_both(_edited(good, "kv_indices", lambda a: a.__setitem__((0, 0, 0, slice(None)), [0, 1, 1])), ValueError, r"strictly ascending")
    _call_both(_edited(good, "q_counts", lambda a: a.__setitem__((0, 0, 2), 2)), ValueError, r"q_counts / q_indices must list the same mask")


# The adapters' ops see a mask's arrays alone: a mask built for 256 x 256 tokens (two blocks,
# like 200 x 200) is refused for a 200-token call before it is flattened.
_MASK_256 = bm.from_dense(np.ones((2, 2), bool), 256, 256)


def test_torch_adapter_checks_the_mask_lengths():
    torch = pytest.importorskip("torch")
    import cuattn.torch

    q = torch.ones((1, 200, 2, 64), dtype=torch.float16)
    with pytest.raises(ValueError, match="built for seqlen_q 256, seqlen_k 256; the call has 200 and 200"):
        cuattn.torch.attention(q, q, q, block_mask=_MASK_256.to(torch.as_tensor))


def test_jax_adapter_checks_the_mask_lengths():
    jax = pytest.importorskip("jax")
    import cuattn.jax

    shape = jax.ShapeDtypeStruct((1, 200, 2, 64), jax.numpy.float16)
    mask = _MASK_256.to(jax.numpy.asarray)
    with pytest.raises(ValueError, match="built for seqlen_q 256, seqlen_k 256; the call has 200 and 200"):
        jax.eval_shape(lambda x: cuattn.jax.attention(x, x, x, block_mask=mask), shape)


def test_jax_adapter_refuses_dropout_with_a_mask_as_the_core_call_does():
    """The same ValueError as cuattn.attention and the torch adapter (a NotImplementedError
    before), and a dropout_p that drops nothing (threshold 0) passes that check as there."""
    jax = pytest.importorskip("jax")
    import cuattn.jax

    shape = jax.ShapeDtypeStruct((1, 128, 2, 64), jax.numpy.float16)
    mask = bm.local_global(128, 128, window_blocks=1).to(jax.numpy.asarray)
    rng = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="block_mask is not supported with dropout"):
        jax.eval_shape(lambda x: cuattn.jax.attention(x, x, x, block_mask=mask, dropout_p=0.1, dropout_rng=rng), shape)
    try:
        jax.eval_shape(lambda x: cuattn.jax.attention(x, x, x, block_mask=mask, dropout_p=0.001, dropout_rng=rng), shape)
    except ValueError as e:  # on a machine without a GPU JAX: the adapter's next check
        assert "no CUDA GPU" in str(e)


def test_from_callable_takes_functions_that_index_by_python_ints():
    """A function that indexes a table by Python ints fails on index arrays with an IndexError;
    it is then called per block, as a function with `if` is."""
    table = np.tril(np.ones((3, 3), bool))
    mask = bm.from_callable(lambda i, j: table[i][j], 384, 384)
    np.testing.assert_array_equal(mask.to_dense()[0, 0], table)
    with pytest.raises(ValueError, match="batch must be an int >= 1"):
        bm.from_callable(lambda b, h, i, j: i >= j, 384, 384, batch=0)


def test_a_per_block_function_gets_python_ints():
    """Called per block, a function gets Python ints (``random.Random`` takes no NumPy int), and
    its result's truth value counts as Python's: ``i - j`` keeps the blocks off the diagonal."""
    assert bm.from_callable(lambda i, j: random.Random(i * 1000 + j).random() < 2, 256, 256).to_dense().all()
    off = bm.from_callable(lambda i, j: (i - j) if i >= 0 else 0, 384, 384).to_dense()[0, 0]
    np.testing.assert_array_equal(off, ~np.eye(3, dtype=bool))
    np.testing.assert_array_equal(off, bm.from_callable(lambda i, j: i - j, 384, 384).to_dense()[0, 0])


def test_a_host_mask_is_checked_when_moved_and_by_the_reference():
    """Once on a device a mask's values are not read on the host (malformed ones give wrong
    results there): ``to`` checks a NumPy mask on its way, and the float64 reference refuses a
    mask that is malformed or of other lengths (it read a repeated index once, wrapped -1 to the
    last block and used a 384-row mask's first block for a 128-row call)."""
    good = bm.from_dense(np.tril(np.ones((3, 3), bool)), 384, 384)
    bad = good.to(np.copy)
    bad.kv_indices[0, 0, 2, :2] = [1, 1]
    with pytest.raises(ValueError, match="ascending"):
        bad.to(np.copy)
    with pytest.raises(TypeError, match="kv_counts must be int32"):
        dataclasses.replace(good, kv_counts=good.kv_counts.astype(np.int64)).check()
    wide = good.to(lambda a: a.astype(np.int64))  # integer masks are checked as int32, then converted
    assert wide.to(lambda a: a.astype(np.int32)).kv_counts.dtype == np.int32
    bad_wide = dataclasses.replace(bad, kv_indices=bad.kv_indices.astype(np.int64))
    with pytest.raises(ValueError, match="ascending"):
        bad_wide.to(lambda a: a.astype(np.int32))
    with pytest.raises(ValueError, match="outside int32"):
        dataclasses.replace(wide, kv_counts=wide.kv_counts + 2**32).to(np.copy)
    with pytest.raises(ValueError, match="q_counts must be"):
        dataclasses.replace(good, q_counts=np.int32(0), seqlen_q=None, seqlen_k=None).check()
    q = np.ones((1, 384, 1, 8))
    with pytest.raises(ValueError, match="ascending"):
        reference.attention(q, q, q, block_mask=bad)
    with pytest.raises(ValueError, match="built for seqlen_q 384"):
        reference.attention(q[:, :128], q[:, :128], q[:, :128], block_mask=good)
    with pytest.raises(ValueError, match="block_mask has shape"):
        reference.attention(q[:, :128], q[:, :128], q[:, :128], block_mask=good.to_dense())
    with pytest.raises(ValueError, match="block_mask has 2 entries for heads_q"):
        reference.attention(q, q, q, block_mask=bm.from_dense(np.ones((1, 2, 3, 3), bool), 384, 384))


def test_torch_adapter_refuses_a_mask_of_other_arrays():
    """A NumPy mask with torch tensors is named before the dispatcher sees it."""
    torch = pytest.importorskip("torch")
    import cuattn.torch

    q = torch.ones((2, 300, 4, 64), dtype=torch.float16)
    mask = bm.from_dense(np.ones((3, 3), bool), 300, 300)
    for grad in (False, True):
        with pytest.raises(TypeError, match="block_mask.kv_counts must be a torch tensor"):
            cuattn.torch.attention(q.clone().requires_grad_(grad), q, q, block_mask=mask)


def test_every_kernel_path_has_a_block_sparse_form():
    assert_every_kernel_path_has_form("/sparse", ", false, true>", sparse=True)


def test_every_block_sparse_tile_kernel_has_a_launch_order():
    """Each block-sparse kernel's grid walk is known to the scheduler (a new kernel without one
    would fail its first sparse call), and its cells fit the schedule's bound."""
    from cuattn.kernels import all_variants, sparse

    tiled = [v for v in all_variants() if v.uri.endswith("/sparse") or "/sparse/" in v.uri]
    kernels = {v.kernel for v in tiled}
    assert kernels and kernels <= set(sparse.GRID_WALKS), kernels - set(sparse.GRID_WALKS)
    assert all(v.block_m >= bm.MIN_TILE_ROWS and bm.BLOCK_SIZE % v.block_m == 0 and v.column_splits <= 2 for v in tiled)
    assert {v.uri.split("/")[2] + ("/softcap" if "/softcap" in v.uri else "") for v in tiled if not v.ordered} == {"d224/softcap"}


def test_a_masked_call_sets_every_block_mask_field():
    """kernel_fields names the same AttnParams fields as a call without a mask (the parameter
    struct is packed from exactly its fields)."""
    from types import SimpleNamespace

    from cuattn import params

    mask = bm.local_global(300, 300, window_blocks=1)
    staged = {f"block_mask.{n}": SimpleNamespace(shape=getattr(mask, n).shape, ptr=1) for n in bm.ARRAY_FIELDS}
    mask_fields = {n for n in params.ATTN_PARAMS.names if n.startswith(("kv_block", "q_block", "block_schedule"))}
    assert set(bm.kernel_fields(mask, staged)) == set(bm.NO_BLOCK_MASK_FIELDS) == mask_fields


def test_a_traced_call_allocates_the_launch_orders():
    """What cuattn.jax sizes XLA's buffers from (boundary.trace: arrays known by shape only, null
    addresses) includes the block-sparse launch orders: one for the forward, two for the
    backward (dQ's and dK / dV's), as int32 arrays."""
    from types import SimpleNamespace

    from cuattn import boundary

    spec = lambda shape, dtype: SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))  # noqa: E731
    q, k = spec((2, 300, 4, 64), np.float16), spec((2, 300, 2, 64), np.float16)
    mask = bm.local_global(300, 300, window_blocks=1).to(lambda a: spec(a.shape, a.dtype))
    forward = boundary.trace(cuattn.attention, q, k, k, block_mask=mask, return_lse=True)
    assert forward.allocations[:2] == [((2, 300, 4, 64), np.float16), ((2, 4, 300), np.float32)]
    assert [a for a in forward.allocations[2:] if a[1] == np.int32] == [((1, 4 * 19), np.int32)]  # 19 tiles of 16 rows bound 300
    backward = boundary.trace(cuattn.attention_backward, q, q, k, k, q, spec((2, 4, 300), np.float32), block_mask=mask)
    # Both orders whether or not the fused kernel runs (the trace does not record which).
    assert [a for a in backward.allocations if a[1] == np.int32] == [((1, 4 * 19), np.int32), ((1, 2 * 2 * 19), np.int32)]


def test_a_traced_block_sparse_call_on_hopper_allocates_the_launch_orders(monkeypatch):
    """As above on a Hopper device, with grouped queries that would split the TMA backward's key
    blocks over CTAs if the call had no block mask (a block mask's steps are never split)."""
    import importlib
    from types import SimpleNamespace

    from cuattn import boundary, loader

    backward_module = importlib.import_module("cuattn.backward")
    monkeypatch.setattr(boundary._ValidationContext, "arch", lambda self: "sm_90a")
    monkeypatch.setattr(boundary._ValidationContext, "device_index", lambda self: 0)
    monkeypatch.setattr(backward_module, "device_smem_limit", lambda device_id: 232448)
    monkeypatch.setattr(loader, "device_sm_count", lambda device_id: 132)
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    spec = lambda shape, dtype: SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))  # noqa: E731
    q, k = spec((1, 2048, 16, 128), np.float16), spec((1, 2048, 1, 128), np.float16)
    mask = bm.local_global(2048, 2048, window_blocks=1).to(lambda a: spec(a.shape, a.dtype))
    backward = boundary.trace(cuattn.attention_backward, q, q, k, k, q, spec((1, 16, 2048), np.float32), block_mask=mask)
    assert len([a for a in backward.allocations if a[1] == np.int32]) == 2
    assert backward.decisions.get("tma_query_splits", 1) == 1


def _expected_order(counts, ys, tiles, tile_rows, reversed_x, group, y_per_head):
    """NumPy twin of sparse/block_schedule.cu for one mask entry: cells (y * tiles + x) of at
    least twice the average weight first, by power-of-two class, the rest in launch order."""
    cells = np.arange(ys * tiles)
    x, y = cells % tiles, cells // tiles
    rows = np.minimum((tiles - 1 - x if reversed_x else x) * tile_rows // B, counts.shape[-1] - 1)
    heads = (y // y_per_head)[:, None] * group + np.arange(group)[None, :]
    weight = np.minimum(np.clip(counts, 0, 0xFFFF)[np.minimum(heads, counts.shape[0] - 1), rows[:, None]].sum(axis=1), 0xFFFF)
    average = max(np.float32(weight.sum()) / np.float32(len(cells)), np.float32(1))
    ratio = weight.astype(np.float32) / average
    classes = np.where(ratio >= 2, np.minimum(np.frexp(ratio)[1] - 1, 31), 0)
    return cells[np.argsort(-classes, kind="stable")]


# --- kernels (GPU) -------------------------------------------------------------------------------

CASES = [  # dtype, batch, sq, sk, hq, hk, d, kw, mask
    ("bfloat16", 2, 1023, 1023, 4, 2, 128, {"causal": True}, "random per head"),
    ("float16", 1, 113, 700, 4, 4, 64, {"window": (64, 64), "softcap": 30.0}, "random"),
    ("float32", 2, 300, 260, 4, 2, 64, {"causal": True, "align": "top_left"}, "random per batch"),
    ("bfloat16", 1, 1, 300, 8, 1, 256, {}, "random"),
    ("bfloat16", 2, 300, 333, 4, 2, 160, {"causal": True}, "random per head"),  # the 192 tile, padded
    ("bfloat16", 1, 640, 640, 6, 2, 96, {"sink": True}, "local_global"),
    ("float16", 1, 1000, 1000, 2, 1, 64, {"causal": True}, "strided"),
]


def _case_mask(rng, kind, batch, sq, sk, hq):
    if kind == "local_global":
        return bm.local_global(sq, sk, window_blocks=1, global_blocks=1)
    if kind == "strided":
        return bm.strided(sq, sk, local_blocks=2, stride=3, causal=True)
    return _random_mask(rng, sq, sk, batch=batch if "batch" in kind else 1, heads=hq if "head" in kind else 1)


@gpu
@pytest.mark.parametrize("dtype, batch, sq, sk, hq, hk, d, kw, kind", CASES)
def test_forward_and_backward_match_the_reference(dtype, batch, sq, sk, hq, hk, d, kw, kind):
    """Both kernel paths and both backward modes against float64, within 2x (forward) / 3x
    (gradients) the error of naive attention in the input precision with the same mask."""
    import cupy

    rng = np.random.default_rng(sq * 7 + sk + d)
    q, k, v = randn(rng, (batch, sq, hq, d), dtype), randn(rng, (batch, sk, hk, d), dtype), randn(rng, (batch, sk, hk, d), dtype)
    dout = randn(rng, (batch, sq, hq, d), dtype)
    if kw.get("sink"):  # attention sinks: a per-head logit in every row's denominator
        kw = {**kw, "sink": rng.standard_normal(hq).astype(np.float32)}
    mask = _case_mask(rng, kind, batch, sq, sk, hq)
    keep = _elements(mask, sq, sk)
    ref_out, ref_lse = reference.attention(q, k, v, block_mask=mask, return_lse=True, **kw)
    naive_out = naive_attention(q, k, v, dtype, keep=keep, **kw)
    ref = reference.attention_backward(dout, q, k, v, ref_out, ref_lse, block_mask=mask, **kw)
    naive = naive_attention_backward(dout, q, k, v, dtype, keep=keep, **kw)
    device_mask = mask.to(cupy.asarray)
    device_kw = {**kw, "sink": cupy.asarray(kw["sink"])} if "sink" in kw else kw
    for path in KERNEL_PATHS:
        with kernel_path(path):
            poison_cupy_pool()
            dev = [cupy.asarray(x) for x in (q, k, v, dout)]
            out, lse = cuattn.attention(*dev[:3], block_mask=device_mask, return_lse=True, **device_kw)
            assert_attention_accuracy(to_host(out), ref_out, naive_out)
            np.testing.assert_allclose(to_host(lse), ref_lse, rtol=1e-5, atol=1e-5)
            for deterministic in (False, True):
                poison_cupy_pool()
                grads = cuattn.attention_backward(dev[3], *dev[:3], out, lse, block_mask=device_mask, deterministic=deterministic, **device_kw)
                for name, g, r, nv in zip(("dq", "dk", "dv", "dsink"), grads, ref, naive):
                    g = to_host(g)
                    assert not np.isnan(g).any(), f"{path} {name}"
                    bound = 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))
                    assert max_err(g, r) <= bound, f"{path} {name}: {max_err(g, r):.3e} > {bound:.3e}"


SCHEDULE_CASES = [  # kernel family, kernel, c_type, bucket, batch, sq, sk, hq, hk, mask
    ("forward", "forward", "bf16", 128, 2, 4000, 4000, 4, 2, "local_global"),
    ("backward", "backward_dq", "f16", 64, 2, 300, 1300, 4, 2, "random per batch head"),
    ("backward", "backward_dq", "float", 32, 1, 700, 700, 4, 4, "random head"),  # x not reversed
    ("backward", "backward_dkdv", "bf16", 256, 1, 1300, 700, 6, 3, "random head"),  # two CTAs per key block (column splits)
    ("backward", "backward_dkdv", "float", 64, 1, 33600, 33600, 64, 8, "random head"),  # > 16384 cells (not cached)
    ("backward", "backward_dkdv", "bf16", 64, 1, 2000, 2000, 8, 2, "local_global causal"),
]


@gpu
@pytest.mark.parametrize("family, kernel, c_type, bucket, batch, sq, sk, hq, hk, kind", SCHEDULE_CASES)
def test_launch_order_puts_the_heaviest_cells_first(family, kernel, c_type, bucket, batch, sq, sk, hq, hk, kind):
    """The order of a block-sparse launch's CTAs (sparse/block_schedule.cu) equals its NumPy
    twin: every cell once, those whose mask row keeps at least twice the average blocks (summed
    over the GQA group for dK / dV) first, heaviest first, the rest in launch order; one order
    per sequence of a per-batch mask; and a global row or column is among the first cells."""
    import cupy

    from cuattn import boundary, params
    from cuattn.kernels import backward, forward

    rng = np.random.default_rng(sq + hq)
    if kind.startswith("local_global"):
        mask = bm.local_global(sq, sk, window_blocks=1, global_blocks=1, causal="causal" in kind)
    else:
        mask = _random_mask(rng, sq, sk, batch=batch if "batch" in kind else 1, heads=hq if "head" in kind else 1, density=0.3)
    variant = (forward.variant(c_type, bucket, False, sparse=True) if family == "forward"
               else backward.variant(kernel, c_type, bucket, False, sparse=True))
    side = "q" if "dq" in kernel or family == "forward" else "k"
    device_mask = mask.to(cupy.asarray)
    ctx, a = boundary.import_arrays(**bm.array_arguments(device_mask))
    attn = params.new(params.ATTN_PARAMS)
    attn["seqlen_q"], attn["seqlen_k"], attn["heads_q"], attn["heads_kv"] = sq, sk, hq, hk
    for name, value in bm.kernel_fields(mask, a).items():
        attn[name] = value
    rows, ys = (sq, hq) if side == "q" else (sk, hk * variant.column_splits)
    grid = (-(-rows // variant.block_m), ys, batch)
    buffer = bm.schedule_buffer(ctx, attn, side, batch)
    with ctx.device, ctx.stream:
        bm.order_launch(ctx, buffer, variant, grid, attn)
    cells = grid[0] * ys
    schedule = to_host(buffer.native).ravel()[:buffer.shape[0] * cells].reshape(buffer.shape[0], cells)
    counts = (mask.kv_counts if side == "q" else mask.q_counts).astype(np.int64)
    group = 1 if side == "q" else hq // hk
    assert buffer.shape[0] == counts.shape[0] and int(attn["block_schedule_stride"]) == (cells if counts.shape[0] > 1 else 0)
    for entry in range(counts.shape[0]):
        expected = _expected_order(counts[entry], ys, grid[0], variant.block_m, variant.kernel != "backward_fp32_dq" and side == "q",
                                   group, variant.column_splits)
        np.testing.assert_array_equal(schedule[entry], expected)
    if kind.startswith("local_global"):  # the global block row (or, causal, column) runs first
        x = schedule[0] % grid[0]
        rows = (grid[0] - 1 - x if side == "q" else x) * variant.block_m // B
        first = int((rows == 0).sum())
        assert 0 < first < len(rows) and (rows[:first] == 0).all()


@gpu
@pytest.mark.parametrize("d", [96, 128])
def test_hopper_block_sparse_backward_takes_the_tma_kernel(monkeypatch, d):
    """On Hopper a block-sparse backward at head dims 65-128 runs the TMA kernel's block-sparse
    form (backward_tma.cu SPARSE; at 64 it would spill: the copying kernel serves it), whose
    dK / dV equal the copying kernel's bit for bit (the same steps of each key block, in the
    same order), key blocks that no query keeps included."""
    import cupy

    from cuattn import loader, replay

    if loader.device_arch() != "sm_90a":
        pytest.skip("the Hopper kernels")
    replay.clear()  # a plan recorded by an earlier test would launch without loading its kernels
    launched = []
    load = loader.load_kernel
    monkeypatch.setattr(loader, "load_kernel", lambda variant: launched.append(variant.uri) or load(variant))
    monkeypatch.setenv("CUATTN_SMALL_BACKWARD", "0")
    rng = np.random.default_rng(d)
    q, do = (cupy.asarray(randn(rng, (2, 700, 4, d), "bfloat16")) for _ in range(2))
    k, v = (cupy.asarray(randn(rng, (2, 900, 2, d), "bfloat16")) for _ in range(2))
    keep = rng.random((1, 4, bm.blocks(700), bm.blocks(900))) < 0.4
    keep[..., 3] = False  # a key block that no query keeps: zero dK / dV
    mask = bm.from_dense(keep, 700, 900).to(cupy.asarray)
    out, lse = cuattn.attention(q, k, v, block_mask=mask, causal=True, return_lse=True)
    tma = cuattn.attention_backward(do, q, k, v, out, lse, block_mask=mask, causal=True)
    one_pass = {u for u in launched if u.startswith(("backward_tma/", "backward_wgmma_fused/"))}  # (a plan is recorded twice)
    assert one_pass == {"backward_tma/bf16/d128/m64s2/sparse"}, launched
    monkeypatch.setenv("CUATTN_TMA", "0")
    launched.clear()
    copying = cuattn.attention_backward(do, q, k, v, out, lse, block_mask=mask, causal=True)
    assert {u for u in launched if u.startswith(("backward_tma/", "backward_wgmma_fused/"))} == {"backward_wgmma_fused/bf16/d128/s64wg2c1/sparse"}
    for grad, expected in zip(tma[1:], copying[1:]):
        cupy.testing.assert_array_equal(grad, expected)
    assert not cupy.any(tma[1][:, 3 * B:4 * B]) and not cupy.any(tma[2][:, 3 * B:4 * B])
    cupy.testing.assert_allclose(tma[0].astype(cupy.float32), copying[0].astype(cupy.float32), rtol=2e-2, atol=2e-2)  # dQ: atomics


@gpu
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_empty_key_range_and_empty_masks(path):
    """seqlen_k = 0 (a mask without key blocks: its index arrays are empty) and a mask keeping
    nothing: out 0, lse -inf, zero gradients, no access outside the mask's arrays."""
    import cupy

    rng = np.random.default_rng(5)
    q, dout = randn(rng, (1, 200, 4, 64), "bfloat16"), randn(rng, (1, 200, 4, 64), "bfloat16")
    with kernel_path(path):
        for sk, keep in ((0, np.zeros((2, 0), bool)), (300, np.zeros((2, 3), bool))):
            k, v = randn(rng, (1, sk, 2, 64), "bfloat16"), randn(rng, (1, sk, 2, 64), "bfloat16")
            mask = bm.from_dense(keep, 200, sk).to(cupy.asarray)
            dev = [cupy.asarray(x) for x in (q, k, v, dout)]
            out, lse = cuattn.attention(*dev[:3], block_mask=mask, return_lse=True)
            cupy.cuda.get_current_stream().synchronize()
            assert not to_host(out).any() and np.isneginf(to_host(lse)).all()
            for deterministic in (False, True):
                grads = cuattn.attention_backward(dev[3], *dev[:3], out, lse, block_mask=mask, deterministic=deterministic)
                assert all(not to_host(g).any() for g in grads)


@gpu
@pytest.mark.parametrize("dtype, d", [("bfloat16", 128), ("float16", 64), ("float32", 32)])
def test_skipped_blocks_are_never_read(dtype, d):
    """K / V rows of a key block no query block keeps hold NaN: outputs and gradients stay finite
    and equal those without them (the dense kernels would spread the NaN), dK / dV of those rows
    are zero; a mask keeping every block gives the dense kernels' results bit for bit."""
    import cupy

    rng = np.random.default_rng(d)
    sq, sk, hq, hk = 384, 512, 4, 2
    q, k, v, dout = (randn(rng, (1, n, h, d), dtype) for n, h in ((sq, hq), (sk, hk), (sk, hk), (sq, hq)))
    keep = rng.random((1, hq, 3, 4)) < 0.7
    keep[..., 2] = False
    keep[..., 0] = True
    mask = bm.from_dense(keep, sq, sk).to(cupy.asarray)
    full = bm.from_dense(np.ones((3, 4), bool), sq, sk).to(cupy.asarray)
    poisoned_k, poisoned_v = k.copy(), v.copy()
    poisoned_k[:, 2 * B:3 * B] = np.nan
    poisoned_v[:, 2 * B:3 * B] = np.nan
    for path in KERNEL_PATHS:
        with kernel_path(path):
            dq_, dout_ = cupy.asarray(q), cupy.asarray(dout)
            clean = [cupy.asarray(x) for x in (k, v)]
            poisoned = [cupy.asarray(x) for x in (poisoned_k, poisoned_v)]
            out, lse = cuattn.attention(dq_, *clean, block_mask=mask, return_lse=True)
            out_p, lse_p = cuattn.attention(dq_, *poisoned, block_mask=mask, return_lse=True)
            np.testing.assert_array_equal(to_host(out_p), to_host(out))
            for deterministic in (False, True):
                grads = cuattn.attention_backward(dout_, dq_, *clean, out, lse, block_mask=mask, deterministic=deterministic)
                grads_p = cuattn.attention_backward(dout_, dq_, *poisoned, out_p, lse_p, block_mask=mask, deterministic=deterministic)
                for g, g_p in zip(grads, grads_p):
                    if deterministic:
                        np.testing.assert_array_equal(to_host(g_p), to_host(g))
                    assert not np.isnan(to_host(g_p)).any()
                assert not to_host(grads_p[1])[:, 2 * B:3 * B].any() and not to_host(grads_p[2])[:, 2 * B:3 * B].any()
            dense_out, dense_lse = cuattn.attention(dq_, *clean, return_lse=True, causal=True)
            sparse_out, sparse_lse = cuattn.attention(dq_, *clean, block_mask=full, return_lse=True, causal=True)
            np.testing.assert_array_equal(to_host(sparse_out), to_host(dense_out))
            np.testing.assert_array_equal(to_host(sparse_lse), to_host(dense_lse))
            dense = cuattn.attention_backward(dout_, dq_, *clean, dense_out, dense_lse, causal=True, deterministic=True)
            sparse = cuattn.attention_backward(dout_, dq_, *clean, dense_out, dense_lse, causal=True, deterministic=True, block_mask=full)
            for g, g_s in zip(dense, sparse):
                np.testing.assert_array_equal(to_host(g_s), to_host(g))


# The JAX test runs before the torch one (torch.compile): in the full suite, before the
# sparse kernels stopped reading one index past their lists, the JAX test's first array
# aborted the process; JAX's backend now starts before Inductor runs in this file.
@gpu
def test_jax_gradients_match_the_reference():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import cuattn.jax as cj

    rng = np.random.default_rng(3)
    sq, sk = 150, 400
    q, k, v = randn(rng, (2, sq, 4, 64), "bfloat16"), randn(rng, (2, sk, 2, 64), "bfloat16"), randn(rng, (2, sk, 2, 64), "bfloat16")
    w = randn(rng, (2, sq, 4, 64), "bfloat16").astype(np.float32)
    mask = _random_mask(rng, sq, sk, batch=2, empty_row=False)
    device_mask = mask.to(jnp.asarray)

    def loss(q, k, v, mask):
        return (cj.attention(q, k, v, block_mask=mask, window=(200, None)).astype(jnp.float32) * w).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*map(jnp.asarray, (q, k, v)), device_mask)
    ref_out, ref_lse = reference.attention(q, k, v, return_lse=True, block_mask=mask, window=(200, None))
    ref = reference.attention_backward(w, q, k, v, ref_out, ref_lse, block_mask=mask, window=(200, None))
    naive = naive_attention_backward(w, q, k, v, "bfloat16", window=(200, None), keep=_elements(mask, sq, sk))
    for g, r, nv in zip(grads, ref, naive):
        assert max_err(np.asarray(g).astype(np.float32), r) <= 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))


@gpu
def test_torch_gradients_match_the_reference():
    """Eager autograd, torch.compile(fullgraph=True) and opcheck of the block-sparse ops."""
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct
    from helpers import naive_attention as naive_fwd, torch_attention_grads

    rng = np.random.default_rng(6)
    sq, sk = 300, 400
    q, k, v = randn(rng, (2, sq, 8, 64), "bfloat16"), randn(rng, (2, sk, 2, 64), "bfloat16"), randn(rng, (2, sk, 2, 64), "bfloat16")
    w = randn(rng, (2, sq, 8, 64), "bfloat16").astype(np.float32)
    mask = _random_mask(rng, sq, sk, heads=8)
    keep = _elements(mask, sq, sk)
    ref_out, ref_lse = reference.attention(q, k, v, causal=True, block_mask=mask, return_lse=True)
    ref = reference.attention_backward(w, q, k, v, ref_out, ref_lse, causal=True, block_mask=mask)
    naive_out = naive_fwd(q, k, v, "bfloat16", causal=True, keep=keep)
    naive = naive_attention_backward(w, q, k, v, "bfloat16", causal=True, keep=keep)
    device_mask = mask.to(lambda a: torch.as_tensor(a, device="cuda"))
    eager = lambda q, k, v: ct.attention(q, k, v, causal=True, block_mask=device_mask)  # noqa: E731
    for fn in (eager, torch.compile(eager, fullgraph=True)):
        out, grads = torch_attention_grads(fn, q, k, v, w)
        assert_attention_accuracy(out, ref_out, naive_out)
        for g, r, nv in zip(grads, ref, naive):
            assert max_err(g, r) <= 3.0 * max_err(nv, r) + 1e-5 * max(1.0, float(np.abs(r).max()))

    small = [torch.from_numpy(x[:1, :200].astype(np.float32)).cuda().bfloat16() for x in (q, k, v)]
    small_mask = bm.from_dense(np.array([[True, False], [True, True]]), 200, 200).to(lambda a: torch.as_tensor(a, device="cuda"))
    options = dict(causal=False, window_left=-1, window_right=-1, align="bottom_right", scale=0.125, softcap=0.0, sink_tokens=0)
    torch.library.opcheck(ct.op("attention_block_sparse"), (*small, *small_mask.arrays), options)
    out, lse = ct.op("attention_block_sparse")(*small, *small_mask.arrays, **options)
    torch.library.opcheck(ct.op("attention_block_sparse_backward"), (torch.randn_like(out), *small, out, lse, None, *small_mask.arrays),
                          {**options, "deterministic": True})
