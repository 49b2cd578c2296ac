"""cuattn.attention_with_kvcache: contiguous and paged caches (any page size) against the float64
reference, split-KV against one split, device values clamped, CUDA-graph replay with new lengths
and page tables (GPU); argument checks (no GPU needed)."""

import numpy as np
import pytest

import cuattn
from cuattn import reference
from helpers import assert_attention_accuracy, naive_attention, poison_cupy_pool, randn

gpu = pytest.mark.gpu


def _cache(rng, lengths, heads_kv, head_dim, dtype, page_size=None, capacity=None, spare_pages=3):
    """A cache holding len(lengths) sequences: contiguous (batch, capacity, heads_kv, head_dim),
    or pages of ``page_size`` positions in shuffled order with a few unused pages; returns the
    cache, its block table (None when contiguous) and the float64 keys/values of each sequence."""
    capacity = capacity or max(1, max(lengths))
    if page_size is None:
        k, v = (randn(rng, (len(lengths), capacity, heads_kv, head_dim), dtype) for _ in range(2))
        return k, v, None
    max_pages = -(-capacity // page_size)
    pages = len(lengths) * max_pages + spare_pages
    k, v = (randn(rng, (pages, page_size, heads_kv, head_dim), dtype) for _ in range(2))
    table = rng.permutation(pages)[: len(lengths) * max_pages].reshape(len(lengths), max_pages).astype(np.int32)
    return k, v, table


def _gathered(k, v, table, b, length):
    if table is None:
        return k[b, :length], v[b, :length]
    return np.concatenate(list(k[table[b]]))[:length], np.concatenate(list(v[table[b]]))[:length]


def _run(rng, lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size=None, num_splits=None, v_padding=0, **kw):
    """``v_padding``: the device V a view of rows that many elements wider (NaN there), so that
    its strides differ from K's."""
    import cupy

    k, v, table = _cache(rng, lengths, heads_kv, head_dim, dtype, page_size)
    q = randn(rng, (len(lengths), seqlen_q, heads_q, head_dim), dtype)
    seqlens = np.array(lengths, np.int32)
    poison_cupy_pool()
    v_device = cupy.asarray(v)
    if v_padding:
        v_device = cupy.full(v.shape[:-1] + (head_dim + v_padding,), np.nan, v.dtype)[..., :head_dim]
        v_device[...] = cupy.asarray(v)
    out, lse = cuattn.attention_with_kvcache(
        cupy.asarray(q), cupy.asarray(k), v_device, cache_seqlens=cupy.asarray(seqlens),
        block_table=None if table is None else cupy.asarray(table), num_splits=num_splits, return_lse=True, **kw,
    )
    out, lse = out.get(), lse.get()
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (len(lengths), heads_q, seqlen_q)
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    ref_out, ref_lse = reference.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table, return_lse=True, **kw)
    for b, length in enumerate(lengths):
        kb, vb = _gathered(k, v, table, b, length)
        if length == 0:
            assert not out[b].astype(np.float32).any() and np.isneginf(lse[b]).all()
            continue
        naive = naive_attention(q[b:b + 1], kb[None], vb[None], dtype, **{"causal": True, **kw})
        assert_attention_accuracy(out[b:b + 1], ref_out[b:b + 1], naive)
        fin = np.isfinite(ref_lse[b])
        np.testing.assert_array_equal(np.isneginf(lse[b]), ~fin)
        np.testing.assert_allclose(lse[b][fin], ref_lse[b][fin], rtol=1e-5, atol=1e-5)
    return out, lse


CASES = [  # (lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size)
    ([0, 1, 700, 1500], 1, 8, 1, 128, "bfloat16", None),
    ([2100, 0, 129, 4000], 1, 12, 4, 96, "float16", None),
    ([300, 5000], 3, 8, 2, 128, "float16", None),
    ([0, 1, 700, 1500], 1, 8, 1, 128, "bfloat16", 16),
    ([3, 0, 640, 1029], 1, 4, 4, 64, "float16", 1),
    ([300, 17, 0, 900], 4, 8, 1, 128, "float16", 256),
    ([1000, 5], 4, 2, 2, 256, "bfloat16", 16),
    ([64, 1999], 1, 16, 2, 64, "bfloat16", 7),  # a page size that divides nothing
    ([40, 600], 1, 32, 1, 128, "float16", None),  # 32 query heads per KV head: two row blocks
    ([5, 333], 1, 4, 2, 96, "float16", 16),  # buckets whose rows are not a power of two of chunks
    ([700, 0], 2, 6, 3, 160, "bfloat16", None),
    ([129, 64], 3, 2, 1, 40, "bfloat16", 1),  # head_dim below its bucket
    # Pages of a multiple of 16 copied as runs of positions (RUNS): a size not a power of two, a
    # head_dim below its bucket (lanes past it take the general copies), lengths ending mid-run.
    ([0, 47, 1000, 1553], 1, 8, 2, 128, "bfloat16", 48),
    ([33, 781], 2, 4, 1, 120, "float16", 32),
    ([17, 900], 1, 8, 2, 256, "float16", 64),
    ([999, 14], 1, 12, 3, 192, "bfloat16", None),
    # Pages whose size is not a multiple of 16, from head_dim 96: each row's addresses worked out
    # by one lane and shuffled to the lanes copying it (buckets of 1 and 2 rows a round with 20-32
    # copying lanes, padded and swizzled rows, head dims below their bucket, lengths ending mid-block).
    ([0, 1, 700, 1500], 1, 32, 8, 128, "bfloat16", 1),
    ([77, 1030], 4, 8, 2, 256, "float16", 3),
    ([500, 16], 1, 4, 1, 160, "bfloat16", 8),
    ([15, 1200], 2, 6, 2, 96, "float16", 5),
    ([333, 62], 1, 8, 2, 120, "bfloat16", 1),
    ([260, 901], 1, 6, 3, 224, "bfloat16", 2),
    ([300, 45], 1, 8, 2, 192, "bfloat16", 3),
    ([129, 610], 1, 4, 2, 152, "float16", 1),
    ([411, 96], 1, 4, 2, 224, "float16", 32),  # runs at 28 copying lanes, one row a round
    ([1030, 5], 2, 8, 2, 224, "bfloat16", None),
]


def test_long_splits_on_one_wave_prefetch_more_blocks():
    """Four key blocks are pulled into L2 before the wait where a split is long (16+ blocks of the
    capacity) and the grid fits the SMs; two elsewhere; none on paged caches without a
    dependent launch (their prefetch would wait for its block-table reads)."""
    from cuattn.kernels import decode as plan

    assert plan.prefetch_blocks(False, True, 32, False) == plan.prefetch_blocks(True, True, 16, False) == 4
    assert plan.prefetch_blocks(False, True, 4, False) == plan.prefetch_blocks(True, True, 16, True) == 2
    assert plan.prefetch_blocks(False, False, 32, False) == 4 and plan.prefetch_blocks(True, False, 32, False) == 0
    assert (plan.split_blocks(8192, 4), plan.split_blocks(8193, 4), plan.split_blocks(1, 3)) == (32, 33, 1)


def test_contiguous_caches_on_one_wave_take_eight_warps_and_long_single_splits_an_ordinary_launch():
    """CTAs of 8 warps (128-key ring slots) for contiguous caches copying runs on grids within the
    SMs where that ring holds 3 slots (head dims 96 and 128) and each split of the capacity 1024
    positions or more, 4 elsewhere; a decode grid of one
    split over 8192+ positions of such a cache is launched as an ordinary grid, every other as a
    programmatic dependent."""
    from cuattn.kernels import decode as plan
    from cuattn.kernels.variant import MAX_SMEM_OPTIN, arch_smem_limit

    assert plan.cta_warps(128, False, False) == plan.cta_warps(96, False, False) == plan.cta_warps(128, False, False, split_keys=1024) == 8
    assert {plan.cta_warps(128, True, False), plan.cta_warps(128, False, True), plan.cta_warps(64, False, False),
            plan.cta_warps(160, False, False), plan.cta_warps(256, False, False), plan.cta_warps(128, False, False, 99 * 1024),
            plan.cta_warps(128, False, False, split_keys=1023)} == {4}
    sm80 = arch_smem_limit("sm_80")  # 8 warps at head_dim 96 (3 slots), not at 128 (2 would fit)
    assert plan.cta_warps(96, False, False, sm80) == 8 and plan.cta_warps(128, False, False, sm80) == 4
    assert plan.variant("bf16", 96, False, False, sm80, warps=8) in plan.variants("sm_80")
    eight = plan.variant("bf16", 128, False, False, warps=8)
    assert eight.threads == 256 and eight.uri == "decode/bf16/d128/s3/w8" and eight.dynamic_smem <= MAX_SMEM_OPTIN
    assert eight.expression.endswith(", true, 8>") and ("cuattn::DecodeTraits<128, 3, 8>::kBlockN", 128) in eight.contract
    assert ("cuattn::kDecodeWarps", plan.WARPS) in eight.contract
    assert eight in plan.variants() and eight in plan.common_variants()
    assert plan.num_splits(128, False, 16, 8, 1, 32768, 132, warps=8) == 1 and plan.num_splits(128, False, 1, 8, 1, 32768, 132, warps=8) == 16
    assert plan.num_splits(128, False, 1, 8, 1, 1024, 132, warps=8) == 8 and plan.num_splits(128, False, 1, 8, 1, 1024, 132) == 16
    assert not plan.dependent_launch(False, 8, 1, 8192)
    # A call's choice (decode_warps): b16 x 32k one split of 32k keys, 8 warps; b4 x 1k and b1 x 8k
    # splits of 256 and 512 keys, 4; the caller's one split of 1024 keys, 8; pages and wide grids, 4.
    assert plan.decode_warps(128, False, 16, 8, 1, 32768, 132) == plan.decode_warps(128, False, 1, 8, 1, 1024, 132, splits=1) == 8
    assert {plan.decode_warps(128, False, 4, 8, 1, 1024, 132), plan.decode_warps(128, False, 1, 8, 1, 8192, 132),
            plan.decode_warps(128, True, 16, 8, 1, 32768, 132), plan.decode_warps(128, False, 64, 8, 1, 32768, 132)} == {4}
    assert all(plan.dependent_launch(*a) for a in ((False, 8, 2, 1 << 17), (False, 8, 1, 8191), (True, 4, 1, 1 << 17), (False, 4, 1, 1 << 17)))


def test_runs_of_positions_are_copied_where_a_warp_s_keys_share_a_page():
    """The decode kernel copies a warp's 16 keys as one run of positions for contiguous caches
    and pages of a multiple of 16 (from head_dim 96); other page sizes keep the per-row copies,
    compiled without that branch (it cost pages of 1 10%)."""
    from cuattn.kernels import decode as plan

    assert [plan.takes_runs(128, p) for p in (None, 16, 48, 256, 1, 8, 24)] == [True, True, True, True, False, False, False]
    assert not plan.takes_runs(64, None) and not plan.takes_runs(64, 16) and plan.takes_runs(96, 32)
    assert plan.variant("bf16", 128, True, False, runs=True).uri.endswith("/paged/runs")
    assert plan.variant("bf16", 128, True, False).expression.endswith(", false>")
    assert plan.variant("bf16", 128, False, False).expression.endswith(", true>")
    with pytest.raises(ValueError, match="runs"):
        plan.variant("bf16", 64, False, False, runs=True)
    uris = {v.uri for v in plan.variants()}
    assert "decode/bf16/d128/s3/paged/runs" in uris and "decode/bf16/d64/s2/paged/runs" not in uris


@gpu
@pytest.mark.parametrize("lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size", CASES)
def test_decode_matches_reference(lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size):
    _run(np.random.default_rng(sum(lengths) + head_dim), lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size)


@gpu
@pytest.mark.parametrize("kw", [
    dict(window=(100, 0)),
    dict(softcap=20.0),
    dict(causal=False),
    dict(window=(64, 3), causal=False, scale=0.05),
])
def test_decode_masks_and_scores(kw):
    _run(np.random.default_rng(7), [1, 400, 1100], 4, 8, 2, 128, "bfloat16", 16, **kw)


PREFILL_CASES = [  # 64+ new tokens: the tiled forward kernel over the cache layouts
    ([700, 513], 512, 4, 1, 64, "float16", 64),
    ([700, 0, 1500], 300, 8, 2, 128, "bfloat16", None),
    ([700, 0, 1500], 300, 8, 2, 128, "bfloat16", 16),
    ([513, 64], 64, 4, 4, 64, "float16", 1),
    ([1023, 200], 200, 8, 1, 256, "bfloat16", 256),
    ([400, 131], 130, 6, 3, 96, "float16", 48),  # on Hopper the 128 tile, columns zero-padded; pages of 48
    ([900, 333], 200, 4, 2, 256, "bfloat16", 16),  # many 64-key blocks of pages of 16
    ([700, 65], 128, 4, 1, 192, "float16", 16),  # the 256 tile, padded, over pages of 16
    ([300, 90], 80, 2, 1, 40, "bfloat16", 7),  # head_dim below its bucket, a page size that divides nothing
    ([257, 1029], 129, 4, 2, 160, "float16", None),
]


@gpu
@pytest.mark.parametrize("lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size", PREFILL_CASES)
def test_chunked_prefill_matches_reference(lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size):
    """A chunk of new tokens against each sequence's cache (the chunk's own keys included)."""
    _run(np.random.default_rng(sum(lengths) + seqlen_q), lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, page_size)


@gpu
@pytest.mark.parametrize("head_dim, page_size, kw", [
    (64, 64, {"softcap": 15.0}),  # d64 with softcap: the producer's copies at every page size (its boxes' form spills)
    (64, 16, {"softcap": 15.0, "window": (90, 0)}),
    (128, 16, {"v_padding": 64}),  # V's strides unlike K's
    (64, 1, {"v_padding": 8}),  # three consumer warpgroups, a page per key
    (96, 16, {}),  # columns past head_dim in the tile (128): zero-filled copies
    (40, 3, {}),  # the same in tile 64
])
def test_chunked_prefill_pages_by_the_producers_copies(head_dim, page_size, kw):
    """Pages the Hopper TMA forward's producer copies (forward_tma.cu PAGE_COPY) rather than
    loading as TMA boxes."""
    _run(np.random.default_rng(head_dim + page_size), [700, 0, 333], 150, 8, 2, head_dim, "bfloat16", page_size, **kw)


@gpu
@pytest.mark.parametrize("page_size", [16, None])
@pytest.mark.parametrize("kw", [
    dict(window=(100, 0)), dict(softcap=20.0), dict(causal=False), dict(window=(64, 3), causal=False, scale=0.05),
    dict(window=(300, 0)), dict(window=(250, 130), causal=False),  # bounds past 96 rows + one page
])
def test_chunked_prefill_masks_and_scores(kw, page_size):
    _run(np.random.default_rng(8), [400, 1100], 96, 8, 2, 128, "bfloat16", page_size, **kw)


@pytest.mark.parametrize("page_size", [16, None])
def test_chunked_prefill_masks_by_the_capacity_not_the_page(page_size):
    """The tiled forward over a paged cache was handed window bounds computed against one page
    (k_cache.shape[1]): a bound past seqlen_q + page_size became unbounded, and the window
    was dropped. The kernel's mask fields are those of the capacity, paged or not."""
    from cuattn import boundary, decode
    from cuattn.attention import NO_LSE
    from cuattn.options import AttnOptions

    def array(shape, dtype=np.float16):
        return boundary.DeviceArray(1 << 20, shape, boundary._contiguous_strides(shape), np.dtype(dtype), None)

    capacity = 1024
    k_shape = (1, capacity, 2, 128) if page_size is None else (capacity // page_size, page_size, 2, 128)
    a = dict(q=array((1, 64, 8, 128)), k_cache=array(k_shape), v_cache=array(k_shape), cache_seqlens=array((1,), np.int32),
             block_table=None if page_size is None else array((1, capacity // page_size), np.int32), cache_batch_idx=None, sink=None,
             k_new=None, v_new=None)
    for causal, window in ((True, (100, 0)), (False, (300, 200))):
        options = AttnOptions.from_user(causal, window, "bottom_right", None, None, head_dim=128)
        p = decode._forward_params(a, a["q"], NO_LSE, options, {"capacity": capacity, "page_size": page_size or 1, "seqlen_new": 0})
        expected = options.kernel_fields(64, capacity)
        assert (int(p["window_left"]), int(p["window_right"]), int(p["diagonal_offset"])) == (*window, capacity - 64)
        assert all(int(p[f]) == expected[f] for f in ("window_left", "window_right", "diagonal_offset"))


@gpu
@pytest.mark.parametrize("page_size", [None, 16, 256, 8, 1, 3])
@pytest.mark.parametrize("head_dim", [64, 128, 160, 256])
def test_chunked_prefill_ignores_what_lies_past_each_sequence(monkeypatch, head_dim, page_size):
    """A cache (contiguous, or pages in shuffled order) whose positions past each sequence hold
    NaN and inf: the prefill reads the last key block whole (on Hopper by TMA or by the
    producer's copies, forward_tma.cu's cache forms, which zero those V rows before P V), and its
    result is finite and right."""
    import cupy

    from cuattn import loader, replay
    from cuattn.kernels import forward

    launched = []
    original = forward.tma_variant
    monkeypatch.setattr(forward, "tma_variant", lambda *a, **kw: launched.append((kw.get("layout"), kw.get("page_copy", False))) or original(*a, **kw))
    monkeypatch.setattr(replay, "enabled", False)
    rng = np.random.default_rng(head_dim + (page_size or 0))
    lengths = np.array([1000, 77, 513], np.int32)  # with the 200 new rows: 1200, 277, 713 keys
    capacity = 1536
    k, v = (randn(rng, (3, capacity, 2, head_dim), "bfloat16") for _ in range(2))
    for b, length in enumerate(lengths + 200):
        k[b, length:] = np.inf
        v[b, length:] = np.nan
    q, k_new, v_new = (randn(rng, (3, 200, h, head_dim), "bfloat16") for h in (6, 2, 2))
    table = None
    k_cache, v_cache = k, v
    if page_size is not None:  # page i of sequence b stored at order[b * pages + i]
        pages = capacity // page_size
        order = rng.permutation(3 * pages)
        table = order.reshape(3, pages).astype(np.int32)
        k_cache, v_cache = (np.empty((3 * pages, page_size, 2, head_dim), x.dtype) for x in (k, v))
        k_cache[order], v_cache[order] = k.reshape(3 * pages, page_size, 2, head_dim), v.reshape(3 * pages, page_size, 2, head_dim)
    out = cuattn.attention_with_kvcache(
        cupy.asarray(q), cupy.asarray(k_cache), cupy.asarray(v_cache), cache_seqlens=cupy.asarray(lengths), k_new=cupy.asarray(k_new),
        v_new=cupy.asarray(v_new), block_table=None if table is None else cupy.asarray(table),
    ).get()
    assert not np.isnan(out.astype(np.float32)).any()
    if loader.device_arch() == "sm_90a":  # pages under 32 rows by the producer's copies
        expected = {None: ("cache", False), 256: ("paged_cache", False)}.get(page_size)
        if page_size in (1, 3, 8, 16):
            expected = ("paged_cache", True)
        assert launched == ([] if expected is None else [expected])
    for b, length in enumerate(lengths):
        kb = np.concatenate([k[b, :length], k_new[b]])
        vb = np.concatenate([v[b, :length], v_new[b]])
        ref = reference.attention(q[b:b + 1], kb[None], vb[None], causal=True)
        assert_attention_accuracy(out[b:b + 1], ref, naive_attention(q[b:b + 1], kb[None], vb[None], "bfloat16", causal=True))


@gpu
def test_chunked_prefill_reads_a_contiguous_cache_through_cache_batch_idx():
    import cupy

    rng = np.random.default_rng(12)
    k, v, _ = _cache(rng, [900, 900, 900, 900], 2, 128, "float16")
    q = randn(rng, (2, 100, 4, 128), "float16")
    idx, lengths = np.array([3, 1], np.int32), np.array([900, 250], np.int32)
    out = cuattn.attention_with_kvcache(
        *map(cupy.asarray, (q, k, v)), cache_seqlens=cupy.asarray(lengths), cache_batch_idx=cupy.asarray(idx),
    ).get()
    ref = reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, cache_batch_idx=idx)
    for b in range(2):
        kb, vb = k[idx[b], :lengths[b]], v[idx[b], :lengths[b]]
        assert_attention_accuracy(out[b:b + 1], ref[b:b + 1], naive_attention(q[b:b + 1], kb[None], vb[None], "float16", causal=True))


@gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_grid_of_more_ctas_than_sms_takes_the_wide_ring(page_size):
    """More (sequence, KV head) CTAs than SMs: two CTAs per SM (contiguous: a shallower ring
    than its own; paged: its own ring)."""
    from cuattn.kernels import decode as plan
    from cuattn.loader import device_sm_count

    paged = page_size is not None
    assert plan.ctas_per_sm(128, paged, wide=True) == 2 and (paged or plan.stages(128, paged, wide=True) < plan.stages(128, paged))
    lengths = [int(x) for x in np.random.default_rng(14).integers(0, 400, 48)]
    assert plan.wide_grid(48, 4, 1, device_sm_count(0))
    _run(np.random.default_rng(14), lengths, 1, 16, 4, 128, "bfloat16", page_size)


@gpu
@pytest.mark.parametrize("head_dim, paged, softcap", [(96, True, None), (128, True, 30.0), (128, False, None), (64, True, None)])
def test_default_splits_fill_one_wave_of_resident_ctas(monkeypatch, head_dim, paged, softcap):
    """The split count chosen for a batch-1 step fits the SMs at once as the driver counts the
    kernel's CTAs per SM (registers included: paged d96 holds fewer than its shared memory
    allows), and fills at least half of that."""
    import cupy

    from cuattn import replay
    from cuattn.kernels import decode as plan
    from cuattn.loader import device_sm_count, device_smem_limit, resident_ctas

    replay.clear()  # the call plans afresh (a saved plan would not ask for the grid)
    grids, variants = [], []
    grid, variant_of = plan.grid, plan.variant
    monkeypatch.setattr(plan, "grid", lambda *a: grids.append(grid(*a)) or grids[-1])
    monkeypatch.setattr(plan, "variant", lambda *a, **k: variants.append(variant_of(*a, **k)) or variants[-1])
    _run(np.random.default_rng(15), [8000], 1, 32, 8, head_dim, "bfloat16", 16 if paged else None, **({} if softcap is None else {"softcap": softcap}))
    variant = variants[0]
    assert variant.family == "decode" and variant.kernel == "decode" and not device_smem_limit(0) < variant.dynamic_smem
    ctas, fit = int(np.prod(grids[0])), resident_ctas(variant, cupy.cuda.runtime.getDevice()) * device_sm_count(0)
    assert fit // 2 < ctas <= fit, (grids, fit)


EIGHT_WARP_CASES = [  # lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, num_splits, options
    ([2100, 0, 129, 4000], 1, 12, 4, 96, "float16", 2, {}),
    ([300, 5000], 3, 8, 2, 128, "float16", 3, {}),
    ([1, 400, 2100], 4, 8, 2, 128, "bfloat16", 1, dict(window=(100, 0))),
    ([1, 400, 2100], 4, 8, 2, 128, "bfloat16", 2, dict(softcap=20.0)),
    ([1, 400, 2100], 4, 8, 2, 96, "bfloat16", 1, dict(causal=False)),
    ([1, 400, 2100], 4, 8, 2, 128, "bfloat16", 2, dict(window=(64, 3), causal=False, scale=0.05)),
]


@gpu
@pytest.mark.parametrize("lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, splits, kw", EIGHT_WARP_CASES)
def test_eight_warp_ctas_match_the_reference(monkeypatch, lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, splits, kw):
    """Contiguous caches whose splits hold 1024+ positions take 8-warp CTAs (asserted): ragged
    lengths with a 0, several new tokens, windows, softcap, no causal mask, several splits."""
    from cuattn import replay
    from cuattn.kernels import decode as plan

    replay.clear()  # the call plans afresh (a saved plan would not choose)
    chosen = []
    cta_warps = plan.cta_warps
    monkeypatch.setattr(plan, "cta_warps", lambda *a, **k: chosen.append(cta_warps(*a, **k)) or chosen[-1])
    _run(np.random.default_rng(sum(lengths) + splits), lengths, seqlen_q, heads_q, heads_kv, head_dim, dtype, None, num_splits=splits, **kw)
    assert chosen and chosen[-1] == plan.EIGHT_WARPS, chosen


@gpu
@pytest.mark.parametrize("fast_path", [False, True])
@pytest.mark.parametrize("head_dim", [96, 128])
def test_eight_warp_ctas_in_one_long_split_launch_as_ordinary_grids(monkeypatch, head_dim, fast_path):
    """A contiguous cache of 8192+ positions, one split, eight-warp CTAs: an ordinary launch (no
    dependent launch taken), the reference's result, and the same bits as the same kernel
    launched as a dependent grid; ragged lengths, one of them 0, one past a 128-key block edge."""
    import cupy

    from cuattn import launch, replay
    from cuattn.kernels import decode as plan

    lengths = [8192, 0, 8321, 77]
    monkeypatch.setattr(replay, "enabled", fast_path)
    replay.clear()
    before = launch.taken
    out, lse = _run(np.random.default_rng(head_dim + 5), lengths, 1, 16, 2, head_dim, "bfloat16", None, num_splits=1)
    assert launch.taken == before
    out_again, _ = _run(np.random.default_rng(head_dim + 5), lengths, 1, 16, 2, head_dim, "bfloat16", None, num_splits=1)  # replayed if fast_path
    assert launch.taken == before
    np.testing.assert_array_equal(out_again.view(np.uint16), out.view(np.uint16))
    monkeypatch.setattr(plan, "dependent_launch", lambda *a: True)
    replay.clear()
    dependent_out, dependent_lse = _run(np.random.default_rng(head_dim + 5), lengths, 1, 16, 2, head_dim, "bfloat16", None, num_splits=1)
    assert launch.taken == before + (1 if launch.enabled() and launch.supported(cupy.cuda.Device().id) else 0)
    np.testing.assert_array_equal(dependent_out.view(np.uint16), out.view(np.uint16))
    np.testing.assert_array_equal(dependent_lse, lse)


@gpu
@pytest.mark.parametrize("splits", [1, 3, 33, 128])
def test_explicit_splits_agree_with_the_reference(splits):
    _run(np.random.default_rng(9), [2000, 0, 129], 1, 8, 2, 128, "bfloat16", 16, num_splits=splits)


@gpu
@pytest.mark.parametrize("head_dim", [40, 96, 160, 256])
def test_split_merge_at_head_dims_off_the_lane_width(head_dim):
    """The merge of the splits reads 4 columns per lane: head dims that leave lanes idle."""
    _run(np.random.default_rng(10), [900, 37], 2, 8, 4, head_dim, "float16", None, num_splits=5)


@gpu
def test_device_values_are_clamped_into_the_cache():
    """Lengths past the capacity read the whole cache; page numbers past either end read the
    first / last page; nothing outside the cache is read (it would fault or differ)."""
    import cupy

    rng = np.random.default_rng(10)
    k, v, table = _cache(rng, [96, 96], 2, 64, "float16", page_size=32, spare_pages=0)
    q = randn(rng, (2, 1, 2, 64), "float16")
    bad_table = table.copy()
    bad_table[0, 1], bad_table[1, 2] = -7, 10**6
    out = cuattn.attention_with_kvcache(
        *map(cupy.asarray, (q, k, v)), cache_seqlens=cupy.asarray(np.array([10**6, 96], np.int32)), block_table=cupy.asarray(bad_table),
    ).get()
    clamped = np.clip(bad_table, 0, k.shape[0] - 1)
    ref = reference.attention_with_kvcache(q, k, v, cache_seqlens=np.array([96, 96]), block_table=clamped)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=5e-3)


@gpu
@pytest.mark.parametrize("seqlen_q", [1, 80])
def test_one_captured_graph_serves_new_lengths_and_page_tables(seqlen_q):
    """The call captured in a CuPy stream graph, replayed after the lengths and the block table
    were rewritten in place, equals the eager call on the new values (decode, chunked prefill)."""
    import cupy

    rng = np.random.default_rng(11)
    k, v, table = _cache(rng, [0, 0, 0], 2, 128, "bfloat16", page_size=16, capacity=2048, spare_pages=40)
    q = cupy.asarray(randn(rng, (3, seqlen_q, 8, 128), "bfloat16"))
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    seqlens, table_d = cupy.asarray(np.array([5, 1000, 2048], np.int32)), cupy.asarray(table)
    cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=seqlens, block_table=table_d)  # compile outside the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        captured = cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=seqlens, block_table=table_d)
        graph = stream.end_capture()
    for lengths in ([5, 1000, 2048], [2048, 0, 17], [333, 1, 1024]):
        with stream:  # the rewrites ordered before the replay (a non-blocking stream skips the default stream's work)
            seqlens[...] = cupy.asarray(np.array(lengths, np.int32))
            table_d[...] = cupy.asarray(rng.permutation(k.shape[0])[: table.size].reshape(table.shape).astype(np.int32))
            graph.launch(stream)
        stream.synchronize()
        eager = cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=seqlens, block_table=table_d)
        np.testing.assert_array_equal(captured.get(), eager.get())
        ref = reference.attention_with_kvcache(q.get(), k, v, cache_seqlens=np.array(lengths), block_table=table_d.get())
        np.testing.assert_allclose(captured.get().astype(np.float64), ref, atol=2e-2)


@gpu
def test_a_captured_graph_keeps_its_scratch_from_later_allocations():
    """The split decode's partials are scratch: allocated during a CuPy stream capture, they
    stay cuattn's (CuPy's pool would hand them to the next allocation, which every replay of
    the graph then overwrote); arrays allocated on that stream after the capture keep their
    values through replays, and the graph's result equals the eager call's."""
    import cupy

    rng = np.random.default_rng(12)
    k, v, _ = _cache(rng, [3000, 3000], 2, 128, "bfloat16", capacity=4096)
    q = cupy.asarray(randn(rng, (2, 1, 8, 128), "bfloat16"))
    kd, vd, lengths = cupy.asarray(k), cupy.asarray(v), cupy.asarray(np.array([3000, 2000], np.int32))
    eager = cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=lengths, num_splits=16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        captured = cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=lengths, num_splits=16)
        graph = stream.end_capture()
        later = [cupy.full(1 << bits, 0x5A, cupy.uint8) for bits in range(10, 25)]  # would take the freed scratch
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    assert all(bool((x == 0x5A).all()) for x in later)
    np.testing.assert_array_equal(captured.get().view(np.uint16), eager.get().view(np.uint16))


def _expected_append(k, table, lengths, k_new, rows=None):
    """The host cache after appending: row t of sequence b at position lengths[b] + t of its
    cache row (``rows[b]``, else b) or pages, skipping positions past the capacity, pages and
    rows outside the cache (as the kernel does)."""
    k = k.copy()
    for b in range(k_new.shape[0]):
        for t in range(k_new.shape[1]):
            pos = int(lengths[b]) + t
            if table is None:
                row = b if rows is None else int(rows[b])
                if pos < k.shape[1] and 0 <= row < k.shape[0]:
                    k[row, pos] = k_new[b, t]
            elif pos < table.shape[1] * k.shape[1] and 0 <= table[b, pos // k.shape[1]] < k.shape[0]:
                k[table[b, pos // k.shape[1]], pos % k.shape[1]] = k_new[b, t]
    return k


@pytest.mark.parametrize("page_size", [None, 16, 7])
def test_the_reference_appends_k_new_before_attending(page_size):
    """reference.attention_with_kvcache took k_new / v_new into ``**_`` and attended to the cache
    without them; it now appends them to copies (the caches it is given are unchanged), as
    the test's own append does, and refuses a keyword it does not know."""
    rng = np.random.default_rng(5)
    lengths = np.array([0, 15, 40], np.int32)
    k, v, table = _cache(rng, [int(x) + 4 for x in lengths], 2, 32, "float32", page_size)
    q, k_new, v_new = (rng.standard_normal((3, 4, h, 32)).astype(np.float32) for h in (4, 2, 2))
    before = k.copy(), v.copy()
    got = reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, k_new=k_new, v_new=v_new, block_table=table)
    np.testing.assert_array_equal(k, before[0])
    np.testing.assert_array_equal(v, before[1])
    expected = reference.attention_with_kvcache(
        q, _expected_append(k, table, lengths, k_new), _expected_append(v, table, lengths, v_new), cache_seqlens=lengths + 4,
        block_table=table,
    )
    np.testing.assert_array_equal(got, expected)
    assert not np.allclose(got, reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths + 4, block_table=table))
    with pytest.raises(TypeError):
        reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, windows=(3, 0))


@gpu
@pytest.mark.parametrize("page_size, seqlen_new", [(None, 1), (None, 5), (1, 3), (16, 5), (16, 1), (7, 9), (None, 70), (16, 96), (7, 65)])
def test_append_then_attend(page_size, seqlen_new):
    """k_new / v_new land at cache_seqlens[b] + t (across pages), the rest of the cache is
    untouched, and the new tokens attend to the updated cache; append_kv alone writes the same."""
    import cupy

    rng = np.random.default_rng(13 + seqlen_new)
    lengths = np.array([0, 15, 300, 37], np.int32)
    k, v, table = _cache(rng, [int(x) + seqlen_new for x in lengths], 2, 64, "bfloat16", page_size)
    q = randn(rng, (4, seqlen_new, 8, 64), "bfloat16")
    k_new, v_new = (randn(rng, (4, seqlen_new, 2, 64), "bfloat16") for _ in range(2))
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    tables = {} if table is None else {"block_table": cupy.asarray(table)}
    out = cuattn.attention_with_kvcache(
        cupy.asarray(q), kd, vd, cache_seqlens=cupy.asarray(lengths), k_new=cupy.asarray(k_new), v_new=cupy.asarray(v_new), **tables,
    ).get()
    k_after, v_after = _expected_append(k, table, lengths, k_new), _expected_append(v, table, lengths, v_new)
    np.testing.assert_array_equal(kd.get(), k_after)
    np.testing.assert_array_equal(vd.get(), v_after)
    ref = reference.attention_with_kvcache(q, k_after, v_after, cache_seqlens=lengths + seqlen_new, block_table=table)
    for b in range(4):
        kb, vb = _gathered(k_after, v_after, table, b, int(lengths[b]) + seqlen_new)
        assert_attention_accuracy(out[b:b + 1], ref[b:b + 1], naive_attention(q[b:b + 1], kb[None], vb[None], "bfloat16", causal=True))
    kd2, vd2 = cupy.asarray(k), cupy.asarray(v)
    cuattn.append_kv(cupy.asarray(k_new), cupy.asarray(v_new), kd2, vd2, cache_seqlens=cupy.asarray(lengths), **tables)
    np.testing.assert_array_equal(kd2.get(), k_after)
    np.testing.assert_array_equal(vd2.get(), v_after)


@gpu
def test_appends_past_the_capacity_or_outside_the_pages_are_skipped():
    """Device lengths near the capacity and table entries out of range: the rows that would
    land outside are dropped, and every other element of the cache keeps its value."""
    import cupy

    rng = np.random.default_rng(14)
    k, v, table = _cache(rng, [64, 64, 64], 1, 32, "float16", page_size=16, spare_pages=2)
    table[1, 3], table[2, 0] = -1, 10**6
    lengths = np.array([60, 2**31 - 3, 2], np.int32)  # rows 4, 5 of sequence 0 pass the capacity; 1 is near INT_MAX
    k_new, v_new = (randn(rng, (3, 6, 1, 32), "float16") for _ in range(2))
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    cuattn.append_kv(cupy.asarray(k_new), cupy.asarray(v_new), kd, vd, cache_seqlens=cupy.asarray(lengths), block_table=cupy.asarray(table))
    np.testing.assert_array_equal(kd.get(), _expected_append(k, table, lengths, k_new))
    np.testing.assert_array_equal(vd.get(), _expected_append(v, table, lengths, v_new))
    assert (kd.get() != k).sum() > 0


@gpu
def test_appends_through_cache_batch_idx_write_only_their_own_rows():
    """A contiguous cache of 5 rows for 4 sequences picked by cache_batch_idx on the device, two
    of them out of range: the others' new rows land in the rows they name, and the out-of-range
    ones write nothing (reads clamp such an index into the cache; an append clamped so would
    write another sequence's row)."""
    import cupy

    rng = np.random.default_rng(15)
    k, v, _ = _cache(rng, [40] * 5, 2, 64, "bfloat16")
    rows, lengths = np.array([3, 9, 0, -1], np.int32), np.array([5, 0, 38, 7], np.int32)
    k_new, v_new = (randn(rng, (4, 3, 2, 64), "bfloat16") for _ in range(2))
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    cuattn.append_kv(cupy.asarray(k_new), cupy.asarray(v_new), kd, vd, cache_seqlens=cupy.asarray(lengths), cache_batch_idx=cupy.asarray(rows))
    np.testing.assert_array_equal(kd.get(), _expected_append(k, None, lengths, k_new, rows))
    np.testing.assert_array_equal(vd.get(), _expected_append(v, None, lengths, v_new, rows))
    untouched = [1, 2, 4]  # row 0 takes two of sequence 2's rows (the third passes the capacity), row 3 sequence 0's
    np.testing.assert_array_equal(kd.get()[untouched], k[untouched])
    np.testing.assert_array_equal(vd.get()[untouched], v[untouched])


@gpu
def test_one_torch_cuda_graph_serves_new_lengths_and_page_tables():
    """The same through torch.cuda.CUDAGraph, appending the step's new token in place."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(15)
    k, v, table = _cache(rng, [0, 0], 8, 128, "bfloat16", page_size=16, capacity=1024, spare_pages=10)
    q = torch.randn(2, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k_new, v_new = (torch.randn(2, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kd, vd = torch.tensor(k.astype(np.float32), device="cuda").bfloat16(), torch.tensor(v.astype(np.float32), device="cuda").bfloat16()
    seqlens, table_d = torch.tensor([3, 500], dtype=torch.int32, device="cuda"), torch.tensor(table, device="cuda")

    def step():
        return cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=seqlens, k_new=k_new, v_new=v_new, block_table=table_d)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for lengths in ([0, 1000], [511, 17], [1023, 64]):
        seqlens.copy_(torch.tensor(lengths, dtype=torch.int32))
        table_d.copy_(torch.tensor(rng.permutation(k.shape[0])[: table.size].reshape(table.shape).astype(np.int32)))
        graph.replay()
        torch.cuda.synchronize()
        k_before, v_before = kd.clone(), vd.clone()
        eager = step()  # appends the same rows again at the same positions: the cache is unchanged
        torch.testing.assert_close(kd, k_before, rtol=0, atol=0)
        torch.testing.assert_close(vd, v_before, rtol=0, atol=0)
        torch.testing.assert_close(captured, eager, rtol=0, atol=0)
        ref = reference.attention_with_kvcache(
            q.float().cpu().numpy(), kd.float().cpu().numpy(), vd.float().cpu().numpy(), cache_seqlens=np.array(lengths) + 1,
            block_table=table_d.cpu().numpy())
        np.testing.assert_allclose(captured.float().cpu().numpy(), ref, atol=2e-2)


@gpu
@pytest.mark.parametrize("page_size", [None, 16])
def test_out_is_written_on_every_call_and_checked_against_every_argument(page_size):
    """out= (a separate array, or q itself) gets the allocating call's bits, recorded and
    replayed; an out that overlaps cache_seqlens raises, also after a good call of the same
    shapes was cached."""
    import cupy

    from cuattn import replay

    rng = np.random.default_rng(8)
    k, v, table = (None if x is None else cupy.asarray(x) for x in _cache(rng, [700, 33], 2, 64, "bfloat16", page_size))
    q = cupy.asarray(randn(rng, (2, 1, 8, 64), "bfloat16"))
    args = dict(cache_seqlens=cupy.asarray(np.array([700, 33], np.int32)), block_table=table)
    expected = cuattn.attention_with_kvcache(q, k, v, **args).get()
    replays = replay.counters.replays
    for _ in range(3):
        dst = cupy.full_like(q, np.nan)
        assert cuattn.attention_with_kvcache(q, k, v, out=dst, **args) is dst
        np.testing.assert_array_equal(dst.get().view(np.uint16), expected.view(np.uint16))
    assert replay.counters.replays >= replays + 2
    bytes_ = cupy.zeros(q.size * 2 + 64, np.uint8)
    overlapping = bytes_[: q.size * 2].view(q.dtype).reshape(q.shape)
    lengths = bytes_[:8].view(np.int32)  # the first 8 bytes of out
    lengths[...] = cupy.asarray(np.array([700, 33], np.int32))
    for _ in range(2):  # the second after a good call of these shapes
        with pytest.raises(ValueError, match="out overlaps cache_seqlens"):
            cuattn.attention_with_kvcache(q, k, v, out=overlapping, cache_seqlens=lengths, block_table=table)
        cuattn.attention_with_kvcache(q, k, v, out=cupy.empty_like(q), cache_seqlens=lengths, block_table=table)
    q2 = q.copy()
    assert cuattn.attention_with_kvcache(q2, k, v, out=q2, **args) is q2
    np.testing.assert_array_equal(q2.get().view(np.uint16), expected.view(np.uint16))


# --- argument checks (no GPU: NumPy inputs are uploaded only after validation) ---------------


def _host_args(batch=2, seqlen_q=1, heads_q=4, heads_kv=2, head_dim=64, capacity=32, dtype=np.float16):
    q = np.ones((batch, seqlen_q, heads_q, head_dim), dtype)
    k = np.ones((batch, capacity, heads_kv, head_dim), dtype)
    return {"q": q, "k_cache": k, "v_cache": k.copy(), "cache_seqlens": np.array([3, 32], np.int32)[:batch]}


def _paged(a):
    k = np.ones((5, 8, 2, 64), np.float16)
    return {**a, "k_cache": k, "v_cache": k.copy(), "block_table": np.array([[0, 1, 2, 3], [4, 3, 2, 1]], np.int32)}


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "q": a["q"].astype(np.float32)}, TypeError, r"q has dtype float32; supported: float16, bfloat16"),
    (lambda a: {**a, "q": a["q"][0]}, ValueError, r"q must have 4 dimensions"),
    (lambda a: {**a, "v_cache": a["v_cache"][:, :16]}, ValueError, r"v_cache has shape"),
    (lambda a: {**a, "k_cache": a["k_cache"][..., :32], "v_cache": a["v_cache"][..., :32]}, ValueError, r"k_cache has head_dim 32"),
    (lambda a: {**a, "q": np.ones((2, 1, 3, 64), np.float16)}, ValueError, r"multiple of heads_kv"),
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].astype(np.int64)}, ValueError, r"cache_seqlens must be int32"),
    (lambda a: {**a, "cache_seqlens": np.array([3], np.int32)}, ValueError, r"cache_seqlens has shape"),
    (lambda a: {**a, "cache_seqlens": np.array([3, 33], np.int32)}, ValueError, r"cache_seqlens\[1\] is 33, outside \[0, 32\]"),
    (lambda a: {**a, "cache_seqlens": np.array([-1, 3], np.int32)}, ValueError, r"cache_seqlens\[0\] is -1"),
    (lambda a: {**a, "k_cache": a["k_cache"][:1], "v_cache": a["v_cache"][:1]}, ValueError, r"pass cache_batch_idx"),
    (lambda a: {**a, "cache_batch_idx": np.array([0, 2], np.int32)}, ValueError, r"cache_batch_idx\[1\] is 2, outside \[0, 1\]"),
    (lambda a: {**_paged(a), "cache_batch_idx": np.array([0, 1], np.int32)}, ValueError, r"cache_batch_idx is for contiguous caches"),
    (lambda a: {**_paged(a), "block_table": np.array([[0, 1, 2, 3], [4, 3, 2, 5]], np.int32)}, ValueError, r"block_table\[1, 3\] is 5"),
    (lambda a: {**_paged(a), "block_table": np.array([0, 1], np.int32)}, ValueError, r"block_table must have 2 dimensions"),
    (lambda a: {**_paged(a), "cache_seqlens": np.array([3, 33], np.int32)}, ValueError, r"outside \[0, 32\]"),
    (lambda a: {**a, "num_splits": 0}, ValueError, r"num_splits must be from 1"),
    (lambda a: {**a, "k_cache": a["k_cache"][:0], "v_cache": a["v_cache"][:0], "cache_batch_idx": np.array([0, 0], np.int32)},
     ValueError, r"k_cache holds no rows"),
    (lambda a: {**a, "num_splits": 2.0}, TypeError, r"num_splits must be an int"),
    (lambda a: {**a, "cache_seqlens": None}, TypeError, r"cache_seqlens is required"),
    (lambda a: {**a, "causal": 1}, TypeError, r"causal must be a bool"),
    (lambda a: {**a, "softcap": -1.0}, ValueError, r"softcap"),
    (lambda a: {**a, "k_new": np.ones((2, 1, 2, 64), np.float16)}, TypeError, r"k_new and v_new go together"),
    (lambda a: {**a, "k_new": np.ones((2, 1, 2, 64), np.float16), "v_new": np.ones((), np.float16)}, ValueError,
     r"v_new must have 4 dimensions"),  # ranked before its strides are read (was an IndexError)
    (lambda a: {**a, "k_new": np.ones((2, 1, 2, 64), np.float16), "v_new": np.ones((2, 1, 2, 64), np.float16)}, TypeError,
     r"k_cache and v_cache are written in place, which numpy arrays cannot be"),
])
def test_kvcache_rejects_bad_arguments(change, error, match):
    args = change(_host_args())
    with pytest.raises(error, match=match):
        cuattn.attention_with_kvcache(**args)


def test_append_kv_refuses_rows_that_are_not_whole_16_byte_chunks():
    """A head_dim of 12 would let the append copy 16-byte chunks past the rows."""
    k_new = np.ones((2, 1, 2, 16), np.float16)[..., :12]
    cache = np.ones((2, 32, 2, 16), np.float16)[..., :12]
    with pytest.raises(ValueError, match=r"head_dim 12 is not supported"):
        cuattn.append_kv(k_new, k_new.copy(), cache, cache.copy(), cache_seqlens=np.array([1, 2], np.int32))


def test_split_count_takes_the_resident_ctas_the_driver_counts():
    """Registers can hold fewer CTAs per SM than shared memory would: the split count follows
    the lower number, never the higher."""
    from cuattn.kernels import decode as plan

    by_smem = plan.ctas_per_sm(96, True)
    assert by_smem == 4
    assert plan.num_splits(96, True, 1, 8, 1, 8192, 132) == by_smem * 132 // 8
    assert plan.num_splits(96, True, 1, 8, 1, 8192, 132, resident=3) == 3 * 132 // 8
    assert plan.num_splits(96, True, 1, 8, 1, 8192, 132, resident=9) == by_smem * 132 // 8
    assert plan.num_splits(96, True, 1, 8, 1, 8192, 132, resident=0) == 132 // 8


def test_reference_reads_pages_like_a_contiguous_cache():
    rng = np.random.default_rng(12)
    k, v, table = _cache(rng, [37, 64], 2, 16, "float32", page_size=8)
    q = randn(rng, (2, 3, 4, 16), "float32")
    lengths = np.array([37, 64])
    paged = reference.attention_with_kvcache(q, k, v, cache_seqlens=lengths, block_table=table)
    contiguous = np.stack([np.concatenate(list(k[table[b]])) for b in range(2)]), np.stack([np.concatenate(list(v[table[b]])) for b in range(2)])
    np.testing.assert_array_equal(paged, reference.attention_with_kvcache(q, *contiguous, cache_seqlens=lengths))
    for b in range(2):
        kb, vb = contiguous[0][b:b + 1, :lengths[b]], contiguous[1][b:b + 1, :lengths[b]]
        np.testing.assert_array_equal(paged[b:b + 1], reference.attention(q[b:b + 1], kb, vb, causal=True))


@gpu
@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "k_new": a["k_new"][:, :, :1], "v_new": a["v_new"][:, :, :1]}, ValueError, r"k_new has shape"),
    (lambda a: {**a, "v_new": a["v_new"][:, :1]}, ValueError, r"v_new has shape"),
    (lambda a: {**a, "k_new": a["k_new"].astype(np.float32), "v_new": a["v_new"].astype(np.float32)}, TypeError, r"k_new has dtype float32"),
    (lambda a: {**a, "k_new": a["k_new"][:, :1].repeat(33, axis=1), "v_new": a["v_new"][:, :1].repeat(33, axis=1)}, ValueError,
     r"k_new has 33 new rows per sequence but the cache holds at most 32 positions"),  # was accepted, its last rows dropped
])
def test_append_rejects_bad_arguments(change, error, match):
    import cupy

    a = {k: cupy.asarray(x) for k, x in _host_args().items()}
    a["k_new"], a["v_new"] = (cupy.ones((2, 2, 2, 64), np.float16) for _ in range(2))
    a = change(a)
    with pytest.raises(error, match=match):
        cuattn.attention_with_kvcache(**a)
    append = {name: a[name] for name in ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens", "block_table", "cache_batch_idx") if name in a}
    with pytest.raises(error, match=match):
        cuattn.append_kv(**append)


# --- PyTorch ops -----------------------------------------------------------------------------


def _torch_step_inputs(torch, paged=True):
    rng = np.random.default_rng(16)
    k, v, table = _cache(rng, [0, 0], 2, 64, "float16", page_size=16 if paged else None, capacity=512, spare_pages=4)
    dev = lambda x: torch.tensor(x.astype(np.float32) if x.dtype != np.int32 else x, device="cuda")  # noqa: E731
    k_cache, v_cache = dev(k).half(), dev(v).half()
    q = dev(randn(rng, (2, 2, 8, 64), "float16")).half()
    k_new, v_new = (dev(randn(rng, (2, 2, 2, 64), "float16")).half() for _ in range(2))
    lengths = torch.tensor([7, 300], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, lengths, k_new, v_new, None if table is None else dev(table)


@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_torch_compile_fullgraph_decode_step_matches_eager(paged):
    """A decode step (append, then attend) compiled with fullgraph=True: same output and the
    same cache writes as eager (the op declares the cache mutated)."""
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    def step(q, k_cache, v_cache, lengths, k_new, v_new, table):
        return ct.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new, block_table=table,
                                         softcap=30.0, return_lse=True)

    eager_inputs, compiled_inputs = _torch_step_inputs(torch, paged), _torch_step_inputs(torch, paged)
    eager = step(*eager_inputs)
    compiled = torch.compile(step, fullgraph=True)(*compiled_inputs)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=0, atol=0)
    torch.testing.assert_close(compiled_inputs[1], eager_inputs[1], rtol=0, atol=0)  # the appended keys
    torch.testing.assert_close(compiled_inputs[2], eager_inputs[2], rtol=0, atol=0)
    q, k_cache, v_cache, lengths, *_, table = eager_inputs
    ref = reference.attention_with_kvcache(
        q.float().cpu().numpy(), k_cache.float().cpu().numpy(), v_cache.float().cpu().numpy(), cache_seqlens=lengths.cpu().numpy() + 2,
        block_table=None if table is None else table.cpu().numpy(), softcap=30.0)
    np.testing.assert_allclose(eager[0].float().cpu().numpy(), ref, atol=5e-3)


@gpu
def test_torch_decode_ops_pass_opcheck():
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    q, k_cache, v_cache, lengths, k_new, v_new, table = _torch_step_inputs(torch)
    options = dict(causal=True, window_left=-1, window_right=-1, scale=0.125, softcap=0.0, num_splits=-1)
    torch.library.opcheck(ct.op("attention_with_kvcache"), (q, k_cache, v_cache, lengths, None, None, table, None, None), options)
    torch.library.opcheck(ct.op("attention_with_kvcache"), (q, k_cache, v_cache, lengths, k_new, v_new, table, None, None), {**options, "num_splits": 3})
    torch.library.opcheck(ct.op("append_kv"), (k_new, v_new, k_cache, v_cache, lengths, table, None))
    torch.library.opcheck(ct.op("attention_with_kvcache_readonly"), (q, k_cache, v_cache, lengths, table, None, None), options)


@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_torch_compile_read_only_step_declares_no_write(paged):
    """Without k_new the traced call is the read-only op: the compiled graph holds no mutation
    of the cache (no copy_ back into it), and matches eager."""
    torch = pytest.importorskip("torch")
    import cuattn.torch as ct

    def step(q, k_cache, v_cache, lengths, table):
        return ct.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, block_table=table)

    q, k_cache, v_cache, lengths, _, _, table = _torch_step_inputs(torch, paged)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(step, fullgraph=True, backend=backend)(q, k_cache, v_cache, lengths, table)
    torch.testing.assert_close(compiled, step(q, k_cache, v_cache, lengths, table), rtol=0, atol=0)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert any("attention_with_kvcache_readonly" in t for t in targets), targets
    assert not any("copy_" in t or t.endswith("attention_with_kvcache.default") for t in targets), targets


@gpu
def test_dependent_launches_match_ordinary_launches(monkeypatch):
    """On Hopper the decode kernel and the merge of its splits start under the tail of the grid
    before them (programmatic dependent launch) and wait for it on the device: the same bits as
    ordinary launches, on the full path and on the replayed plan."""
    import cupy

    from cuattn import launch, replay

    rng = np.random.default_rng(21)
    k, v, table = _cache(rng, [3000, 1, 700], 2, 128, "bfloat16", 16)
    q = randn(rng, (3, 1, 8, 128), "bfloat16")
    args = [cupy.asarray(x) for x in (q, k, v)]
    kw = {"cache_seqlens": cupy.asarray(np.array([3000, 1, 700], np.int32)), "block_table": cupy.asarray(table), "num_splits": 7}
    results, taken = [], {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("CUATTN_PDL", pdl)
        before = launch.taken
        for fast_path in (False, True):
            monkeypatch.setattr(replay, "enabled", fast_path)
            replay.clear()
            results += [cuattn.attention_with_kvcache(*args, **kw, return_lse=True) for _ in range(2)]
        taken[pdl] = launch.taken - before
    # Two kernels a call, four calls: every one a dependent launch the driver took, where supported.
    assert taken == {"0": 0, "1": 8 if launch.supported(cupy.cuda.Device().id) else 0}, taken
    first_out, first_lse = (x.get() for x in results[0])
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out.get().view(np.uint16), first_out.view(np.uint16))
        np.testing.assert_array_equal(lse.get(), first_lse)
    if launch.supported(cupy.cuda.Device().id):
        plan = next(p for p in replay._plans.values() if p is not None and len(p.launches) == 2)
        assert all(launch_.dependent is not None for launch_ in plan.launches)  # the decode kernel and the merge
    assert launch.refused is None


@gpu
@pytest.mark.parametrize("paged", [False, True])
def test_prefetch_before_the_wait_changes_no_bit(monkeypatch, paged):
    """The decode kernel pulls its split's first key blocks into L2 before it waits for the grid
    ahead (DecodeParams::prefetch_blocks): contiguous caches always, paged ones under a dependent
    launch. Results are the same bits with and without it, calls issued back to back after a
    kernel that rewrites the cache (so a prefetch may see the old contents)."""
    import cupy

    from cuattn import launch, replay
    from cuattn.kernels import decode as plan

    rng = np.random.default_rng(22)
    lengths = [3000, 1, 700]
    k, v, table = _cache(rng, lengths, 2, 128, "float16", 16 if paged else None)
    q = cupy.asarray(randn(rng, (3, 1, 8, 128), "float16"))
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    kw = {"cache_seqlens": cupy.asarray(np.array(lengths, np.int32)), "num_splits": 6}
    if paged:
        kw["block_table"] = cupy.asarray(table)
    seen = []
    original = plan.prefetch_blocks
    monkeypatch.setattr(plan, "prefetch_blocks", lambda *a: seen.append(original(*a)) or seen[-1])
    dependent = launch.enabled() and launch.supported(cupy.cuda.Device().id)
    results = []
    for blocks in (None, 0):
        if blocks is not None:
            monkeypatch.setattr(plan, "prefetch_blocks", lambda *a: 0)
        replay.clear()
        for _ in range(3):
            kd *= 1  # a kernel that writes the cache just ahead of the call
            results.append(cuattn.attention_with_kvcache(q, kd, vd, **kw, return_lse=True))
    assert seen and set(seen) == {plan.PREFETCH_BLOCKS if dependent or not paged else 0}  # 3000 keys, 6 splits: 500 keys a split
    first_out, first_lse = (x.get() for x in results[0])
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out.get().view(np.uint16), first_out.view(np.uint16))
        np.testing.assert_array_equal(lse.get(), first_lse)


_LATE_WRITER = r"""
extern "C" __global__ void late_writer(int* rows, const int* values, int n, long long spin) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // the decode grid may start now
  const long long start = clock64();
  while (clock64() - start < spin) {}
  if (threadIdx.x < n) rows[threadIdx.x] = values[threadIdx.x];
}
"""


@gpu
def test_index_arrays_written_by_an_early_releasing_kernel_are_read_after_the_wait():
    """A kernel ahead that lets the decode grid start at once (griddepcontrol.launch_dependents)
    and then rewrites cache_batch_idx: the decode kernel prefetches from the old rows but reads
    the cache through the new ones, after its wait (Hopper's dependent launches)."""
    import cupy

    from cuattn import launch

    if not (launch.enabled() and launch.supported(cupy.cuda.Device().id)):
        pytest.skip("dependent launches: Hopper")
    rng = np.random.default_rng(23)
    k, v, _ = _cache(rng, [2048] * 4, 2, 128, "float16")
    q = randn(rng, (2, 1, 8, 128), "float16")
    lengths = np.array([2048, 1500], np.int32)
    old_rows, new_rows = np.array([0, 1], np.int32), np.array([3, 2], np.int32)
    from cuattn.loader import device_arch

    writer = cupy.RawKernel(_LATE_WRITER, "late_writer", options=(f"-arch={device_arch()}",))
    rows, old_d, new_d, lengths_d = (cupy.asarray(x) for x in (old_rows, old_rows, new_rows, lengths))
    args = [cupy.asarray(x) for x in (q, k, v)]
    for _ in range(3):  # nothing but the writer between the reset and the call (no copy from the host)
        rows[...] = old_d
        writer((1,), (32,), (rows, new_d, np.int32(2), np.int64(200_000)))
        out = cuattn.attention_with_kvcache(*args, cache_seqlens=lengths_d, cache_batch_idx=rows).get()
        ref = reference.attention_with_kvcache(q, k[new_rows], v[new_rows], cache_seqlens=lengths)
        for b in range(2):
            naive = naive_attention(q[b:b + 1], k[new_rows[b]][None, :lengths[b]], v[new_rows[b]][None, :lengths[b]], "float16", causal=True)
            assert_attention_accuracy(out[b:b + 1], ref[b:b + 1], naive)


@gpu
def test_graph_with_copies_and_kernels_before_the_decode_step_matches_eager():
    """Dependent launches inside a captured graph: the step's inputs are written by a copy (a
    memcpy node) and by a kernel right before the decode kernels, which must see both."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(22)
    k, v, table = _cache(rng, [0, 0, 0], 4, 128, "bfloat16", page_size=16, capacity=2048, spare_pages=4)
    kd, vd = (torch.tensor(x.astype(np.float32), device="cuda").bfloat16() for x in (k, v))
    table_d = torch.tensor(table, device="cuda")
    q_src = torch.randn(3, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    lengths_src = torch.tensor([5, 2000, 700], dtype=torch.int32, device="cuda")
    q, seqlens = torch.empty_like(q_src), torch.empty_like(lengths_src)

    def step():
        seqlens.copy_(lengths_src)  # same dtype and layout: a memcpy
        torch.mul(q_src, 2, out=q)  # a kernel
        return cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=seqlens, block_table=table_d, num_splits=6)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for lengths in ([2000, 1, 64], [0, 1500, 2048]):
        lengths_src.copy_(torch.tensor(lengths, dtype=torch.int32))
        q_src.normal_()
        graph.replay()
        torch.cuda.synchronize()
        replayed = captured.clone()
        torch.testing.assert_close(replayed, step(), rtol=0, atol=0)


def test_a_cache_of_2_to_the_31_pages_is_a_value_error():
    """Cache rows and block-table entries are int32: a paged cache of 2**31 pages (32 GiB at
    head_dim 8, one KV head, pages of 1) raised an OverflowError while its parameters were
    packed; 2**31 - 1 pages pass the checks (boundary.trace: arrays known by shape only)."""
    from types import SimpleNamespace

    from cuattn import boundary

    spec = lambda shape, dtype: SimpleNamespace(shape=tuple(shape), dtype=np.dtype(dtype))  # noqa: E731
    q, lengths, table = spec((2, 1, 1, 8), np.float16), spec((2,), np.int32), spec((2, 4), np.int32)
    too_many = spec((2**31, 1, 1, 8), np.float16)
    with pytest.raises(ValueError, match=r"k_cache holds 2147483648 rows \(pages\)"):
        boundary.trace(cuattn.attention_with_kvcache, q, too_many, too_many, cache_seqlens=lengths, block_table=table)
    with pytest.raises(ValueError, match=r"k_cache holds 2147483648 rows \(pages\)"):
        boundary.trace(cuattn.append_kv, q, q, too_many, too_many, cache_seqlens=lengths, block_table=table)
    most = spec((2**31 - 1, 1, 1, 8), np.float16)
    boundary.trace(cuattn.attention_with_kvcache, q, most, most, cache_seqlens=lengths, block_table=table)


@gpu
def test_appends_refuse_caches_that_overlap_and_take_interleaved_ones():
    """The cache is written: k_cache and v_cache apart from each other and from every array
    the call reads (ValueError before any launch, the cache untouched); K and V interleaved in
    one buffer (no shared element) append and attend as separate arrays do."""
    import cupy

    rng = np.random.default_rng(21)
    k, v, _ = _cache(rng, [40, 9], 2, 64, "float16", capacity=48)
    q = cupy.asarray(randn(rng, (2, 1, 8, 64), "float16"))
    k_new, v_new = (cupy.asarray(randn(rng, (2, 1, 2, 64), "float16")) for _ in range(2))
    lengths = cupy.asarray(np.array([40, 9], np.int32))
    kd, vd = cupy.asarray(k), cupy.asarray(v)
    expected = cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=lengths, k_new=k_new, v_new=v_new).get()
    kv = cupy.stack([cupy.asarray(k), cupy.asarray(v)], axis=2)  # (batch, capacity, k / v, heads_kv, head_dim)
    for _ in range(2):  # recorded, then replayed
        kv[:, :, 0], kv[:, :, 1] = cupy.asarray(k), cupy.asarray(v)
        got = cuattn.attention_with_kvcache(q, kv[:, :, 0], kv[:, :, 1], cache_seqlens=lengths, k_new=k_new, v_new=v_new).get()
        np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))
        np.testing.assert_array_equal(kv[:, :, 0].get(), kd.get())
        np.testing.assert_array_equal(kv[:, :, 1].get(), vd.get())
    before = kd.get()
    for _ in range(2):  # the second after good calls of these shapes were cached
        for kwargs, match in [
            (dict(k_cache=kd, v_cache=kd), "k_cache overlaps v_cache"),
            (dict(k_cache=kd, v_cache=vd, k_new=kd[:, :1]), "k_cache overlaps k_new"),
            (dict(k_cache=kd, v_cache=vd, v_new=vd[:, 5:6]), "v_cache overlaps v_new"),
        ]:
            args = {"k_new": k_new, "v_new": v_new, **kwargs}
            with pytest.raises(ValueError, match=match):
                cuattn.attention_with_kvcache(q, args["k_cache"], args["v_cache"], cache_seqlens=lengths, k_new=args["k_new"], v_new=args["v_new"])
            with pytest.raises(ValueError, match=match):
                cuattn.append_kv(args["k_new"], args["v_new"], args["k_cache"], args["v_cache"], cache_seqlens=lengths)
        cuattn.attention_with_kvcache(q, kd, vd, cache_seqlens=lengths, k_new=k_new, v_new=v_new)
        before = kd.get()
    q_in_cache = vd[:, 44:48].reshape(2, 1, 8, 64)  # whole arrays are compared, not the rows an append reaches
    assert q_in_cache.data.ptr == vd[:, 44:].data.ptr
    with pytest.raises(ValueError, match="v_cache overlaps q"):
        cuattn.attention_with_kvcache(q_in_cache, kd, vd, cache_seqlens=lengths, k_new=k_new, v_new=v_new)
    np.testing.assert_array_equal(kd.get(), before)


def test_appends_validate_on_shapes_alone():
    """JAX traces an op on shapes and dtypes (no addresses, cuattn.boundary.trace): the caches'
    overlap check must pass such arrays, not take them all for one buffer at address 0."""
    from types import SimpleNamespace

    from cuattn import boundary

    spec = lambda shape, dtype: SimpleNamespace(shape=shape, dtype=np.dtype(dtype))  # noqa: E731
    cache, new = spec((2, 32, 2, 64), "float16"), spec((2, 1, 2, 64), "float16")
    q, lengths = spec((2, 1, 4, 64), "float16"), spec((2,), "int32")
    assert boundary.trace(cuattn.append_kv, new, new, cache, cache, cache_seqlens=lengths).allocations == []
    traced = boundary.trace(cuattn.attention_with_kvcache, q, cache, cache, cache_seqlens=lengths, k_new=new, v_new=new)
    assert traced.allocations == [((2, 1, 4, 64), np.dtype(np.float16))]
