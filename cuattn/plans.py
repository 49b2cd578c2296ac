"""Launch plans: grid, block and shared memory for each kernel family."""

from __future__ import annotations

MERGE_THREADS = 256


def merge_grid(rows: int, head_dim: int, vec: int, device_id: int) -> tuple[int, int, int]:
    """One pass: enough blocks to cover every row once (the kernel grid-strides past 2^31 rows)."""
    group = 1
    while group < 32 and group * vec < head_dim:
        group *= 2
    rows_per_block = (MERGE_THREADS // 32) * (32 // group)
    blocks = -(-rows // rows_per_block)
    return (max(1, min(blocks, 2**31 - 1)), 1, 1)


MAX_GRID_YZ = 65535  # gridDim.y and gridDim.z limit
MAX_GRID_X = 2**31 - 1


def tile_launches(variant, rows: int, heads: int, batch: int) -> list[tuple[tuple, tuple, int]]:
    """(grid, block, batch_offset) of each launch of a tiled attention variant: one CTA per
    (block of rows, head, batch) on (x, y, z), batches in slices of at most 65535
    (cuda_src/common/grid.cuh)."""
    blocks = -(-rows // variant.block_m)
    if blocks > MAX_GRID_X or heads > MAX_GRID_YZ:
        raise ValueError(f"problem too large for one launch: {rows} rows x {heads} heads")
    block = (variant.threads, 1, 1)
    return [((blocks, heads, min(MAX_GRID_YZ, batch - b0)), block, b0) for b0 in range(0, batch, MAX_GRID_YZ)]
