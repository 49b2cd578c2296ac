"""Launch plan of the decode family (cuda_src/decode/): attention of a few new query rows per
sequence over a KV cache, split over the keys (decode.cu), and the merge of the splits
(decode_combine.cu)."""

from __future__ import annotations

import functools

from cuattn.dtypes import cxx_type
from cuattn.kernels.variant import HEAD_DIM_BUCKETS, MAX_GRID_YZ, MAX_SMEM_OPTIN, Variant, arch_smem_limit, softcap_arg, softcap_uri

FAMILY = "decode"
ROWS, WARPS, BLOCK_N = 16, 4, 64  # packed query rows per CTA, warps and keys per ring slot (but for EIGHT_WARPS CTAs, below)
# Ring slots per head-dim bucket (scripts/tune_decode.py, H100, d128): a contiguous cache streams
# best from deep rings (4 slots, one CTA per SM); a paged one from more CTAs per SM (3 slots, two
# CTAs), whose block-table loads then overlap (page 16 against 2 slots and three CTAs: b1 8k
# 1646 / 1441 GB/s, b4 1k 1190 / 991, b64 8k 2995 / 2540, b16 32k 2941 / 2982); so at d256 (one
# CTA per SM either way; page 16 b64 8k 2751 / 2522), not at d64 (b1 32k 2049 / 2107).
STAGES = {32: 4, 64: 4, 96: 4, 128: 4, 160: 2, 192: 2, 224: 2, 256: 2}
PAGED_STAGES = {32: 2, 64: 2, 96: 2, 128: 3, 160: 2, 192: 2, 224: 2, 256: 3}
# A contiguous cache with more CTAs than SMs (several waves of one deep-ring CTA per SM): 3 slots,
# two CTAs per SM (b64 8k: 2978 GB/s against 2911 with 4).
WIDE_STAGES = {32: 3, 64: 3, 96: 3, 128: 3, 160: 2, 192: 2, 224: 2, 256: 2}
MIN_BLOCKS_PER_SPLIT = 1  # key blocks of the capacity per split, at least
# Key blocks of its split a decode CTA pulls into L2 before it waits for the grid ahead
# (decode.cu prefetch_first_blocks; scripts/decode_ab.sh, H100, benchmarks/NOTES.md):
# contiguous caches always, paged ones only under a dependent launch, where the block-table
# reads the prefetch waits for pass under the grid ahead (without one, b4 1k pages of 16 lost 10%).
PREFETCH_BLOCKS = 2
# Splits of at least LONG_SPLIT_BLOCKS key blocks of the capacity, on a grid within the SMs,
# prefetch PREFETCH_BLOCKS_LONG (4: +1-2.5% at 128 MB, b1 32k / b4 8k; 4 everywhere lost 7% at
# b4 1k, where it was a split's whole range, and 2% at b64 1k with pages, a grid of several waves).
PREFETCH_BLOCKS_LONG, LONG_SPLIT_BLOCKS = 4, 16


def split_blocks(capacity: int, splits: int) -> int:
    """BLOCK_N-key (64-key) blocks of the capacity per split, at most: what prefetch_blocks'
    rule counts. The kernel prefetches blocks of its own ring slot (block_n(warps) keys): the
    long rule's 4 are 512 keys on 8-warp CTAs, as measured."""
    return -(-(-(-capacity // BLOCK_N)) // splits)


def prefetch_blocks(paged: bool, dependent: bool, split_blocks: int = 0, wide: bool = False) -> int:
    """DecodeParams::prefetch_blocks of a decode launch (``dependent``: a programmatic
    dependent launch, cuattn/launch.py; ``split_blocks``: key blocks of the capacity per split;
    ``wide``: :func:`wide_grid`)."""
    if paged and not dependent:
        return 0
    return PREFETCH_BLOCKS_LONG if split_blocks >= LONG_SPLIT_BLOCKS and not wide else PREFETCH_BLOCKS


# CTAs of EIGHT_WARPS warps (128-key ring slots, still 16 keys a warp; 3 slots at head_dim 128,
# one CTA per SM) for contiguous caches on grids within the SMs, where the 8-warp ring holds 3
# slots or more (head dims 96 and 128) and each split of the capacity holds 1024 positions or
# more: twice the warps to take each block's math, which, done by 4, delays the refills of their
# ring (H100, benchmarks/NOTES.md: b1 32k 2776-2781 -> 2842 GB/s, b4 8k 2751-2776 -> 2819-2822,
# b16 32k with ordinary launches 3115-3123 -> 3130-3133). On shorter splits 8 warps lost: b4 1k
# 1385 -> 1270 GB/s, b1 8k 2003 -> 1920 (their prefetch a whole split or half of one).
EIGHT_WARPS, EIGHT_WARPS_MIN_STAGES, EIGHT_WARPS_MIN_SPLIT_KEYS = 8, 3, 1024


def block_n(warps: int) -> int:
    """Keys per ring slot of a decode CTA of ``warps`` warps (16 a warp; the kernel's kBlockN)."""
    return 16 * warps


def cta_warps(bucket: int, paged: bool, wide: bool, smem_limit: int = MAX_SMEM_OPTIN, split_keys: int | None = None) -> int:
    """Warps of the decode CTA: EIGHT_WARPS for a contiguous cache copying runs, on a grid within
    the SMs (not ``wide``), where that ring has EIGHT_WARPS_MIN_STAGES slots and, where given,
    ``split_keys`` (positions of the capacity per split of the 8-warp grid) reach
    EIGHT_WARPS_MIN_SPLIT_KEYS; else WARPS."""
    if paged or wide or not takes_runs(bucket, None) or (split_keys is not None and split_keys < EIGHT_WARPS_MIN_SPLIT_KEYS):
        return WARPS
    ring = stages(bucket, False, smem_limit, warps=EIGHT_WARPS)
    return EIGHT_WARPS if ring is not None and ring >= EIGHT_WARPS_MIN_STAGES else WARPS


def decode_warps(bucket: int, paged: bool, batch: int, heads_kv: int, row_blocks: int, capacity: int, sm_count: int,
                 smem_limit: int = MAX_SMEM_OPTIN, splits: int | None = None) -> int:
    """Warps of a call's decode CTAs: :func:`cta_warps` on its grid, the length of each split
    taken from the 8-warp grid's split count (``splits``: the caller's, else :func:`num_splits`'
    for that grid)."""
    wide = wide_grid(batch, heads_kv, row_blocks, sm_count)
    warps = cta_warps(bucket, paged, wide, smem_limit)
    if warps == WARPS:
        return warps
    eight = splits or num_splits(bucket, paged, batch, heads_kv, row_blocks, capacity, sm_count, smem_limit, wide, warps=warps)
    return cta_warps(bucket, paged, wide, smem_limit, split_keys=-(-capacity // eight))


# A decode grid of 8-warp CTAs in one split (no merge after it) over a capacity of
# ORDINARY_LAUNCH_KEYS positions or more goes as an ordinary grid, not a programmatic dependent:
# back to back, the dependent launch read b16 x 8k-128k 1-2% slower on the H100 (b16 32k 3100
# against 3130-3133 GB/s; benchmarks/NOTES.md). The capacity stands in for the lengths (the launch
# is a host choice): a large cache holding few positions loses the dependent launch's overlap
# with the grid ahead, ~2 us a call (b16 1k on a 1k cache: 2755 GB/s dependent, 2536 ordinary).
ORDINARY_LAUNCH_KEYS = 8192


def dependent_launch(paged: bool, warps: int, splits: int, capacity: int) -> bool:
    """Whether the decode kernel goes as a programmatic dependent launch (cuattn/launch.py)."""
    return paged or warps != EIGHT_WARPS or splits > 1 or capacity < ORDINARY_LAUNCH_KEYS


COMBINE_WARPS = 4  # one row per CTA, the splits dealt to the warps
APPEND_WARPS = 8  # one (sequence, new row, KV head) per warp
MAX_SPLITS = 128
# New tokens per sequence from which attention_with_kvcache takes the tiled forward kernel over
# the cache layouts (chunked prefill): 16-row decode tiles would read the cache once per 16
# packed rows (a 2k-token chunk at GQA 32:8: 512 times per KV head).
PREFILL_SEQLEN_Q = 64
SM_SMEM = 228 * 1024  # shared memory per SM that resident CTAs share (1 KB of it reserved per CTA)


def smem_bytes_for(bucket: int, ring: int, warps: int = WARPS) -> int:
    row = bucket if bucket % 64 == 0 else bucket + 8  # DecodeTraits: swizzled rows of whole 128-byte lines, else padded
    return (ROWS * row + 2 * ring * block_n(warps) * row) * 2 + ring * block_n(warps) * 4  # + the table entries of a block per slot


def stages(bucket: int, paged: bool, smem_limit: int = MAX_SMEM_OPTIN, wide: bool = False, warps: int = WARPS) -> int | None:
    """Ring slots: the table's (``wide``: a contiguous cache's grid of more CTAs than SMs;
    paged caches have one ring), fewer where the
    per-block shared memory is smaller (99 KB parts), None where even two slots do not fit
    (head_dim above 160 on those)."""
    ring = (PAGED_STAGES if paged else WIDE_STAGES if wide else STAGES)[bucket]
    while ring >= 2 and smem_bytes_for(bucket, ring, warps) > smem_limit:
        ring -= 1
    return ring if ring >= 2 else None


def smem_bytes(bucket: int, paged: bool, smem_limit: int = MAX_SMEM_OPTIN, wide: bool = False, warps: int = WARPS) -> int:
    return smem_bytes_for(bucket, stages(bucket, paged, smem_limit, wide, warps), warps)


def ctas_per_sm(bucket: int, paged: bool, smem_limit: int = MAX_SMEM_OPTIN, wide: bool = False, warps: int = WARPS) -> int:
    return max(1, min(4, SM_SMEM // (smem_bytes(bucket, paged, smem_limit, wide, warps) + 1024)))


def wide_grid(batch: int, heads_kv: int, row_blocks: int, sm_count: int) -> bool:
    """Whether the grid has more (sequence, KV head, row block) CTAs than SMs."""
    return batch * heads_kv * row_blocks > sm_count


# Head dims from which a warp copies its 16 keys of a block as one run of positions (decode.cu
# load_kv_rows RUNS): below, the unrolled copies cost a CTA per SM in registers.
RUNS_MIN_BUCKET = 96


def takes_runs(bucket: int, page_size: int | None) -> bool:
    """Whether the decode kernel copies runs of positions: a contiguous cache (``page_size``
    None), or pages of a multiple of 16 positions, from RUNS_MIN_BUCKET."""
    return bucket >= RUNS_MIN_BUCKET and (page_size is None or page_size % 16 == 0)


@functools.cache
def variant(
    c_type: str, bucket: int, paged: bool, softcap: bool, smem_limit: int = MAX_SMEM_OPTIN, wide: bool = False, runs: bool | None = None,
    warps: int = WARPS,
) -> Variant:
    """The decode kernel with the ring that fits ``smem_limit`` bytes per block (callers check
    :func:`stages` is not None first); ``runs`` (:func:`takes_runs`; default: contiguous caches
    from RUNS_MIN_BUCKET) copies runs of positions; CTAs of ``warps`` warps (:func:`cta_warps`)."""
    runs = takes_runs(bucket, None) and not paged if runs is None else runs
    if runs and bucket < RUNS_MIN_BUCKET:
        raise ValueError(f"no decode kernel copying runs of positions at head_dim bucket {bucket}")
    ring = stages(bucket, paged, smem_limit, wide, warps)
    traits = f"cuattn::DecodeTraits<{bucket}, {ring}, {warps}>"
    return Variant(
        family=FAMILY, kernel="decode",
        expression=(f"cuattn::decode_kernel<{cxx_type(c_type)}, {bucket}, {ring}, {'true' if paged else 'false'}, {softcap_arg(softcap)}, "
                    f"{'true' if runs else 'false'}" + ("" if warps == WARPS else f", {warps}") + ">"),
        uri=f"decode/{c_type}/d{bucket}/s{ring}" + ("/paged" if paged else "") + softcap_uri(softcap) + ("/runs" if runs and paged else "")
        + ("" if warps == WARPS else f"/w{warps}"),
        hot=True,
        dynamic_smem=smem_bytes_for(bucket, ring, warps),
        threads=warps * 32,
        block_m=ROWS,
        # Every kernel of the family waits for the grid before it on the device (cuattn/launch.py):
        # its launch overlaps that grid's tail (H200, batch 1 x 1k tokens: 433 -> 479 GB/s), but
        # where dependent_launch says an ordinary grid.
        dependent=True,
        contract=(
            (f"{traits}::kSmemBytes", smem_bytes_for(bucket, ring, warps)), (f"{traits}::kThreads", warps * 32), ("cuattn::kDecodeRows", ROWS),
            (f"{traits}::kBlockN", block_n(warps)), ("cuattn::kDecodeWarps", WARPS),
        ),
    )


@functools.cache
def combine_variant(c_type: str, bucket: int) -> Variant:
    return Variant(
        family=FAMILY, kernel="decode_combine",
        expression=f"cuattn::decode_combine_kernel<{cxx_type(c_type)}, {bucket}>",
        uri=f"decode_combine/{c_type}/d{bucket}",
        hot=True,
        threads=COMBINE_WARPS * 32,
        dependent=True,  # starts under the decode grid's tail; waits for it on the device
        contract=(("cuattn::kCombineWarps", COMBINE_WARPS), ("cuattn::kCombineMaxSplits", MAX_SPLITS)),
    )


@functools.cache
def append_variant(c_type: str, paged: bool) -> Variant:
    return Variant(
        family=FAMILY, kernel="append_kv",
        expression=f"cuattn::append_kv_kernel<{cxx_type(c_type)}, {'true' if paged else 'false'}>",
        uri=f"append_kv/{c_type}" + ("/paged" if paged else ""),
        threads=APPEND_WARPS * 32,
        dependent=True,
        contract=(("cuattn::kAppendWarps", APPEND_WARPS),),
    )


def append_grid(rows: int) -> tuple[int, int, int]:
    return (-(-rows // APPEND_WARPS), 1, 1)


def num_splits(bucket: int, paged: bool, batch: int, heads_kv: int, row_blocks: int, capacity: int, sm_count: int,
               smem_limit: int = MAX_SMEM_OPTIN, wide: bool = False, resident: int | None = None, warps: int = WARPS) -> int:
    """Key splits per (sequence, KV head, row block), from host shapes only (so that one CUDA
    graph serves any lengths): as many CTAs as fit on the SMs at once (never a partial second
    wave), and at most one
    split per MIN_BLOCKS_PER_SPLIT key blocks of the cache's capacity. Each sequence's keys are
    then divided into that many equal ranges on the device, so a skewed batch still spreads every
    sequence. ``resident``: the CTAs per SM the loaded kernel's registers allow, where known
    (the shared-memory count alone overstates it for some variants)."""
    ctas = max(1, batch * heads_kv * row_blocks)
    per_sm = ctas_per_sm(bucket, paged, smem_limit, wide, warps)
    if resident is not None:
        per_sm = max(1, min(per_sm, resident))
    wanted = max(1, per_sm * sm_count // ctas)  # rounded down: no partial second wave
    return max(1, min(wanted, -(-capacity // (MIN_BLOCKS_PER_SPLIT * block_n(warps))), MAX_SPLITS))


def prefill_by_forward(seqlen_q: int) -> bool:
    """Whether a call takes the forward kernel (a host shape: one CUDA graph keeps its choice)."""
    return seqlen_q >= PREFILL_SEQLEN_Q


def grid(splits: int, heads_kv: int, row_blocks: int, batch: int) -> tuple[int, int, int]:
    if heads_kv * row_blocks > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"attention_with_kvcache supports at most {MAX_GRID_YZ} sequences and KV heads x row blocks, got {batch} and {heads_kv * row_blocks}")
    return (splits, heads_kv * row_blocks, batch)


def combine_grid(rows: int) -> tuple[int, int, int]:
    return (rows, 1, 1)


def variants(arch: str | None = None) -> list[Variant]:
    """Every decode variant; with ``arch``, rings sized for its shared memory (head dims that do
    not fit are left out)."""
    smem_limit = MAX_SMEM_OPTIN if arch is None else arch_smem_limit(arch)
    out = []
    for c_type in ("f16", "bf16"):
        for bucket in HEAD_DIM_BUCKETS:
            for paged in (False, True):
                if stages(bucket, paged, smem_limit) is None:
                    continue
                for softcap in (False, True):
                    out.append(variant(c_type, bucket, paged, softcap, smem_limit))
                    if paged and takes_runs(bucket, 16):
                        out.append(variant(c_type, bucket, paged, softcap, smem_limit, runs=True))
                    if not paged and stages(bucket, paged, smem_limit, True) != stages(bucket, paged, smem_limit):
                        out.append(variant(c_type, bucket, paged, softcap, smem_limit, True))
                    warps = cta_warps(bucket, paged, False, smem_limit)
                    if warps != WARPS:
                        out.append(variant(c_type, bucket, paged, softcap, smem_limit, warps=warps))
            out.append(combine_variant(c_type, bucket))
        for paged in (False, True):
            out.append(append_variant(c_type, paged))
    return out


def common_variants() -> list[Variant]:
    return ([variant(c, 128, paged, False) for c in ("f16", "bf16") for paged in (False, True)]
            + [variant(c, 128, False, False, warps=cta_warps(128, False, False)) for c in ("f16", "bf16")]
            + [variant(c, 128, True, False, runs=True) for c in ("f16", "bf16")] + [combine_variant(c, 128) for c in ("f16", "bf16")])
