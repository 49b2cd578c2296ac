"""Which tensors and calls the Hopper TMA forward and backward take (no GPU needed)."""

import pytest

from cuattn import tensor_map
from cuattn.kernels import backward, forward

SHAPE = (2, 300, 4, 128)
CONTIGUOUS = (300 * 4 * 128, 4 * 128, 128, 1)


def test_describable_tensors_have_16_byte_addresses_and_strides():
    assert tensor_map.describable(1 << 20, SHAPE, CONTIGUOUS)
    assert tensor_map.describable(1 << 20, SHAPE, (300 * 4 * 128, 128, 300 * 128, 1))  # (batch, heads, seqlen) memory
    assert not tensor_map.describable((1 << 20) + 8, SHAPE, CONTIGUOUS)
    assert not tensor_map.describable(1 << 20, SHAPE, (300 * 4 * 132, 4 * 132, 132, 1))  # rows 264 bytes apart
    assert not tensor_map.describable(1 << 20, SHAPE, (-300 * 4 * 128, 4 * 128, 128, 1))
    assert not tensor_map.describable(1 << 20, SHAPE, (300 * 4 * 256, 4 * 256, 256, 2))


def test_only_dense_plain_16_bit_calls_on_hopper_take_the_tma_forward():
    serves = forward.tma_serves
    assert serves("bf16", 128, "sm_90a", True, "dense", False, False, False)
    assert serves("f16", 64, "sm_90a", True, "dense", False, False, False)
    assert serves("bf16", 256, "sm_90a", True, "dense", False, False, False)
    assert not serves("bf16", 128, "sm_80", True, "dense", False, False, False)
    assert not serves("bf16", 128, "sm_90a", False, "dense", False, False, False)
    assert not serves("float", 128, "sm_90a", True, "dense", False, False, False)
    assert serves("bf16", 96, "sm_90a", True, "dense", False, False, False)  # on the 128 tile, zero-filled
    assert [forward.tma_tile(d) for d in (8, 32, 40, 64, 72, 128, 136, 192, 200, 256)] == [None, None, 64, 64, 128, 128, 192, 192, 256, 256]
    assert not serves("bf16", 32, "sm_90a", True, "dense", False, False, False)
    assert not serves("bf16", 128, "sm_90a", True, "packed", False, False, False)
    for layout in ("cache", "paged_cache"):  # KV caches (chunked prefill)
        assert serves("bf16", 128, "sm_90a", True, layout, False, False, False)
    # Paged: boxes of a page or of BLOCK_N rows of one, whole swizzle periods (8 rows).
    assert [forward.tma_page_boxes(page, 128) for page in (1, 4, 7, 8, 16, 48, 64, 128, 256, 384, 100)] == [
        None, None, None, 8, 16, None, 64, 128, 128, 128, None]
    assert forward.tma_page_boxes(128, 64) == 64 and forward.tma_page_boxes(96, 64) is None
    # The producer copies pages under 32 rows and those the boxes cannot take (d64 softcap at any
    # page size: its box form spills).
    assert [forward.tma_page_copy(128, False, page) for page in (1, 7, 8, 16, 31, 32, 48, 64, 256, 100)] == [
        True, True, True, True, True, False, True, False, False, True]
    for tile in (64, 192, 256):
        assert [forward.tma_page_copy(tile, False, page) for page in (1, 8, 16, 32, 48)] == [True, True, True, False, True]
    assert forward.tma_page_copy(64, True, 64) and not forward.tma_page_copy(64, False, 64) and not forward.tma_page_copy(256, True, 64)
    assert forward.tma_variant("bf16", 128, False, layout="paged_cache", page_copy=True).uri.endswith("/paged_cache/copies")
    for kw in ({"layout": "cache"}, {"layout": "dense"}):
        with pytest.raises(ValueError, match="no TMA forward for layout"):
            forward.tma_variant("bf16", kw.pop("tile", 128), False, page_copy=True, **kw)
    assert forward.tma_variant("bf16", 128, False, layout="cache").uri.endswith("/cache")
    with pytest.raises(ValueError, match="no TMA forward for layout"):
        forward.tma_variant("bf16", 128, False, several=True, layout="cache")
    assert not serves("bf16", 128, "sm_90a", True, "dense", False, True, False)  # dropout
    assert serves("bf16", 128, "sm_90a", True, "dense", True, False, False)  # folding into an accumulator: dense alone
    for layout in ("cache", "paged_cache"):
        assert not serves("bf16", 128, "sm_90a", True, layout, True, False, False)
    assert not serves("bf16", 128, "sm_90a", True, "dense", True, False, True)
    assert forward.tma_variant("bf16", 192, False, fold=True).uri.endswith("/fold")
    for kw in ({"several": True}, {"sparse": True}, {"layout": "cache"}):
        with pytest.raises(ValueError):
            forward.tma_variant("bf16", 128, False, fold=True, **kw)
    assert serves("bf16", 128, "sm_90a", True, "dense", False, False, True)  # block-sparse
    assert forward.tma_variant("bf16", 64, False, sparse=True).block_m == 128  # within one mask block


def test_tma_variants_are_compiled_for_hopper_only():
    variants = [v for v in forward.variants() if v.kernel == "forward_tma"]
    several = sum(forward.tma_takes_several(tile, softcap) for tile in forward.TMA_TILES for softcap in (False, True))
    paged = 2 * len(forward.TMA_TILES) - len(forward.TMA_PAGED_SPILLS) + 2 * len(forward.TMA_TILES)  # by boxes, by copies
    assert len(variants) == 2 * (len(forward.TMA_TILES) * 2 * 4 + paged + several)  # dense, block-sparse, fold, cache, paged; SEVERAL
    assert all(v.archs == ("sm_90a",) and v.threads == 2 * v.block_m + 128 for v in variants)
    assert not [v for v in forward.variants("sm_80") if v.kernel == "forward_tma" and v.builds_for("sm_80")]



@pytest.mark.parametrize(
    "tile, row_blocks, heads_batch, kv_bytes, banded, expected",
    [
        (128, 8, 256, 1 << 19, False, 2),  # d128 1k: 33 heads at once x 512 KB
        (256, 8, 128, 1 << 20, False, 1),  # d256 1k: 33 MB
        (256, 8, 128, 1 << 20, True, 1),  # causal, but under 16 blocks
        (256, 16, 64, 1 << 21, True, 2),  # d256 2k causal
        (128, 32, 64, 1 << 21, False, 2),
        (128, 33, 64, 1 << 10, True, 1),  # long sequences: one
        (128, 8, 64, 1 << 10, False, 1),  # under two waves
        (128, 9, 60, 1 << 10, False, 2),
        (64, 8, 512, 1 << 18, True, 4),  # d64 1k causal
        (64, 4, 140, 1 << 17, True, 2),  # d64 512 causal: four per CTA would leave one wave
        (64, 4, 1024, 1 << 17, True, 4),  # d64 512 causal
        (64, 8, 512, 1 << 18, False, 1),  # d64: three consumers without a band
        (64, 16, 256, 1 << 19, True, 1),  # d64 2k causal
    ],
)
def test_tma_forward_ctas_take_two_row_blocks_on_short_sequences(tile, row_blocks, heads_batch, kv_bytes, banded, expected):
    """Two row blocks per CTA of the TMA forward on sequences of up to 32 row blocks where that
    leaves two waves of CTAs on 132 SMs and the K / V in flight fits the L2 share (or the mask is
    a band over 16+ blocks), at head_dim 64 under a band up to 8 blocks, four there where that
    too leaves two waves; else one. The grid's x shrinks to match, on the SEVERAL form only."""
    rows = row_blocks * 128 - 5
    assert forward.tma_row_blocks_per_cta(rows, 128, heads_batch, 132, kv_bytes, banded, tile) == expected
    several = forward.tma_variant("bf16", tile, False, several=True)
    plan = forward.tma_launches(several, rows, 4, 3, expected)
    assert plan == [((-(-row_blocks // expected), 4, 3), (384, 1, 1), 0)]
    with pytest.raises(ValueError, match="one row block per CTA"):
        forward.tma_launches(forward.tma_variant("bf16", tile, False), rows, 4, 3, 2)


def test_tma_forward_takes_several_row_blocks_with_two_consumer_warpgroups():
    """Every tiling has a SEVERAL form without a block mask, with two consumer warpgroups (at
    head_dim 64 the narrow tiling), staging out in a tile of its own where Q's tile, the rings
    and out's tile fit sm_90's 232448 bytes (64, 128, 192), else in Q's tile (256)."""
    for tile in forward.TMA_TILES:
        for softcap in (False, True):
            assert forward.tma_takes_several(tile, softcap) and not forward.tma_takes_several(tile, softcap, sparse=True)
            several = forward.tma_variant("bf16", tile, softcap, several=True)
            block_n, stages, consumers = forward.tma_tiling(tile, softcap, several=True)
            assert consumers == 2 and several.threads == 384 and several.uri.endswith("/several")
            q_bytes = 64 * consumers * tile * 2
            without_out = q_bytes + 2 * stages * block_n * tile * 2 + 1024 + (2 + 4 * stages) * 8
            assert several.dynamic_smem == without_out + (q_bytes if tile < 256 else 0) <= 232448
        with pytest.raises(ValueError, match="no TMA forward taking several"):
            forward.tma_variant("bf16", tile, False, sparse=True, several=True)


def test_only_dense_16_bit_fused_backwards_without_dropout_on_hopper_take_the_tma_backward():
    serves = backward.tma_serves
    assert serves("bf16", 128, False, "sm_90a", True, "dense", False, False)
    assert serves("f16", 64, False, "sm_90a", True, "dense", False, False)
    assert serves("bf16", 96, True, "sm_90a", True, "dense", False, False)  # on the 128 tile, zero-filled
    assert not serves("bf16", 64, True, "sm_90a", True, "dense", False, False)  # its softcap form would spill
    assert not serves("bf16", 40, False, "sm_90a", True, "dense", False, False)  # no Hopper tile of its own
    assert not serves("bf16", 256, False, "sm_90a", True, "dense", False, False)
    assert not serves("float", 128, False, "sm_90a", True, "dense", False, False)
    assert not serves("bf16", 128, False, "sm_80", True, "dense", False, False)
    assert not serves("bf16", 128, False, "sm_90a", False, "dense", False, False)
    assert not serves("bf16", 128, False, "sm_90a", True, "packed", False, False)
    assert not serves("bf16", 128, False, "sm_90a", True, "dense", True, False)  # dropout
    assert serves("bf16", 128, False, "sm_90a", True, "dense", False, True)  # block mask
    assert not serves("bf16", 128, True, "sm_90a", True, "dense", False, True)  # block mask and softcap: the two-kernel backward
    assert not serves("bf16", 64, False, "sm_90a", True, "dense", False, True)  # its block-sparse form would spill
    variants = [v for v in backward.variants() if v.kernel == "backward_tma"]
    assert sorted(v.uri for v in variants) == sorted(
        f"backward_tma/{c}/d{t}/m{backward.TMA_TILES[t][0]}s2{s}{m}" for c in ("f16", "bf16") for t in (64, 128) for s in ("", "/softcap")
        for m in ("", "/sparse") if not ((s or m) and t == 64) and not (s and m))
    grid = backward.BackwardGrid("dense", 1, 1000, 1000, 4, 2, 128, 1000, 1000)
    one_pass = [v.uri for v, _ in backward.launches(grid, "bf16", False, "sm_90a", True, 232448, True, sparse=True, tma=True)][1]
    assert one_pass == "backward_tma/bf16/d128/m64s2/sparse"
    with pytest.raises(ValueError, match="without a block mask"):
        backward.launches(grid, "bf16", False, "sm_90a", True, 232448, True, sparse=True, tma=True, tma_splits=2)
    assert all(v.archs == ("sm_90a",) and v.threads == 384 and v.block_m == 128 for v in variants)


@pytest.mark.parametrize("first_word", [True, False])
def test_tagged_addresses_are_written_into_a_stand_in_map(monkeypatch, first_word):
    """A recording's tagged address (past 48 bits, refused by the driver) goes into the first
    word of the same map encoded at accepted addresses, only where the driver keeps the address
    there and nowhere else."""
    calls = []

    def fake_driver(c_type, ptr, shape, strides, box_rows):
        calls.append(ptr)
        if ptr >= 1 << 48:
            return None
        body = bytes(range(120)) if first_word else (ptr >> 4).to_bytes(8, "little") + bytes(112)
        return ptr.to_bytes(8, "little") + body

    monkeypatch.setattr(tensor_map, "_encode_at", fake_driver)
    real = tensor_map.encode("bf16", 1 << 20, SHAPE, CONTIGUOUS, 128)
    assert real[:8] == (1 << 20).to_bytes(8, "little") and calls == [1 << 20]
    tagged = (0x5EED << 48) + (1 << 39)
    encoded = tensor_map.encode("bf16", tagged, SHAPE, CONTIGUOUS, 128)
    assert all(ptr < 1 << 48 for ptr in calls)  # the driver never sees the tag
    if first_word:
        assert encoded == tagged.to_bytes(8, "little") + bytes(range(120))
    else:
        assert encoded is None


@pytest.mark.parametrize("batch, seqlen, heads_q, heads_kv, head_dim, expected", [
    (16, 1024, 16, 2, 128, 4),  # grouped queries: 256 CTAs of (key block, KV head, sequence)
    (4, 4096, 16, 2, 128, 4),
    (1, 8192, 32, 8, 128, 2),  # a ring step's own shard: 512 CTAs
    (32, 512, 16, 2, 128, 4),  # 64 query steps a CTA: four splits of 16
    (16, 1024, 16, 16, 128, 1),  # as many KV heads as query heads: 2048 CTAs
    (2, 1024, 32, 32, 64, 1),
    (1, 128, 4, 1, 64, 1),  # too few steps to share
    (4, 4096, 8, 8, 256, 1),  # no TMA backward at head_dim 256
])
def test_tma_backward_splits_key_blocks_while_their_ctas_are_few(batch, seqlen, heads_q, heads_kv, head_dim, expected):
    g = backward.BackwardGrid("dense", batch, seqlen, seqlen, heads_q, heads_kv, head_dim, batch * seqlen, batch * seqlen)
    assert backward.tma_query_splits(g, 132) == expected
    packed = backward.BackwardGrid("packed", batch, seqlen, seqlen, heads_q, heads_kv, head_dim, batch * seqlen, batch * seqlen)
    assert backward.tma_query_splits(packed, 132) == 1
    assert backward.tma_query_splits(g, 132, sparse=True) == 1  # a block mask's steps are not split
