"""Launch plan of the decode family (cuda_src/decode/): attention of a few new query rows per
sequence over a KV cache, split over the keys (decode.cu), and the merge of the splits
(decode_combine.cu)."""

from __future__ import annotations

import functools

from cuattn.dtypes import cxx_type
from cuattn.kernels.variant import HEAD_DIM_BUCKETS, MAX_GRID_YZ, Variant, softcap_arg, softcap_uri

FAMILY = "decode"
ROWS, WARPS, BLOCK_N, STAGES = 16, 4, 64, 2  # packed query rows per CTA, warps, keys per stage, stages
COMBINE_WARPS = 8  # one row per warp
MAX_SPLITS = 128
CTAS_PER_SM = 3  # the residency num_splits aims for (74 KB of shared memory each at d128)


def smem_bytes(bucket: int) -> int:
    row = bucket + 8
    return (ROWS * row + 2 * STAGES * BLOCK_N * row) * 2


@functools.cache
def variant(c_type: str, bucket: int, paged: bool, softcap: bool) -> Variant:
    traits = f"cuattn::DecodeTraits<{bucket}>"
    return Variant(
        family=FAMILY, kernel="decode",
        expression=f"cuattn::decode_kernel<{cxx_type(c_type)}, {bucket}, {'true' if paged else 'false'}, {softcap_arg(softcap)}>",
        uri=f"decode/{c_type}/d{bucket}" + ("/paged" if paged else "") + softcap_uri(softcap),
        hot=True,
        dynamic_smem=smem_bytes(bucket),
        threads=WARPS * 32,
        block_m=ROWS,
        contract=(
            (f"{traits}::kSmemBytes", smem_bytes(bucket)), (f"{traits}::kThreads", WARPS * 32), ("cuattn::kDecodeRows", ROWS),
            ("cuattn::kDecodeBlockN", BLOCK_N), ("cuattn::kDecodeStages", STAGES),
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
        contract=(("cuattn::kCombineWarps", COMBINE_WARPS),),
    )


def num_splits(batch: int, heads_kv: int, row_blocks: int, capacity: int, sm_count: int) -> int:
    """Key splits per (sequence, KV head, row block), from host shapes only (so that one CUDA
    graph serves any lengths): enough CTAs to fill every SM CTAS_PER_SM times, and at most one
    split per 4 key blocks of the cache's capacity. Each sequence's keys are then divided into
    that many equal ranges on the device, so a skewed batch still spreads every sequence."""
    ctas = max(1, batch * heads_kv * row_blocks)
    wanted = -(-CTAS_PER_SM * sm_count // ctas)
    return max(1, min(wanted, -(-capacity // (4 * BLOCK_N)), MAX_SPLITS))


def grid(splits: int, heads_kv: int, row_blocks: int, batch: int) -> tuple[int, int, int]:
    if heads_kv * row_blocks > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"attention_with_kvcache supports at most {MAX_GRID_YZ} sequences and KV heads x row blocks, got {batch} and {heads_kv * row_blocks}")
    return (splits, heads_kv * row_blocks, batch)


def combine_grid(rows: int) -> tuple[int, int, int]:
    return (-(-rows // COMBINE_WARPS), 1, 1)


def variants(arch: str | None = None) -> list[Variant]:
    out = []
    for c_type in ("f16", "bf16"):
        for bucket in HEAD_DIM_BUCKETS:
            for paged in (False, True):
                for softcap in (False, True):
                    out.append(variant(c_type, bucket, paged, softcap))
            out.append(combine_variant(c_type, bucket))
    return out


def common_variants() -> list[Variant]:
    return [variant(c, 128, paged, False) for c in ("f16", "bf16") for paged in (False, True)] + [combine_variant(c, 128) for c in ("f16", "bf16")]
