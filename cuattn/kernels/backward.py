"""Launch plan of the backward family (cuda_src/backward/): the row kernels (backward_prep,
backward_dq_finish), the tensor-core dQ and dK/dV kernels, their Hopper twins and the Hopper
fused kernel, the one-launch kernel of small problems, the float32 kernels, the sinks' gradient;
their tiles, shared memory, grids and selection."""

from __future__ import annotations

import dataclasses
import functools

from cuattn.dtypes import cxx_type
from cuattn.kernels.variant import (
    HEAD_DIM_BUCKETS, MAX_GRID_YZ, MAX_SMEM_OPTIN, SEQ_LAYOUTS, WGMMA_ARCH, Variant, arch_smem_limit, dropout_arg, dropout_uri, head_dim_bucket,
    layout_arg, layout_uri, softcap_arg, softcap_uri, tile_launches,
)

FAMILY = "backward"

# Tensor-core kernels (backward/traits.cuh): 4 warps of 16 resident rows per CTA; the other
# operand streams through a two-stage ring.
BLOCK = 64  # resident rows per CTA
STAGES = 2
# Row kernels: warps per CTA (kPrepWarps, kFinishWarps) and lanes per query row
# (backward/head_rows.cuh kRowLanes), so 32 rows per CTA.
ROW_WARPS, ROW_LANES = 8, 8
ROWS_PER_CTA = ROW_WARPS * 32 // ROW_LANES
# Float32 kernels (backward/fp32_tiles.cuh): resident rows per warp, warps, streamed rows per step.
FP32_ROWS_PER_WARP, FP32_WARPS, FP32_TILE = 4, 4, 32
DQ_TILE_ROWS = 64  # rows per tile of the fused kernel's dQ accumulator (backward/dq_accum.cuh)
SINK_GRAD_WARPS = 32  # one CTA per query head (backward/sink_grad.cu)

# Hopper kernels per head-dim bucket: (rows per streamed block, WARPGROUPS, CTAS_PER_SM); keys
# stream for dQ, queries for dK/dV and the fused kernel; every warpgroup owns 64 resident rows
# (scripts/tune_wgmma.py).
WGMMA_TILES = {
    "backward_dq": {64: (64, 2, 2), 128: (64, 1, 2)},
    "backward_dkdv": {64: (64, 1, 2), 128: (64, 1, 2)},
}
WGMMA_FUSED_TILES = {64: (64, 1, 3), 128: (64, 2, 1), 192: (64, 2, 1), 256: (64, 2, 1)}
# Above head_dim 128 the fused kernel's two warpgroups share 64 keys, each with a share of the
# gradients' columns (WgmmaBackwardTraits::kColumnSplits: 128 + 128 at 256, 128 + 64 at 192).
WGMMA_COLUMN_SPLIT_ABOVE = 128
# Buckets without a Hopper tile of their own that run the next wider one, as the forward's
# (forward.WGMMA_WIDER): columns past head_dim zero-filled by the copies, never stored.
WGMMA_WIDER = {96: 128, 160: 192, 224: 256}
# The TMA backward (backward_tma.cu; dense 16-bit calls of the fused kernel without dropout,
# block-sparse ones included): 128 keys per CTA on two consumer warpgroups and a producer warpgroup; per head-dim
# tile (BLOCK_M query rows per step, STAGES ring slots).
TMA_TILES = {64: (128, 2), 128: (64, 2)}
TMA_KEYS = 128  # TmaBackwardTraits::kBlockResident: the K / V rows a CTA keeps (and their tensor maps' box)
TMA_THREADS = 384
TMA_NO_SOFTCAP = {64}  # tiles whose softcap form spills: the fused kernel serves it
TMA_NO_SPARSE = {64}  # tiles whose block-sparse form spills (92 bytes at 64; 240 registers are its consumers' most)
# (Block-sparse calls with softcap take no TMA form either: their fused kernel would spill, so
# they plan no dQ accumulator and run the two-kernel backward: WGMMA_SPARSE_PORTABLE.)
# Kernel and (bucket, softcap) whose dropout form needs more registers than its CTAs per SM
# leave (spills): CTAs per SM.
WGMMA_DROPOUT_CTAS = {
    "backward_wgmma_dq": {(64, False): 1, (64, True): 1},
    "backward_wgmma_fused": {(64, False): 2, (64, True): 2},
}
# (kernel, bucket, softcap, layout) whose Hopper form with dropout needs more than 255 registers:
# the portable kernel serves them.
WGMMA_DROPOUT_PORTABLE = {("backward_dkdv", 128, True, "packed")}
# Likewise (kernel, bucket, softcap) of the block-sparse forms (the fused one: the two-kernel
# backward serves it), and CTAs per SM of those that need more registers.
WGMMA_SPARSE_PORTABLE = {("backward_dkdv", 128, True), ("backward_wgmma_fused", 128, True)}
WGMMA_SPARSE_CTAS = {"backward_wgmma_dq": {(64, True): 1}, "backward_wgmma_fused": {(64, True): 2}}
# (kernel, bucket, softcap) of portable block-sparse forms that keep the grid's own order: the
# launch order's registers would spill (dkdv_block.cuh kDkdvOrdered).
DKDV_UNORDERED = {("backward_dkdv", 224, True)}


def wgmma_serves(kernel: str, bucket: int, softcap: bool, layout: str, dropout: bool, sparse: bool = False) -> bool:
    """Whether backward_dq / backward_dkdv has a Hopper form for these."""
    return (
        bucket in WGMMA_TILES[kernel]
        and not (dropout and (kernel, bucket, softcap, layout) in WGMMA_DROPOUT_PORTABLE)
        and not (sparse and (kernel, bucket, softcap) in WGMMA_SPARSE_PORTABLE)
    )


def dkdv_splits(bucket: int) -> int:
    """CTAs per key block, each with a slice of dK / dV's columns (backward_dkdv.cu kDkdvSplits)."""
    return 2 if bucket > 128 else 1


def stream_rows(kernel: str, bucket: int, dropout: bool = False) -> int:
    """Rows per streamed block where shared memory allows: queries in backward_dkdv (32 above
    d64, where dK and dV take head_dim registers), keys in backward_dq (32 above d128, where the
    dQ accumulator alone takes 128 registers); 16 from d224 with dropout, whose draws need more."""
    if dropout and bucket >= 224:
        return 16
    return 32 if bucket > (64 if kernel == "backward_dkdv" else 128) else 64


def smem_bytes(bucket: int, stream: int, stats_in_smem: bool) -> int:
    row = bucket + 8
    stats = 2 * STAGES * stream * 4 if stats_in_smem else 0
    return (2 * BLOCK * row + 2 * STAGES * stream * row) * 2 + stats


def tile(kernel: str, bucket: int, smem_limit: int, dropout: bool = False) -> tuple[int, bool]:
    """(rows per streamed block, lse / delta staged in shared memory) of a tensor-core kernel
    under a per-block shared-memory limit: the preferred tile, else halved down to 16 rows, else
    (backward_dkdv, head_dim 256 on a 99 KB device) the row stats left in global memory.
    backward_dq reads its rows' statistics once, never through shared memory."""
    for stats in (True, False) if kernel == "backward_dkdv" else (False,):
        stream = stream_rows(kernel, bucket, dropout)
        while stream >= 16:
            if smem_bytes(bucket, stream, stats) <= smem_limit:
                return stream, stats
            stream //= 2
    raise ValueError(f"{kernel} at head_dim bucket {bucket} needs more than {smem_limit} bytes of shared memory per block")


def wgmma_smem_bytes(kernel: str, bucket: int) -> int:
    stream, warpgroups, _ = WGMMA_TILES[kernel][bucket]
    resident, swizzle_alignment = 64 * warpgroups, 1024
    return (2 * resident + 2 * STAGES * stream) * bucket * 2 + 2 * STAGES * stream * 4 + swizzle_alignment


def fused_keys(bucket: int) -> int:
    """Keys per CTA of the fused kernel (WgmmaBackwardTraits::kBlockResident)."""
    return 64 if bucket > WGMMA_COLUMN_SPLIT_ABOVE else 64 * WGMMA_FUSED_TILES[bucket][1]


def fused_smem_bytes(bucket: int) -> int:
    stream, warpgroups, _ = WGMMA_FUSED_TILES[bucket]
    resident, swizzle_alignment = fused_keys(bucket), 1024
    ds_tile = resident * stream * 2
    if bucket > WGMMA_COLUMN_SPLIT_ABOVE:  # column shares: P^T beside dS^T, dQ staged in the Q and dO tiles or a share's stage
        last_share_cols = bucket - WGMMA_COLUMN_SPLIT_ABOVE  # kLastOutCols: 64 at 192, 128 at 256
        p_tile, dq_stages = ds_tile, 64 * 64 * 4 if last_share_cols < 128 else 0  # kShareStageBytes: 64-row pieces of 64 fp32 columns
    else:
        dq_cols = bucket if stream // 64 >= warpgroups else bucket * (stream // 64) // warpgroups
        p_tile, dq_stages = 0, warpgroups * 64 * dq_cols * 4
    return (2 * resident + 2 * STAGES * stream) * bucket * 2 + 2 * STAGES * stream * 4 + ds_tile + p_tile + dq_stages + swizzle_alignment


@functools.cache
def row_variant(kernel: str, c_type: str, bucket: int, layout: str = "dense") -> Variant:
    """``backward_prep`` or ``backward_dq_finish``: ROW_LANES lanes per query row, ROWS_PER_CTA
    rows per CTA, each lane's loads of a row issued at once."""
    warps = "cuattn::kPrepWarps" if kernel == "backward_prep" else "cuattn::kFinishWarps"
    contract = ((warps, ROW_WARPS), ("cuattn::kRowLanes", ROW_LANES))
    if kernel == "backward_dq_finish":
        contract += (("cuattn::kDqTileRows", DQ_TILE_ROWS),)
    return Variant(
        family=FAMILY, kernel=kernel,
        expression=f"cuattn::{kernel}_kernel<{cxx_type(c_type)}, {bucket}, {layout_arg(layout)}>",
        uri=f"{kernel}/{c_type}/d{bucket}" + layout_uri(layout),
        hot=True,
        threads=ROW_WARPS * 32,
        block_m=ROWS_PER_CTA,
        contract=contract,
    )


@functools.cache
def sink_grad_variant(layout: str = "dense") -> Variant:
    packed = layout == "packed"
    return Variant(
        family=FAMILY, kernel="sink_grad", expression=f"cuattn::sink_grad_kernel<{'true' if packed else 'false'}>",
        uri="sink_grad" + ("/packed" if packed else ""),
        threads=SINK_GRAD_WARPS * 32, contract=(("cuattn::kSinkGradWarps", SINK_GRAD_WARPS),),
    )


@functools.cache
def variant(
    kernel: str, c_type: str, bucket: int, softcap: bool, smem_limit: int = MAX_SMEM_OPTIN, layout: str = "dense", dropout: bool = False,
    sparse: bool = False,
) -> Variant:
    """``kernel`` is backward_dkdv or backward_dq, tiled for ``smem_limit`` bytes of shared
    memory per block; float32 runs their CUDA-core twins (backward_fp32_dkdv, backward_fp32_dq);
    ``dropout``: the form with dropout (common/dropout.cuh); ``sparse``: the block-sparse form
    (common/block_sparse.cuh)."""
    cap, layout_tail = softcap_arg(softcap), softcap_uri(softcap) + layout_uri(layout) + dropout_uri(dropout, sparse)
    drop = dropout_arg(dropout, layout, sparse)
    if c_type == "float":
        fp32_kernel = kernel.replace("backward_", "backward_fp32_")
        return Variant(
            family=FAMILY, kernel=fp32_kernel,
            expression=f"cuattn::{fp32_kernel}_kernel<{bucket}, {cap}, {layout_arg(layout)}{drop}>",
            uri=f"{fp32_kernel}/d{bucket}" + layout_tail,
            dynamic_smem=2 * FP32_TILE * (bucket + 1) * 4,
            threads=FP32_WARPS * 32,
            block_m=FP32_ROWS_PER_WARP * FP32_WARPS,
            contract=(
                ("cuattn::kF32BwdWarps", FP32_WARPS), ("cuattn::kF32BwdRowsPerWarp", FP32_ROWS_PER_WARP), ("cuattn::kF32BwdTile", FP32_TILE),
            ),
        )
    stream, stats = tile(kernel, bucket, smem_limit, dropout)
    splits = dkdv_splits(bucket) if kernel == "backward_dkdv" else 1
    traits = f"cuattn::BackwardTraits<{bucket}, {stream}, {splits}, {'true' if stats else 'false'}>"
    tile_args = f"{stream}, {'true' if stats else 'false'}" if kernel == "backward_dkdv" else f"{stream}"
    contract = ((f"{traits}::kSmemBytes", smem_bytes(bucket, stream, stats)), (f"{traits}::kBlockResident", BLOCK), (f"{traits}::kThreads", 128))
    ordered = (kernel, bucket, softcap) not in DKDV_UNORDERED
    if kernel == "backward_dkdv":
        contract += ((f"cuattn::kDkdvSplits<{bucket}>", splits), (f"cuattn::kDkdvOrdered<{bucket}, {cap}>", int(ordered)))
    return Variant(
        family=FAMILY, kernel=kernel,
        expression=f"cuattn::{kernel}_kernel<{cxx_type(c_type)}, {bucket}, {tile_args}, {cap}, {layout_arg(layout)}{drop}>",
        uri=f"{kernel}/{c_type}/d{bucket}/s{stream}" + ("" if stats or kernel == "backward_dq" else "g") + layout_tail,
        hot=True,
        dynamic_smem=smem_bytes(bucket, stream, stats),
        threads=128,
        block_m=BLOCK,
        column_splits=splits,
        ordered=ordered,
        contract=contract,
    )


# The one-launch backward of small problems (backward_small.cu): the dQ and dK / dV kernels'
# CTAs in one grid, each summing its rows' delta, for calls whose time is the host's (one
# launch where the others take three, and no scratch memory).
SMALL_MAX_SEQLEN = 256  # query and key rows per sequence: at most 4 steps per CTA
SMALL_MAX_BUCKET = 128  # one CTA per key block (dkdv_splits)


@functools.cache
def small_variant(c_type: str, bucket: int, softcap: bool, smem_limit: int = MAX_SMEM_OPTIN) -> Variant:
    """backward_small with the portable kernels' tiles under ``smem_limit``; its shared memory
    is the larger of the two roles'."""
    dq_stream, _ = tile("backward_dq", bucket, smem_limit)
    dkdv_stream, stats = tile("backward_dkdv", bucket, smem_limit)
    if not stats:
        raise ValueError(f"backward_small at head_dim bucket {bucket} needs its row stats in shared memory ({smem_limit} bytes)")
    dq_traits, dkdv_traits = f"cuattn::BackwardTraits<{bucket}, {dq_stream}>", f"cuattn::BackwardTraits<{bucket}, {dkdv_stream}, 1, true>"
    dq_smem, dkdv_smem = smem_bytes(bucket, dq_stream, False), smem_bytes(bucket, dkdv_stream, True)
    return Variant(
        family=FAMILY, kernel="backward_small",
        expression=f"cuattn::backward_small_kernel<{cxx_type(c_type)}, {bucket}, {dq_stream}, {dkdv_stream}, {softcap_arg(softcap)}>",
        uri=f"backward_small/{c_type}/d{bucket}/s{dq_stream}q{dkdv_stream}" + softcap_uri(softcap),
        hot=True,
        dynamic_smem=max(dq_smem, dkdv_smem),
        threads=128,
        block_m=BLOCK,
        contract=(
            (f"{dq_traits}::kSmemBytes", dq_smem), (f"{dkdv_traits}::kSmemBytes", dkdv_smem), (f"{dq_traits}::kBlockResident", BLOCK),
            (f"{dkdv_traits}::kBlockResident", BLOCK), (f"{dq_traits}::kThreads", 128), (f"cuattn::kDkdvSplits<{bucket}>", 1),
        ),
    )


def small_computes(g: "BackwardGrid", c_type: str, sink: bool, dropout: bool, sparse: bool) -> bool:
    """Whether backward_small can compute this call at all: dense rows of 16-bit types,
    head_dim <= 128, no sink, dropout or block mask."""
    return g.layout == "dense" and c_type != "float" and head_dim_bucket(g.head_dim) <= SMALL_MAX_BUCKET and not (sink or dropout or sparse)


def small_serves(g: "BackwardGrid", c_type: str, sink: bool, dropout: bool, sparse: bool, sm_count) -> bool:
    """Whether backward_small runs this call: it computes it (:func:`small_computes`), at most
    SMALL_MAX_SEQLEN query and key rows, and a grid of one wave (``sm_count()``: the device's
    SMs, asked last)."""
    if not small_computes(g, c_type, sink, dropout, sparse):
        return False
    if not (0 < g.seqlen_q <= SMALL_MAX_SEQLEN and 0 < g.seqlen_k <= SMALL_MAX_SEQLEN and g.batch * g.heads_q):
        return False
    return _small_blocks(g) * g.heads_q * g.batch <= sm_count()


def _small_blocks(g: "BackwardGrid") -> int:
    """backward_small's gridDim.x: the dQ CTAs' query blocks, then the dK / dV CTAs' key blocks."""
    return -(-g.seqlen_q // BLOCK) + -(-g.seqlen_k // BLOCK)


def _wgmma(
    kernel: str, c_type: str, bucket: int, softcap: bool, layout: str, tiles: tuple, smem: int, traits: str, dropout: bool, sparse: bool,
) -> Variant:
    stream, warpgroups, ctas = tiles
    if dropout:
        ctas = WGMMA_DROPOUT_CTAS.get(kernel, {}).get((bucket, softcap), ctas)
    if sparse:
        ctas = WGMMA_SPARSE_CTAS.get(kernel, {}).get((bucket, softcap), ctas)
    traits = f"cuattn::{traits}<{bucket}, {stream}, {warpgroups}>"
    return Variant(
        family=FAMILY, kernel=kernel,
        expression=(f"cuattn::{kernel}_kernel<{cxx_type(c_type)}, {bucket}, {stream}, {warpgroups}, {ctas}, {softcap_arg(softcap)}, "
                    f"{layout_arg(layout)}{dropout_arg(dropout, layout, sparse)}>"),
        uri=(f"{kernel}/{c_type}/d{bucket}/s{stream}wg{warpgroups}c{ctas}" + softcap_uri(softcap) + layout_uri(layout)
             + dropout_uri(dropout, sparse)),
        hot=True,
        dynamic_smem=smem,
        threads=128 * warpgroups,
        block_m=64 * warpgroups,
        archs=(WGMMA_ARCH,),
        contract=((f"{traits}::kSmemBytes", smem), (f"{traits}::kThreads", 128 * warpgroups), (f"{traits}::kBlockResident", 64 * warpgroups)),
    )


@functools.cache
def wgmma_variant(
    kernel: str, c_type: str, bucket: int, softcap: bool, layout: str = "dense", dropout: bool = False, sparse: bool = False,
) -> Variant:
    """``kernel`` is backward_dq or backward_dkdv; the variant is its backward_wgmma_* twin."""
    return _wgmma(
        kernel.replace("backward_", "backward_wgmma_"), c_type, bucket, softcap, layout, WGMMA_TILES[kernel][bucket],
        wgmma_smem_bytes(kernel, bucket), "WgmmaBackwardTraits", dropout, sparse,
    )


@functools.cache
def fused_variant(c_type: str, bucket: int, softcap: bool, layout: str = "dense", dropout: bool = False, sparse: bool = False) -> Variant:
    """dK / dV plus dQ by fp32 atomics into the accumulator (backward_wgmma_fused.cu)."""
    v = _wgmma(
        "backward_wgmma_fused", c_type, bucket, softcap, layout, WGMMA_FUSED_TILES[bucket], fused_smem_bytes(bucket), "WgmmaFusedTraits",
        dropout, sparse,
    )
    keys = fused_keys(bucket)
    traits = f"cuattn::WgmmaFusedTraits<{bucket}, {WGMMA_FUSED_TILES[bucket][0]}, {WGMMA_FUSED_TILES[bucket][1]}>"
    contract = tuple(c for c in v.contract if not c[0].endswith("::kBlockResident")) + ((f"{traits}::kBlockResident", keys),)
    return dataclasses.replace(v, block_m=keys, contract=contract + (("cuattn::kDqTileRows", DQ_TILE_ROWS),))


def tma_smem_bytes(tile: int) -> int:
    """TmaBackwardTraits::kSmemBytes: K and V, the Q / dO ring, two dS^T buffers, two fp32 dQ
    stages, the lse / delta ring, the barriers, and the realignment to the swizzle period."""
    block_m, stages = TMA_TILES[tile]
    keys = TMA_KEYS
    return 2 * keys * tile * 2 + 2 * stages * block_m * tile * 2 + 2 * keys * block_m * 2 + 2 * 64 * 64 * 4 + 2 * stages * block_m * 4 + (1 + 2 * stages) * 8 + 1024


@functools.cache
def tma_variant(c_type: str, tile: int, softcap: bool, sparse: bool = False) -> Variant:
    """dK / dV plus dQ into the accumulator with TMA loads (backward_tma.cu); ``sparse``: its
    block-sparse form."""
    block_m, stages = TMA_TILES[tile]
    traits = f"cuattn::TmaBackwardTraits<{tile}, {block_m}, {stages}>"
    smem = tma_smem_bytes(tile)
    return Variant(
        family=FAMILY, kernel="backward_tma",
        expression=f"cuattn::backward_tma_kernel<{cxx_type(c_type)}, {tile}, {block_m}, {stages}, {softcap_arg(softcap)}"
        + (", true>" if sparse else ">"),
        uri=f"backward_tma/{c_type}/d{tile}/m{block_m}s{stages}" + softcap_uri(softcap) + dropout_uri(False, sparse),
        hot=True,
        dynamic_smem=smem,
        threads=TMA_THREADS,
        block_m=TMA_KEYS,
        archs=(WGMMA_ARCH,),
        contract=((f"{traits}::kSmemBytes", smem), (f"{traits}::kThreads", TMA_THREADS), (f"{traits}::kBlockResident", TMA_KEYS),
                  ("cuattn::kDqTileRows", DQ_TILE_ROWS)),
    )


def tma_serves(c_type: str, bucket: int, softcap: bool, arch: str, allow: bool, layout: str, dropout: bool, sparse: bool) -> bool:
    """Whether the TMA backward takes a fused call of these kinds, block-sparse ones included
    (its tensors' maps decide the rest: cuattn/tensor_map.py)."""
    tile = hopper_bucket(bucket)
    return (allow and arch == WGMMA_ARCH and c_type in ("f16", "bf16") and tile in TMA_TILES and not (softcap and tile in TMA_NO_SOFTCAP)
            and not (sparse and (tile in TMA_NO_SPARSE or softcap)) and layout == "dense" and not dropout)


# The TMA backward splits each key block's query steps over more CTAs (BackwardParams::
# query_splits, dK / dV added into fp32 sums by atomics) while its (key block, KV head,
# sequence) CTAs are fewer than this many waves: grouped queries, where a CTA streams the steps
# of every query head of its group, and short or few sequences.
TMA_SPLIT_WAVES = 4
TMA_MIN_SPLIT_STEPS = 8  # query steps a split keeps at least (half of them under a causal mask)
TMA_MAX_SPLITS = 8


def tma_query_splits(g: "BackwardGrid", sm_count: int, sparse: bool = False) -> int:
    """CTAs of the TMA backward that share one key block's query steps (a power of two): the
    fewest that make TMA_SPLIT_WAVES waves of CTAs, each keeping TMA_MIN_SPLIT_STEPS steps.
    One under a block mask (``sparse``), whose steps the kernel does not split."""
    tile = hopper_bucket(head_dim_bucket(g.head_dim))
    if sparse or g.layout != "dense" or tile not in TMA_TILES or not (g.seqlen_q and g.seqlen_k and g.heads_kv):
        return 1
    ctas = g.batch * g.heads_kv * -(-g.seqlen_k // TMA_KEYS)
    steps = g.heads_q // g.heads_kv * -(-g.seqlen_q // TMA_TILES[tile][0])
    splits = 1
    while splits < TMA_MAX_SPLITS and ctas * splits < TMA_SPLIT_WAVES * sm_count and steps // (4 * splits) >= TMA_MIN_SPLIT_STEPS:
        splits *= 2
    return splits


def hopper_bucket(bucket: int) -> int:
    """The head-dim tile of the Hopper kernels that serve ``bucket`` (WGMMA_WIDER)."""
    return WGMMA_WIDER.get(bucket, bucket)


def select_fused(
    c_type: str, bucket: int, softcap: bool, arch: str, allow_wgmma: bool = True, layout: str = "dense", dropout: bool = False,
    sparse: bool = False,
) -> Variant | None:
    """The one-pass backward (dQ by atomics) where it serves the problem on the target, else
    None. Its dQ accumulator has hopper_bucket(bucket) columns."""
    tile = hopper_bucket(bucket)
    if allow_wgmma and arch == WGMMA_ARCH and c_type != "float" and fused_serves(tile, softcap, sparse):
        return fused_variant(c_type, tile, softcap, layout, dropout, sparse)
    return None


def fused_serves(bucket: int, softcap: bool, sparse: bool = False) -> bool:
    return bucket in WGMMA_FUSED_TILES and not (sparse and ("backward_wgmma_fused", bucket, softcap) in WGMMA_SPARSE_PORTABLE)


def select(
    kernel: str, c_type: str, bucket: int, softcap: bool, arch: str, allow_wgmma: bool = True, smem_limit: int | None = None,
    layout: str = "dense", dropout: bool = False, sparse: bool = False,
) -> Variant:
    """backward_dq or backward_dkdv for a problem on a target: the Hopper twin where one exists
    (for hopper_bucket(bucket)), else the portable kernel tiled for ``smem_limit`` (default: the
    target's)."""
    tile = hopper_bucket(bucket)
    if allow_wgmma and arch == WGMMA_ARCH and c_type != "float" and wgmma_serves(kernel, tile, softcap, layout, dropout, sparse):
        return wgmma_variant(kernel, c_type, tile, softcap, layout, dropout, sparse)
    return variant(kernel, c_type, bucket, softcap, arch_smem_limit(arch) if smem_limit is None else smem_limit, layout, dropout, sparse)


@dataclasses.dataclass(frozen=True)
class BackwardGrid:
    """The extents of one backward call's launches, for either sequence layout."""

    layout: str  # "dense" or "packed" (cuattn.kernels.variant.SEQ_LAYOUTS)
    batch: int  # sequences
    seqlen_q: int  # query rows per sequence that the dQ grid covers (packed: a bound)
    seqlen_k: int  # key rows per sequence that the dK / dV grid covers (packed: a bound)
    heads_q: int
    heads_kv: int
    head_dim: int
    rows: int  # query rows of all sequences (the row kernels run rows x heads_q lane groups)
    keys: int  # key rows of all sequences

    def dq_accumulator(self, bucket: int) -> tuple[tuple[int, ...], tuple[int, int]]:
        """(shape, tile strides) of the fused kernel's fp32 dQ accumulator
        (cuda_src/backward/dq_accum.cuh): dense, a run of 64-row tiles per (batch, head);
        packed, one run per head with sequence b's tiles from q_row0 // 64 + b."""
        if self.layout == "dense":
            row_blocks = -(-self.seqlen_q // DQ_TILE_ROWS)
            return (self.batch, self.heads_q, row_blocks * DQ_TILE_ROWS, bucket), (self.heads_q * row_blocks, row_blocks)
        tiles = -(-self.rows // DQ_TILE_ROWS) + self.batch
        return (self.heads_q, tiles * DQ_TILE_ROWS, bucket), (1, tiles)

    def accumulator_fits(self) -> bool:
        """Whether the accumulator is at most about twice dQ's rows: packed batches of many
        short sequences (more sequences than 64-row blocks) take the deterministic kernels."""
        return self.layout == "dense" or self.batch <= max(1, -(-self.rows // DQ_TILE_ROWS))


Launches = list[tuple[Variant, list[tuple[tuple, tuple, int | None]]]]

MAX_QUERY_SPLITS = 64


def query_splits(c_type: str, g: BackwardGrid, sms: int) -> int:
    """CTAs per key block of the dK / dV kernel (a power of two): more than one where the key
    blocks alone would leave the GPU idle while each streams every query (a range of a few
    sink tokens), so that about two CTAs per SM run, each with at least four query steps."""
    if c_type == "float" or g.layout != "dense" or not g.seqlen_k:
        return 1
    ctas = g.batch * g.heads_kv * dkdv_splits(head_dim_bucket(g.head_dim)) * -(-g.seqlen_k // BLOCK)
    steps = g.heads_q // max(g.heads_kv, 1) * -(-g.seqlen_q // BLOCK)
    splits = 1
    while splits < MAX_QUERY_SPLITS and 2 * splits * ctas <= 2 * sms and 2 * splits * 4 <= steps:
        splits *= 2
    return splits


def launches(
    g: BackwardGrid, c_type: str, softcap: bool, arch: str, allow_wgmma: bool, smem_limit: int, fused: bool, sink: bool = False,
    query_splits: int = 1, dropout: bool = False, sparse: bool = False, small: bool = False, tma: bool = False, tma_splits: int = 1,
) -> Launches:
    """Every launch of one backward call, in order: (variant, [(grid, block, batch_offset)]);
    ``fused``: dQ through the accumulator by the fused kernel (``select_fused`` serves it);
    ``sink``: the sinks' gradient too (dense or packed rows); ``query_splits``: CTAs per key
    block of the dK / dV kernel (BackwardParams::query_splits; 16-bit types, not fused);
    ``dropout``: the gradient kernels with dropout; ``sparse``: the block-sparse ones (one split);
    ``small``: the one launch of backward_small (``small_serves`` holds; no delta pass); ``tma``:
    the fused kernel's TMA form (``tma_serves`` holds and its tensor maps are encoded), with
    ``tma_splits`` CTAs per key block (``tma_query_splits``)."""
    bucket, layout = head_dim_bucket(g.head_dim), g.layout
    if tma_splits > 1 and not (fused and tma and not sparse):
        raise ValueError("only the TMA backward (fused, without a block mask) splits the query steps of its key blocks over CTAs")
    if small:
        if fused or query_splits > 1 or not small_computes(g, c_type, sink, dropout, sparse):
            raise ValueError("backward_small runs alone (not fused, one query split) on dense 16-bit rows of head_dim <= "
                             f"{SMALL_MAX_BUCKET}, without sink, dropout or block mask (small_serves)")
        one = small_variant(c_type, bucket, softcap, smem_limit)
        return [(one, [((_small_blocks(g), g.heads_q, min(MAX_GRID_YZ, g.batch - b0)), (one.threads, 1, 1), b0)
                       for b0 in range(0, g.batch, MAX_GRID_YZ)])]
    row_groups = g.rows * g.heads_q
    row_launch = [((-(-row_groups // ROWS_PER_CTA), 1, 1), (32 * ROW_WARPS, 1, 1), None)]
    # Packed grids cover at least one block, so that rows past a zero bound are marked.
    grid_q, grid_k = (g.seqlen_q, g.seqlen_k) if layout == "dense" else (max(g.seqlen_q, 1), max(g.seqlen_k, 1))
    out: Launches = []
    if row_groups:
        out.append((row_variant("backward_prep", c_type, bucket, layout), row_launch))
    if sink and g.heads_q:  # after delta; writes dsink (zeros without rows)
        out.append((sink_grad_variant(layout), [((g.heads_q, 1, 1), (SINK_GRAD_WARPS * 32, 1, 1), None)]))
    # dK and dV are written (zeros included) even when no query sees a key.
    if fused:
        one_pass = (tma_variant(c_type, hopper_bucket(bucket), softcap, sparse) if tma
                    else select_fused(c_type, bucket, softcap, arch, layout=layout, dropout=dropout, sparse=sparse))
        if g.keys:
            tiles = tile_launches(one_pass, grid_k, g.heads_kv, g.batch)
            out.append((one_pass, [((x * tma_splits, y, z), block, b0) for (x, y, z), block, b0 in tiles]))
        if row_groups:
            out.append((row_variant("backward_dq_finish", c_type, bucket, layout), row_launch))
        return out
    if row_groups:
        dq = select("backward_dq", c_type, bucket, softcap, arch, allow_wgmma, smem_limit, layout, dropout, sparse)
        out.append((dq, tile_launches(dq, grid_q, g.heads_q, g.batch)))
    if g.keys:
        dkdv = select("backward_dkdv", c_type, bucket, softcap, arch, allow_wgmma, smem_limit, layout, dropout, sparse)
        tiles = tile_launches(dkdv, grid_k, g.heads_kv * dkdv.column_splits, g.batch)
        if query_splits > 1:
            if fused or c_type == "float" or layout != "dense" or sparse:
                raise ValueError("query splits need the 16-bit dK / dV kernels on dense rows")
            tiles = [((x * query_splits, y, z), block, b0) for (x, y, z), block, b0 in tiles]
        out.append((dkdv, tiles))
    return out


def variants(arch: str | None = None) -> list[Variant]:
    """Every backward variant; with ``arch``, the portable tiles chosen under its shared-memory limit."""
    smem_limit = MAX_SMEM_OPTIN if arch is None else arch_smem_limit(arch)
    out = []
    for c_type in ("f16", "bf16", "float"):  # block-sparse
        for bucket in HEAD_DIM_BUCKETS:
            for softcap in (False, True):
                for kernel in ("backward_dkdv", "backward_dq"):
                    out.append(variant(kernel, c_type, bucket, softcap, smem_limit, sparse=True))
                    if c_type != "float" and wgmma_serves(kernel, bucket, softcap, "dense", False, sparse=True):
                        out.append(wgmma_variant(kernel, c_type, bucket, softcap, sparse=True))
                if c_type != "float" and fused_serves(bucket, softcap, sparse=True):
                    out.append(fused_variant(c_type, bucket, softcap, sparse=True))
    for layout in SEQ_LAYOUTS:  # with dropout
        for c_type in ("f16", "bf16", "float"):
            for bucket in HEAD_DIM_BUCKETS:
                for softcap in (False, True):
                    for kernel in ("backward_dkdv", "backward_dq"):
                        out.append(variant(kernel, c_type, bucket, softcap, smem_limit, layout, dropout=True))
                        if c_type != "float" and wgmma_serves(kernel, bucket, softcap, layout, True):
                            out.append(wgmma_variant(kernel, c_type, bucket, softcap, layout, dropout=True))
                    if c_type != "float" and bucket in WGMMA_FUSED_TILES:
                        out.append(fused_variant(c_type, bucket, softcap, layout, dropout=True))
    for c_type in ("f16", "bf16"):
        for tile in TMA_TILES:
            out.extend(tma_variant(c_type, tile, softcap, sparse) for softcap in (False, True) for sparse in (False, True)
                       if not (softcap and tile in TMA_NO_SOFTCAP) and not (sparse and (tile in TMA_NO_SPARSE or softcap)))
        for bucket in HEAD_DIM_BUCKETS:
            if bucket <= SMALL_MAX_BUCKET:
                for softcap in (False, True):
                    out.append(small_variant(c_type, bucket, softcap, smem_limit))
    for layout in SEQ_LAYOUTS:
        out.append(sink_grad_variant(layout))
        for c_type in ("f16", "bf16", "float"):
            for bucket in HEAD_DIM_BUCKETS:
                out.append(row_variant("backward_prep", c_type, bucket, layout))
            for kernel in ("backward_dkdv", "backward_dq"):
                for bucket in HEAD_DIM_BUCKETS:
                    for softcap in (False, True):
                        out.append(variant(kernel, c_type, bucket, softcap, smem_limit, layout))
        for c_type in ("f16", "bf16"):
            for kernel, buckets in WGMMA_TILES.items():
                for bucket in buckets:
                    for softcap in (False, True):
                        out.append(wgmma_variant(kernel, c_type, bucket, softcap, layout))
            for bucket in HEAD_DIM_BUCKETS:  # every bucket the fused kernel serves (WGMMA_WIDER)
                if hopper_bucket(bucket) in WGMMA_FUSED_TILES:
                    out.append(row_variant("backward_dq_finish", c_type, bucket, layout))
            for bucket in WGMMA_FUSED_TILES:
                for softcap in (False, True):
                    out.append(fused_variant(c_type, bucket, softcap, layout))
    return out


def common_variants() -> list[Variant]:
    return []
