"""Launch plan of the forward family (cuda_src/forward/): tile shapes, shared memory, grid and
variant selection of the tensor-core (forward.cu), Hopper (forward_wgmma.cu) and float32
(forward_fp32.cu) kernels."""

from __future__ import annotations

import functools

from cuattn.dtypes import cxx_type
from cuattn.kernels.variant import (
    ARCH_SMEM_OPTIN, CACHE_LAYOUTS, HEAD_DIM_BUCKETS, SEQ_LAYOUTS, WGMMA_ARCH, Variant, arch_smem_limit, dropout_arg, dropout_uri, layout_arg, layout_uri,
    softcap_arg, softcap_uri, tile_launches,
)

FAMILY = "forward"

# Tensor-core tiles per head-dim bucket: (BLOCK_M, BLOCK_N, WARPS), template arguments of
# forward_kernel; its ForwardTraits derive the shared memory (the kernel traps below it).
TILES = {
    32: (128, 64, 4),
    64: (128, 64, 4),
    96: (128, 32, 4),
    128: (128, 32, 4),
    160: (64, 32, 4),
    192: (64, 32, 4),
    224: (64, 32, 4),
    256: (64, 32, 4),
}
STAGES = 2  # K/V tiles in flight (ForwardTraits::kStages)
FP32_ROWS_PER_WARP, FP32_WARPS = 4, 4  # forward_fp32.cu: kF32RowsPerWarp, kF32Warps

# Hopper tiles per head-dim bucket: (BLOCK_N, WARPGROUPS, CTAS_PER_SM); every warpgroup owns 64
# query rows (scripts/tune_wgmma.py).
WGMMA_TILES = {64: (64, 2, 2), 128: (128, 2, 1), 256: (64, 2, 1)}
# Buckets without a Hopper tile of their own that run the next wider one: the columns past
# head_dim are zero-filled in shared memory and never stored, so the padded products are
# wasted work, and still 1.2-2x the portable kernel (NOTES, "Hopper forward"; at 32 the
# portable kernel is faster).
WGMMA_WIDER = {96: 128, 160: 256, 192: 256, 224: 256}
# The TMA forward (forward_tma.cu, dense layout; head dims above 32 on the narrowest tile that
# holds them, tma_tile): (BLOCK_N, STAGES, CONSUMERS) per tile; 64 query rows per consumer
# warpgroup and a producer warpgroup, one CTA per SM (scripts/tune_wgmma.py, tma candidates).
TMA_TILES = {64: (128, 2, 3), 128: (128, 2, 2), 192: (64, 2, 2), 256: (64, 2, 2)}
# Tilings for the forms that three consumers do not serve: softcap (the tanh's registers: 56
# bytes of spill at 160 per consumer) and block-sparse (a CTA's rows within one 128-row mask block).
TMA_NARROW_TILES = {64: (128, 2, 2)}
# Sequence layouts of the TMA forward: dense tensors, and KV caches (chunked prefill), paged ones
# for the page sizes tma_page_boxes takes.
TMA_LAYOUTS = ("dense", "cache", "paged_cache")


# (tile, softcap) whose paged form by TMA boxes spills in its producer (24 registers): the form by
# copies (40 registers) serves them.
TMA_PAGED_SPILLS = {(64, True)}
# Pages of fewer rows make TMA boxes too small for the TMA unit to keep up with the products: the
# producer copies them instead (forward_tma.cu PAGE_COPY; NOTES, "Hopper forward"), as it does
# page sizes the boxes cannot take (H100: pages of 16 faster by copies at every tile, of 32 by boxes).
TMA_BOX_MIN_PAGE = 32


def tma_page_boxes(page_size: int, block_n: int) -> int | None:
    """Rows of a TMA box of the paged forward (forward_tma.cu produce_paged): the page, or a
    block of it; None for page sizes whose boxes would not keep the 128-byte swizzle's 8-row
    period or would straddle a page."""
    box = min(page_size, block_n)
    return box if box % 8 == 0 and (block_n % page_size == 0 or page_size % block_n == 0) else None


def tma_page_copy(tile: int, softcap: bool, page_size: int) -> bool:
    """Whether the TMA forward's producer copies a paged cache's K and V (PAGE_COPY) rather
    than loading TMA boxes: pages under TMA_BOX_MIN_PAGE rows, page sizes the boxes cannot
    take, and the tile whose box form spills (TMA_PAGED_SPILLS)."""
    boxes = tma_page_boxes(page_size, tma_tiling(tile, softcap)[0])
    return boxes is None or page_size < TMA_BOX_MIN_PAGE or (tile, softcap) in TMA_PAGED_SPILLS
# (bucket, softcap) whose dropout form needs more registers than its CTAs per SM leave: CTAs per SM.
WGMMA_DROPOUT_CTAS = {(64, True): 1}


def page_ahead_bytes(block_n: int, layout: str) -> int:
    """Shared memory for a paged cache's key offsets in K and V, two key blocks (common/tile_copy.cuh)."""
    return 2 * 2 * block_n * 8 if layout == "paged_cache" else 0


def smem_bytes(bucket: int) -> int:
    block_m, block_n, _ = TILES[bucket]
    return (block_m + 2 * STAGES * block_n) * (bucket + 8) * 2


def wgmma_smem_bytes(bucket: int) -> int:
    block_n, warpgroups, _ = WGMMA_TILES[bucket]
    swizzle_alignment = 1024
    return (64 * warpgroups + 2 * STAGES * block_n) * bucket * 2 + swizzle_alignment


def _fold_arg(fold: bool, layout: str, dropout: bool = False, sparse: bool = False) -> tuple[str, str]:
    """(trailing template arguments, uri suffix) of a kernel that folds its result into an fp32
    accumulator (forward/accumulate.cuh; dense layout only), applies dropout, or follows a
    block mask."""
    if fold and layout != "dense":
        raise ValueError(f"the accumulating forward is compiled for the dense layout only, not {layout!r}")
    if fold and (dropout or sparse):
        raise ValueError("the accumulating forward is not compiled with dropout or a block mask")
    if dropout or sparse:
        return ", false" + dropout_arg(dropout, layout, sparse), dropout_uri(dropout, sparse)
    return (", true", "/fold") if fold else ("", "")


@functools.cache
def variant(
    c_type: str, bucket: int, softcap: bool, layout: str = "dense", fold: bool = False, dropout: bool = False, sparse: bool = False,
) -> Variant:
    """The portable kernel: tensor cores (mma.sync) for float16 / bfloat16, CUDA cores for
    float32 (which folds into an accumulator at run time: ``fold`` changes nothing there)."""
    if c_type == "float":
        return Variant(
            family=FAMILY, kernel="forward_fp32",
            expression=(f"cuattn::forward_fp32_kernel<{bucket}, {softcap_arg(softcap)}, {layout_arg(layout)}"
                        f"{dropout_arg(dropout, layout, sparse)}>"),
            uri=f"forward_fp32/d{bucket}" + softcap_uri(softcap) + layout_uri(layout) + dropout_uri(dropout, sparse),
            threads=FP32_WARPS * 32,
            block_m=FP32_ROWS_PER_WARP * FP32_WARPS,
            contract=(("cuattn::kF32Warps", FP32_WARPS), ("cuattn::kF32RowsPerWarp", FP32_ROWS_PER_WARP)),
        )
    block_m, block_n, warps = TILES[bucket]
    traits = f"cuattn::ForwardTraits<{bucket}, {block_m}, {block_n}, {warps}>"
    fold_arg, fold_uri = _fold_arg(fold, layout, dropout, sparse)
    return Variant(
        family=FAMILY, kernel="forward",
        expression=(f"cuattn::forward_kernel<{cxx_type(c_type)}, {bucket}, {block_m}, {block_n}, {warps}, {softcap_arg(softcap)}, "
                    f"{layout_arg(layout)}{fold_arg}>"),
        uri=f"forward/{c_type}/d{bucket}/m{block_m}n{block_n}w{warps}" + softcap_uri(softcap) + layout_uri(layout) + fold_uri,
        hot=True,
        dynamic_smem=smem_bytes(bucket) + page_ahead_bytes(block_n, layout),
        threads=warps * 32,
        block_m=block_m,
        contract=(
            (f"{traits}::kSmemBytes", smem_bytes(bucket)), (f"{traits}::kThreads", warps * 32),
            (f"cuattn::kPageAheadBytes<{block_n}>", page_ahead_bytes(block_n, "paged_cache")),
        ),
    )


@functools.cache
def wgmma_variant(
    c_type: str, bucket: int, softcap: bool, layout: str = "dense", fold: bool = False, dropout: bool = False, sparse: bool = False,
) -> Variant:
    block_n, warpgroups, ctas = WGMMA_TILES[bucket]
    if dropout:
        ctas = WGMMA_DROPOUT_CTAS.get((bucket, softcap), ctas)
    traits = f"cuattn::WgmmaForwardTraits<{bucket}, {block_n}, {warpgroups}>"
    fold_arg, fold_uri = _fold_arg(fold, layout, dropout, sparse)
    return Variant(
        family=FAMILY, kernel="forward_wgmma",
        expression=(f"cuattn::forward_wgmma_kernel<{cxx_type(c_type)}, {bucket}, {block_n}, {warpgroups}, {ctas}, {softcap_arg(softcap)}, "
                    f"{layout_arg(layout)}{fold_arg}>"),
        uri=f"forward_wgmma/{c_type}/d{bucket}/n{block_n}wg{warpgroups}c{ctas}" + softcap_uri(softcap) + layout_uri(layout) + fold_uri,
        hot=True,
        dynamic_smem=wgmma_smem_bytes(bucket) + page_ahead_bytes(block_n, layout),
        threads=128 * warpgroups,
        block_m=64 * warpgroups,
        archs=(WGMMA_ARCH,),
        contract=(
            (f"{traits}::kSmemBytes", wgmma_smem_bytes(bucket)), (f"{traits}::kThreads", 128 * warpgroups),
            (f"{traits}::kBlockM", 64 * warpgroups), (f"cuattn::kPageAheadBytes<{block_n}>", page_ahead_bytes(block_n, "paged_cache")),
        ),
    )


def tma_tiling(tile: int, softcap: bool, sparse: bool = False, several: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, STAGES, CONSUMERS) of the TMA forward at a tile (``several``: its SEVERAL form)."""
    return TMA_NARROW_TILES.get(tile, TMA_TILES[tile]) if softcap or sparse or several else TMA_TILES[tile]


def tma_smem_bytes(tile: int, softcap: bool = False, sparse: bool = False, several: bool = False) -> int:
    """TmaForwardTraits::kSmemBytes: Q's tile, the K and V rings, the swizzle realignment and
    the barriers, and (CTAs taking several row blocks) out's own tile where it fits sm_90's limit."""
    block_n, stages, consumers = tma_tiling(tile, softcap, sparse, several)
    q_bytes = 64 * consumers * tile * 2
    base = q_bytes + 2 * stages * block_n * tile * 2 + 1024 + (2 + 4 * stages) * 8
    return base + (q_bytes if several and base + q_bytes <= ARCH_SMEM_OPTIN[WGMMA_ARCH] else 0)


def tma_takes_several(tile: int, softcap: bool, sparse: bool = False) -> bool:
    """Whether the TMA forward has a form whose CTAs take several row blocks (forward_tma.cu
    SEVERAL: two consumer warpgroups, the narrow tiling at head_dim 64; no block mask)."""
    return not sparse and tma_tiling(tile, softcap, several=True)[2] == 2


@functools.cache
def tma_variant(
    c_type: str, tile: int, softcap: bool, sparse: bool = False, several: bool = False, layout: str = "dense", fold: bool = False,
    page_copy: bool = False,
) -> Variant:
    """The TMA forward at a tile; ``several``: its SEVERAL form (tma_takes_several); ``layout``:
    "dense", "cache" or "paged_cache" (KV caches: one row block per CTA); ``fold``: the form that
    folds into an fp32 accumulator (dense, one row block per CTA, no block mask); ``page_copy``:
    the paged form whose producer copies K and V (any page size) instead of loading TMA boxes."""
    if several and not tma_takes_several(tile, softcap, sparse):
        raise ValueError(f"no TMA forward taking several row blocks per CTA at tile {tile} (softcap {softcap}, sparse {sparse})")
    if layout not in TMA_LAYOUTS or (layout != "dense" and (sparse or several)) or (
            layout == "paged_cache" and not page_copy and (tile, softcap) in TMA_PAGED_SPILLS) or (
            page_copy and layout != "paged_cache"):
        raise ValueError(f"no TMA forward for layout {layout!r} at tile {tile} with softcap={softcap}, sparse={sparse}, several={several}, "
                         f"page_copy={page_copy}")
    if fold and (layout != "dense" or sparse or several):
        raise ValueError(f"the accumulating TMA forward is dense with one row block per CTA (layout {layout!r}, sparse {sparse}, several {several})")
    block_n, stages, consumers = tma_tiling(tile, softcap, sparse, several)
    traits = f"cuattn::TmaForwardTraits<{tile}, {block_n}, {stages}, {consumers}, {'true' if several else 'false'}>"
    threads, block_m = 128 * (consumers + 1), 64 * consumers
    flags = (f", false, false, {layout_arg(layout)}, true>" if fold else f", false, false, {layout_arg(layout)}, false, true>" if page_copy
             else f", false, false, {layout_arg(layout)}>" if layout != "dense" else ", false, true>" if several else ", true>" if sparse else ">")
    smem = tma_smem_bytes(tile, softcap, sparse, several)
    return Variant(
        family=FAMILY, kernel="forward_tma",
        expression=f"cuattn::forward_tma_kernel<{cxx_type(c_type)}, {tile}, {block_n}, {stages}, {consumers}, {softcap_arg(softcap)}" + flags,
        uri=f"forward_tma/{c_type}/d{tile}/n{block_n}s{stages}c{consumers}" + softcap_uri(softcap) + dropout_uri(False, sparse)
        + ("/several" if several else "") + layout_uri(layout) + ("/fold" if fold else "") + ("/copies" if page_copy else ""),
        hot=True,
        dynamic_smem=smem,
        threads=threads,
        block_m=block_m,
        archs=(WGMMA_ARCH,),
        several_row_blocks=several,
        contract=((f"{traits}::kSmemBytes", smem), (f"{traits}::kThreads", threads), (f"{traits}::kBlockM", block_m)),
    )


def tma_tile(head_dim: int) -> int | None:
    """The TMA tile of a head dim: the narrowest that holds it (its columns past head_dim
    zero-filled by the TMA unit and never stored, as WGMMA_WIDER does), None at 32 and below,
    where the portable kernel is faster."""
    return next((tile for tile in sorted(TMA_TILES) if tile >= head_dim), None) if head_dim > 32 else None


def tma_serves(c_type: str, head_dim: int, arch: str, allow: bool, layout: str, fold: bool, dropout: bool, sparse: bool) -> bool:
    """Whether the TMA forward takes a call of these kinds (its tensors' maps decide the rest:
    cuattn/tensor_map.py)."""
    return (allow and arch == WGMMA_ARCH and c_type in ("f16", "bf16") and tma_tile(head_dim) is not None and layout in TMA_LAYOUTS
            and not (dropout or (sparse and layout != "dense") or (fold and (layout != "dense" or sparse))))


def select(
    c_type: str, bucket: int, softcap: bool, arch: str, allow_wgmma: bool = True, layout: str = "dense", fold: bool = False,
    dropout: bool = False, sparse: bool = False,
) -> Variant:
    """The forward kernel for a problem on a target: the Hopper kernel where one exists for its
    bucket (or for the next wider one, WGMMA_WIDER), else the portable one; ``fold``: the form
    that folds into an fp32 accumulator; ``dropout``: the form with dropout
    (common/dropout.cuh); ``sparse``: the block-sparse form (common/block_sparse.cuh)."""
    tile = WGMMA_WIDER.get(bucket, bucket)
    if allow_wgmma and arch == WGMMA_ARCH and c_type != "float" and tile in WGMMA_TILES:
        return wgmma_variant(c_type, tile, softcap, layout, fold, dropout, sparse)
    return variant(c_type, bucket, softcap, layout, fold and c_type != "float", dropout, sparse)


def launches(v: Variant, rows: int, heads_q: int, batch: int) -> list[tuple[tuple, tuple, int]]:
    """One CTA per (block of query rows, query head, sequence)."""
    return tile_launches(v, rows, heads_q, batch)


# The TMA forward's CTAs take two row blocks each on sequences of at most this many row blocks,
# and while the K / V that the CTAs running at once read stays within this share of L2
# (tma_row_blocks_per_cta). At head_dim 64 the SEVERAL form has two consumer warpgroups against
# the one-block form's three, and wins only under a band mask up to TMA_D64_SEVERAL_ROW_BLOCKS,
# there with four row blocks per CTA (TMA_D64_BANDED_PER_CTA) where that still leaves two waves.
TMA_PAIRED_MAX_ROW_BLOCKS = 32
TMA_L2_SHARE = 24 << 20
TMA_D64_SEVERAL_ROW_BLOCKS = 8
TMA_D64_BANDED_PER_CTA = 4


def tma_row_blocks_per_cta(rows: int, block_m: int, heads_batch: int, sm_count: int, kv_bytes_per_head: int, banded: bool, tile: int) -> int:
    """Row blocks of one (head, sequence) that a CTA of the TMA forward takes in turn (2 or 4:
    its SEVERAL form, whose tiles are ``block_m`` rows: forward_tma.cu CtaRowBlocks; the
    producer loads a tile's Q and first K block while the consumers finish the one before, and
    under a causal mask a CTA's blocks, taken in pairs, add up to about the same work), or 1.
    Two where the sequence has at most TMA_PAIRED_MAX_ROW_BLOCKS, that leaves two waves of CTAs,
    and either the K / V of the heads worked on at once (``kv_bytes_per_head`` each) fits
    TMA_L2_SHARE or the mask is a band (causal, window) over 16 or more blocks; at head_dim 64
    (``tile``) only under a band up to TMA_D64_SEVERAL_ROW_BLOCKS, and then
    TMA_D64_BANDED_PER_CTA where that too leaves two waves. Measured in NOTES ("Hopper forward
    with a producer warpgroup")."""
    row_blocks = -(-rows // block_m)
    ctas_per_head = -(-row_blocks // 2)
    if row_blocks > TMA_PAIRED_MAX_ROW_BLOCKS or ctas_per_head * heads_batch < 2 * sm_count:
        return 1
    if tile == 64:
        if not banded or row_blocks > TMA_D64_SEVERAL_ROW_BLOCKS:
            return 1
        return TMA_D64_BANDED_PER_CTA if -(-row_blocks // TMA_D64_BANDED_PER_CTA) * heads_batch >= 2 * sm_count else 2
    fits_l2 = -(-sm_count // ctas_per_head) * kv_bytes_per_head <= TMA_L2_SHARE
    return 2 if fits_l2 or (banded and row_blocks >= 16) else 1


def tma_launches(v: Variant, rows: int, heads_q: int, batch: int, per_cta: int) -> list[tuple[tuple, tuple, int]]:
    """Launches of the TMA forward whose CTAs take ``per_cta`` row blocks each (more than one:
    the SEVERAL form)."""
    if per_cta > 1 and not v.several_row_blocks:
        raise ValueError(f"{v.uri} takes one row block per CTA")
    plan = tile_launches(v, rows, heads_q, batch)
    return [((-(-grid[0] // per_cta),) + grid[1:], block, b0) for grid, block, b0 in plan]


def variants(arch: str | None = None) -> list[Variant]:
    """Every forward variant; with ``arch``, those whose shared memory fits it (the paged-cache
    kernels at head_dim 256 do not fit 99 KB parts)."""
    out = []
    for c_type in ("f16", "bf16"):  # the accumulating forms (attention_chunked)
        for bucket in HEAD_DIM_BUCKETS:
            for softcap in (False, True):
                out.append(variant(c_type, bucket, softcap, "dense", fold=True))
                if bucket in WGMMA_TILES:
                    out.append(wgmma_variant(c_type, bucket, softcap, "dense", fold=True))
    for c_type in ("f16", "bf16", "float"):  # block-sparse
        for bucket in HEAD_DIM_BUCKETS:
            for softcap in (False, True):
                out.append(variant(c_type, bucket, softcap, sparse=True))
                if bucket in WGMMA_TILES and c_type != "float":
                    out.append(wgmma_variant(c_type, bucket, softcap, sparse=True))
    for layout in SEQ_LAYOUTS:  # with dropout
        for c_type in ("f16", "bf16", "float"):
            for bucket in HEAD_DIM_BUCKETS:
                for softcap in (False, True):
                    out.append(variant(c_type, bucket, softcap, layout, dropout=True))
                    if bucket in WGMMA_TILES and c_type != "float":
                        out.append(wgmma_variant(c_type, bucket, softcap, layout, dropout=True))
    for c_type in ("f16", "bf16"):
        for tile in TMA_TILES:
            for softcap in (False, True):
                out.append(tma_variant(c_type, tile, softcap))
                out.append(tma_variant(c_type, tile, softcap, sparse=True))
                if tma_takes_several(tile, softcap):
                    out.append(tma_variant(c_type, tile, softcap, several=True))
                out.append(tma_variant(c_type, tile, softcap, fold=True))
                out.append(tma_variant(c_type, tile, softcap, layout="cache"))
                if (tile, softcap) not in TMA_PAGED_SPILLS:
                    out.append(tma_variant(c_type, tile, softcap, layout="paged_cache"))
                out.append(tma_variant(c_type, tile, softcap, layout="paged_cache", page_copy=True))
    for layout in SEQ_LAYOUTS + CACHE_LAYOUTS:
        for c_type in ("f16", "bf16") + (("float",) if layout in SEQ_LAYOUTS else ()):
            for bucket in HEAD_DIM_BUCKETS:
                for softcap in (False, True):
                    out.append(variant(c_type, bucket, softcap, layout))
        for c_type in ("f16", "bf16"):
            for bucket in WGMMA_TILES:
                for softcap in (False, True):
                    out.append(wgmma_variant(c_type, bucket, softcap, layout))
    return out if arch is None else [v for v in out if v.dynamic_smem <= arch_smem_limit(arch)]


def common_variants() -> list[Variant]:
    return [make(c, d, False) for make in (variant, wgmma_variant) for c in ("f16", "bf16") for d in (64, 128)]
