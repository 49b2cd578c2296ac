"""Launch plan of the block-sparse family (cuda_src/sparse/): the order in which a block-sparse
attention launch's CTAs take their cells, heaviest mask rows first (block_schedule.cu)."""

from __future__ import annotations

import functools

from cuattn.kernels.variant import Variant

FAMILY = "sparse"
THREADS = 1024
MASK_BLOCK = 128  # rows and keys per mask block (common/block_sparse.cuh kSparseBlock): cuattn.block_mask.BLOCK_SIZE

# How each block-sparse kernel walks its grid: the side of the mask its x axis runs along ("q":
# query blocks, weighed by the key blocks each keeps; "k": key blocks, by the query blocks each
# keeps, summed over the GQA group) and whether x counts row blocks from the last (the
# kernels that start with the heaviest causal blocks: for_each_row_block, dq_block).
GRID_WALKS = {
    "forward": ("q", True), "forward_wgmma": ("q", True), "forward_tma": ("q", True), "forward_fp32": ("q", True),
    "backward_dq": ("q", True), "backward_wgmma_dq": ("q", True), "backward_fp32_dq": ("q", False),
    "backward_dkdv": ("k", False), "backward_wgmma_dkdv": ("k", False), "backward_wgmma_fused": ("k", False),
    "backward_tma": ("k", False),
    "backward_fp32_dkdv": ("k", False),
}


@functools.cache
def schedule_variant() -> Variant:
    return Variant(
        family=FAMILY, kernel="block_schedule",
        expression=f"cuattn::block_schedule_kernel<{THREADS}>",
        uri="sparse/block_schedule",
        threads=THREADS,
        contract=(("cuattn::kSparseBlock", MASK_BLOCK),),
    )


def variants(arch: str | None = None) -> list[Variant]:
    return [schedule_variant()]


def common_variants() -> list[Variant]:
    return []
